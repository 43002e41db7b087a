"""Every task the job service publishes (genserver/jobs/broker.py) is registered by tasks/ under that name, and back."""

from __future__ import annotations

import tasks  # noqa: F401 - registers the tasks
from genserver.celery import app
from genserver.jobs import broker


def test_published_names_are_the_registered_ones():
    declared = {route.name for route in vars(broker).values() if isinstance(route, broker.TaskRoute)}
    registered = {name for name in app.tasks if name.startswith("tasks.")}
    assert declared == registered


def test_beat_runs_declared_tasks_on_their_queues(settings):
    """settings.CELERY_BEAT_SCHEDULE spells the maintenance tasks' names and queue: they match broker's."""
    routes = {route.name: route for route in vars(broker).values() if isinstance(route, broker.TaskRoute)}
    for entry in settings.CELERY_BEAT_SCHEDULE.values():
        assert entry["task"] in routes, entry
        assert entry["options"]["queue"] == routes[entry["task"]].queue, entry
