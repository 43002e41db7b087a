"""When a running job's current chunk began: a running chunk's rest in the ETAs is counted from it."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0015_held_tally"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="chunk_started_at",
            field=models.DateTimeField(
                blank=True,
                help_text="when its current chunk began (its claim, or a boundary where its card kept it)",
                null=True,
            ),
        ),
    ]
