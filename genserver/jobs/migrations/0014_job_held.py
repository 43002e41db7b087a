"""The fair window's `held` flag on a job (services/fairness.py), its index, and the tally's triggers again on SQLite."""

import importlib

from django.db import migrations, models

_tally = importlib.import_module("genserver.jobs.migrations.0013_queue_tally")


def reinstall_on_sqlite(apps, schema_editor):
    """SQLite remakes the job table to add a NOT NULL column, which drops 0013's triggers: install them again
    (and refill the tally from the rows, as 0013 does). PostgreSQL keeps them."""
    if schema_editor.connection.vendor != "sqlite":
        return
    _tally.uninstall(apps, schema_editor)
    schema_editor.execute("DELETE FROM jobs_queuetally")
    _tally.install(apps, schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0013_queue_tally"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="held",
            field=models.BooleanField(
                default=False,
                help_text="held by its owner's fair window (GENSERVER_FAIR_WINDOW): recorded, not yet published",
            ),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=models.Q(("held", True)),
                fields=["queue", "owner", "priority", "created_at"],
                name="job_held",
            ),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=models.Q(
                    ("chunks_run", 0), ("held", False), ("status__in", ("queued", "encoding", "denoising", "decoding"))
                ),
                fields=["owner", "queue"],
                name="job_fair_window",
            ),
        ),
        migrations.RunPython(reinstall_on_sqlite, migrations.RunPython.noop),
    ]
