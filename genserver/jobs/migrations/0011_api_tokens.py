"""API tokens stored hashed (genserver/jobs/services/tokens.py), and DRF authtoken's plain keys converted.

Each key of DRF's `authtoken_token` table (deployed clients hold them) becomes an ApiToken with the key's
prefix and SHA-256, so the same `Authorization: Token <key>` keeps working, expiring
GENSERVER_API_TOKEN_DAYS after this migration. Then the table of plain keys is dropped (and authtoken's
migration records with it: the app is no longer installed, so nothing else would remove them).
"""

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

AUTHTOKEN_TABLE = "authtoken_token"


def _aware(created):
    """A row's `created` as a raw cursor gives it (SQLite: naive UTC, or text) → an aware datetime."""
    from datetime import UTC, datetime

    from django.utils.dateparse import parse_datetime

    if isinstance(created, str):
        created = parse_datetime(created)
    if not isinstance(created, datetime):
        return datetime.now(UTC)
    return created if created.tzinfo is not None else created.replace(tzinfo=UTC)


def convert_authtoken_keys(apps, schema_editor) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from genserver.jobs.services.tokens import digest_of, prefix_of

    connection = schema_editor.connection
    if AUTHTOKEN_TABLE not in connection.introspection.table_names():
        return  # a database made after authtoken left INSTALLED_APPS: nothing to convert
    ApiToken = apps.get_model("jobs", "ApiToken")
    expires_at = timezone.now() + timedelta(days=settings.API_TOKEN_DAYS)
    table = connection.ops.quote_name(AUTHTOKEN_TABLE)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {connection.ops.quote_name('key')}, user_id, created FROM {table}")
        rows = cursor.fetchall()
    ApiToken.objects.bulk_create(
        ApiToken(
            user_id=user_id,
            name="converted from DRF authtoken",
            prefix=prefix_of(key),
            digest=digest_of(key),
            created_at=_aware(created),
            expires_at=expires_at,
        )
        for key, user_id, created in rows
    )
    schema_editor.execute(f"DROP TABLE {table}")
    schema_editor.execute("DELETE FROM django_migrations WHERE app = %s", ["authtoken"])


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0010_quotas"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="ApiToken",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(blank=True, default="", help_text="what the token is for", max_length=100)),
                (
                    "prefix",
                    models.CharField(db_index=True, help_text="the key's first characters (not secret)", max_length=16),
                ),
                ("digest", models.CharField(help_text="SHA-256 of the key, hex", max_length=64, unique=True)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("expires_at", models.DateTimeField(blank=True, help_text="empty: never expires", null=True)),
                ("last_used_at", models.DateTimeField(blank=True, null=True)),
                (
                    "revoked_at",
                    models.DateTimeField(blank=True, help_text="set: refused from that moment on", null=True),
                ),
                (
                    "user",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="api_tokens",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "verbose_name": "API token",
                "ordering": ["-created_at"],
            },
        ),
        migrations.RunPython(convert_authtoken_keys, migrations.RunPython.noop, elidable=True),
    ]
