"""Periodic upkeep run by Celery beat on the `control` queue."""
from __future__ import annotations

from celery import shared_task

from genserver.jobs import services


@shared_task(name="tasks.maintenance.reap")
def reap() -> dict[str, int]:
    """Re-publish every job whose worker stopped renewing its lease, from its last checkpoint."""
    return services.reap_stale()


@shared_task(name="tasks.maintenance.retain")
def retain() -> dict[str, int]:
    """Retention: expire old outputs and previews, delete prompt embeddings no job uses any more."""
    return services.retain()
