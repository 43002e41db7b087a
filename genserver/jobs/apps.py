"""App config for jobs."""

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "genserver.jobs"
    label = "jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from genserver.jobs import (
            checks,  # noqa: F401 - registers the start-up checks
            events,
        )
        from genserver.jobs.api.events import render_jobs

        events.set_renderer(render_jobs)  # events carry the API's representation; the service doesn't import the API
