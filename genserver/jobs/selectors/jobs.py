"""Reads about one job: which jobs a user sees, and what a worker asks of a job before it takes it."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from genserver.jobs.models import Job


def jobs_visible_to(user: Any) -> QuerySet[Job]:
    """Staff see every job; a user sees only their own (another's is a 404, not a 403)."""
    qs = Job.objects.all()
    return qs if user.is_staff else qs.filter(owner=user)


def model_of(job_id) -> str | None:
    """The job's model name (None if there is no such job), read without taking it."""
    return Job.objects.filter(pk=job_id).values_list("model", flat=True).first()


def queue_and_priority(job_id: Any) -> tuple[str, int] | None:
    """The job's queue and current priority (None: no such job)."""
    row = Job.objects.filter(pk=job_id).values_list("queue", "priority").first()
    return (row[0], row[1]) if row else None
