"""Each user's jobs in flight, indexed: a submit counts them up to the user's limit (selectors.limit_counts)."""

from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0016_chunk_started_at"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=models.Q(
                    ("cancel_requested", False), ("status__in", ("queued", "encoding", "denoising", "decoding"))
                ),
                fields=["owner"],
                name="job_owner_in_flight",
            ),
        ),
    ]
