"""The fair window's held jobs tallied per (queue, class, priority, owner) by triggers (as 0013 does the waiting
jobs), and the index a published job's place reads the held jobs submitted after it over."""

from django.db import migrations, models

from genserver.jobs.migrations._tally_triggers import ACTIVE_STATUSES, Tally

HELD = "{t}.held AND {t}.status IN " + ACTIVE_STATUSES
TALLY = Tally("jobs_heldtally", "jobs_held_tally", HELD, ("queue", "duration_class", "priority", "owner_id"))


def install(apps, schema_editor):
    TALLY.install(schema_editor)


def uninstall(apps, schema_editor):
    TALLY.uninstall(schema_editor)


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
