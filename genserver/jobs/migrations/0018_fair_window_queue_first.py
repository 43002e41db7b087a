"""job_fair_window led by the queue: the fair picture reads a queue's published, unstarted jobs of every user.

Led by the owner, the index served a user's count (owner and queue) but not the queue's read, which SQLite then
took over the status index, every active job in turn: a burst held by the fair window (one job published,
thousands held) cost each submit a pass over all of them. Led by the queue, it serves both.
"""

from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0017_owner_in_flight_index"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RemoveIndex(model_name="job", name="job_fair_window"),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                condition=models.Q(
                    ("chunks_run", 0), ("held", False), ("status__in", ("queued", "encoding", "denoising", "decoding"))
                ),
                fields=["queue", "owner"],
                name="job_fair_window",
            ),
        ),
    ]
