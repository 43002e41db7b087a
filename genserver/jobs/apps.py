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
        _forget_access_copies_on_change()

        events.set_renderer(render_jobs)  # events carry the API's representation; the service doesn't import the API


def _forget_access_copies_on_change() -> None:
    """The API processes' copies of token, user and quota rows (selectors/access.py) end with any change to
    those rows: the token service moves the generation itself; these catch the admin's edits."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.db.models.signals import m2m_changed, post_delete, post_save

    from genserver.jobs.models import ApiToken, Quota
    from genserver.jobs.selectors.access import forget

    def on_save(sender: type, created: bool = False, update_fields: frozenset[str] | None = None, **_: object) -> None:
        # A new token or user was in nobody's copy; a login writes only last_login, which no copy uses. (A new
        # quota row changes what a user's copy says: Quota saves always forget.)
        if not created and set(update_fields or ()) != {"last_login"}:
            forget()

    def on_membership(action: str, **_: object) -> None:
        if action in ("post_add", "post_remove", "post_clear"):
            forget()

    user = get_user_model()
    for model in (ApiToken, user):
        post_save.connect(on_save, sender=model, weak=False, dispatch_uid=f"access.saved.{model._meta.label}")
    post_save.connect(forget, sender=Quota, weak=False, dispatch_uid="access.saved.quota")
    for model in (ApiToken, Quota, user, Group):
        post_delete.connect(forget, sender=model, weak=False, dispatch_uid=f"access.deleted.{model._meta.label}")
    m2m_changed.connect(on_membership, sender=user.groups.through, weak=False, dispatch_uid="access.groups")
