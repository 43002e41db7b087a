"""App config for jobs."""

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "genserver.jobs"
    label = "jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_delete

        from genserver.jobs import (
            checks,  # noqa: F401 - registers the start-up checks
            events,
            services,
        )
        from genserver.jobs.api.events import render_jobs
        from genserver.jobs.models import Job

        # A deleted job (retention's purge, the admin) takes its files with it.
        post_delete.connect(services.job_deleted, sender=Job, dispatch_uid="jobs.job_deleted")

        events.set_renderer(render_jobs)  # events carry the API's representation; the service doesn't import the API
