"""The Celery application; its configuration lives in settings (CELERY_ prefix)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")

app = Celery("genserver")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["tasks"], related_name=None)  # imported when the worker starts
