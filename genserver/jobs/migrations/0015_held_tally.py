"""The fair window's held jobs tallied per (queue, class, priority, owner) by triggers (as 0013 does the waiting
jobs), and the index a published job's place reads the held jobs submitted after it over."""

from django.db import migrations, models

ACTIVE_STATUSES = "('queued', 'encoding', 'denoising', 'decoding')"
HELD = "{t}.held AND {t}.status IN " + ACTIVE_STATUSES
SECONDS = (
    "{t}.estimated_seconds * {greatest}(0, {t}.steps * {t}.segment_count - {t}.steps_done)"
    " / ({t}.steps * {t}.segment_count) * {t}.clock_scale"
)
KEY = (
    "queue = {t}.queue AND duration_class = {t}.duration_class AND priority = {t}.priority AND owner_id = {t}.owner_id"
)
# Leave a held job's row: one fewer, its seconds less (the last one leaves an exact 0, no float residue).
SUBTRACT = (
    "UPDATE jobs_heldtally SET count = count - 1, seconds = CASE WHEN count <= 1 THEN 0 ELSE seconds - ("
    + SECONDS
    + ") END WHERE "
    + KEY
)
ADD = (
    "INSERT INTO jobs_heldtally (queue, duration_class, priority, owner_id, count, seconds) "
    "VALUES ({t}.queue, {t}.duration_class, {t}.priority, {t}.owner_id, 1, " + SECONDS + ") "
    "ON CONFLICT (queue, duration_class, priority, owner_id) DO UPDATE "
    "SET count = jobs_heldtally.count + 1, seconds = jobs_heldtally.seconds + excluded.seconds"
)
FILL = (
    "INSERT INTO jobs_heldtally (queue, duration_class, priority, owner_id, count, seconds) "
    "SELECT queue, duration_class, priority, owner_id, COUNT(*), SUM("
    + SECONDS
    + ") FROM jobs_job AS j WHERE "
    + HELD
    + " GROUP BY queue, duration_class, priority, owner_id"
)
SQLITE_TRIGGERS = ("insert", "update_old", "update_new", "delete")


def _postgresql() -> list[str]:
    def fmt(text: str, t: str) -> str:
        return text.format(t=t, greatest="GREATEST")

    return [
        "CREATE OR REPLACE FUNCTION jobs_held_tally() RETURNS trigger AS $$\n"
        "BEGIN\n"
        f"  IF TG_OP IN ('UPDATE', 'DELETE') AND {fmt(HELD, 'OLD')} THEN\n"
        f"    {fmt(SUBTRACT, 'OLD')};\n"
        "  END IF;\n"
        f"  IF TG_OP IN ('INSERT', 'UPDATE') AND {fmt(HELD, 'NEW')} THEN\n"
        f"    {fmt(ADD, 'NEW')};\n"
        "  END IF;\n"
        "  RETURN NULL;\n"
        "END $$ LANGUAGE plpgsql",
        "CREATE TRIGGER jobs_held_tally AFTER INSERT OR UPDATE OR DELETE ON jobs_job "
        "FOR EACH ROW EXECUTE FUNCTION jobs_held_tally()",
        fmt(FILL, "j"),
    ]


def _sqlite() -> list[str]:
    def fmt(text: str, t: str) -> str:
        return text.format(t=t, greatest="MAX")

    def trigger(name: str, event: str, row: str, body: str) -> str:
        return f"CREATE TRIGGER jobs_held_tally_{name} AFTER {event} ON jobs_job WHEN {fmt(HELD, row)} BEGIN {fmt(body, row)}; END"

    return [
        trigger("insert", "INSERT", "NEW", ADD),
        trigger("update_old", "UPDATE", "OLD", SUBTRACT),
        trigger("update_new", "UPDATE", "NEW", ADD),
        trigger("delete", "DELETE", "OLD", SUBTRACT),
        fmt(FILL, "j"),
    ]


def install(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor not in ("postgresql", "sqlite"):
        raise RuntimeError(f"the held tally's triggers are written for PostgreSQL and SQLite, not {vendor}")
    for statement in _postgresql() if vendor == "postgresql" else _sqlite():
        schema_editor.execute(statement)


def uninstall(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP TRIGGER IF EXISTS jobs_held_tally ON jobs_job")
        schema_editor.execute("DROP FUNCTION IF EXISTS jobs_held_tally()")
    else:
        for name in SQLITE_TRIGGERS:
            schema_editor.execute(f"DROP TRIGGER IF EXISTS jobs_held_tally_{name}")


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0014_job_held"),
    ]

    operations = [
        migrations.CreateModel(
            name="HeldTally",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("queue", models.CharField(max_length=120)),
                ("duration_class", models.CharField(max_length=10)),
                ("priority", models.PositiveSmallIntegerField()),
                (
                    "owner_id",
                    models.BigIntegerField(help_text="the jobs' owner (no foreign key: only triggers write the row)"),
                ),
                ("count", models.BigIntegerField(default=0)),
                ("seconds", models.FloatField(default=0.0, help_text="Σ remaining_seconds × clock_scale of its jobs")),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("queue", "duration_class", "priority", "owner_id"), name="unique_held_tally"
                    )
                ],
            },
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=models.Q(("held", True), ("status__in", ("queued", "encoding", "denoising", "decoding"))),
                fields=["priority", "created_at"],
                name="job_held_order",
            ),
        ),
        migrations.RunPython(install, uninstall),
    ]
