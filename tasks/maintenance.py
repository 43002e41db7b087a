"""Periodic upkeep run by Celery beat on the `control` queue."""

from __future__ import annotations

from celery import shared_task

from genserver.jobs import broker, services


@shared_task(name=broker.REAP_TASK.name)
def reap() -> dict[str, int]:
    """End the queued jobs whose start deadline passed (`expired`), re-publish every job whose worker
    stopped renewing its lease, from its last checkpoint, and decide the overload cap."""
    expired = services.expire_overdue()
    outcomes = services.reap_stale()
    if expired:
        outcomes["expired"] = expired
    if services.update_long_cap().engaged:
        outcomes["long_cap_engaged"] = 1
    return outcomes


@shared_task(name=broker.RETAIN_TASK.name)
def retain() -> dict[str, int]:
    """Retention: expire old outputs and previews and failed jobs' kept checkpoints, delete prompt
    embeddings no job uses any more, purge old job rows (GENSERVER_JOB_TTL) with their files."""
    return services.retain()
