"""The Celery application; its configuration lives in settings (CELERY_ prefix)."""

import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")

app = Celery("genserver")
app.config_from_object("django.conf:settings", namespace="CELERY")


@signals.celeryd_init.connect
def import_tasks_in_a_worker(**_: object) -> None:
    """A worker imports tasks/ (and the runtime, torch with it) as it starts, before it consumes.

    Only workers run tasks. Beat sends its schedule by name, and the API publishes by
    name (genserver/jobs/broker.py), so neither loads torch: beat's memory stays that
    of a small Python process, and it starts in a fraction of the time.
    """
    app.autodiscover_tasks(["tasks"], related_name=None, force=True)
