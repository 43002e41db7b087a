"""Re-prioritise: staff move a job within its class (POST /jobs/{id}/priority/ and the admin's action).

The priority is the Redis priority of the job's next message (0 first). It stays inside the band of the
job's duration class (`scheduling.classes.BANDS`: short 0-3, medium 4-5, long 6-8) and the queue stays as
at submit, so a job never moves across classes. A job nobody holds has its waiting message withdrawn and
published again at the new priority, so the order in the broker really changes; a held job takes it with
its next message (a continuation chunk's priority follows `priority_for` again, as for every job).
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from genserver.jobs import broker, events
from genserver.jobs.models import ACTIVE, Job, JobStatus
from genserver.scheduling.classes import band_bounds

from ._common import announce_on_commit, publish_or_leave_to_reaper
from .recovery import republish

log = logging.getLogger(__name__)


class PriorityRefused(Exception):
    """The job cannot be re-prioritised: `reason` "out_of_band" (→ 400) or "finished" (→ 409)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def priority_bounds(job: Job) -> tuple[int, int]:
    """The priorities the job may take (its class's band)."""
    return band_bounds(job.duration_class)


def reprioritise(job: Job, priority: int) -> Job:
    """Give the job's next message `priority` (within its class's band), re-publishing a waiting one.

    Raises PriorityRefused ("out_of_band") for a priority outside the band and ("finished") for a
    terminal job; nothing changes then. One compare-and-set on an active status: a job that ends
    meanwhile is refused, not changed.
    """
    first, last = priority_bounds(job)
    if not first <= priority <= last:
        raise PriorityRefused(
            f"A {job.duration_class} job takes a priority from {first} (served first) to {last}; "
            f"{priority} is another class's band. Choose one in {first}-{last}.",
            "out_of_band",
        )
    with transaction.atomic():
        locked = Job.objects.select_for_update().filter(pk=job.pk, status__in=ACTIVE).first()
        if locked is None:
            ended = Job.objects.filter(pk=job.pk).values_list("status", flat=True).first() or "deleted"
            raise PriorityRefused(f"Job {job.pk} has ended ({ended}); there is nothing to re-prioritise.", "finished")
        locked.priority = priority
        fields = ["priority", "updated_at"]
        waits = not locked.lease_owner and not locked.held  # a held job has no message: it just changes priority
        if waits:  # its message waits: it goes to the back of its new priority's list
            locked.published_at = timezone.now()
            fields.append("published_at")
        locked.save(update_fields=fields)
        if waits:
            transaction.on_commit(lambda: _republish(locked))
        announce_on_commit(locked.pk, "reprioritised")  # its queue position and ETA moved
        events.publish_queue_moved_on_commit(locked.queue)  # and those of the jobs it passed
    return locked


def _republish(job: Job) -> None:
    """Withdraw the job's waiting message and publish it at the job's priority (a message a worker took
    meanwhile is not found; the one published finds the job taken and does nothing)."""
    try:
        if job.status == JobStatus.DENOISING:
            broker.withdraw(broker.CHUNK_TASK, job.queue, [job.pk])
        elif job.status in (JobStatus.QUEUED, JobStatus.ENCODING):
            broker.withdraw(broker.ENCODE_TASK, "", [job.pk])
        elif job.status == JobStatus.DECODING and job.segment_count <= 1:
            broker.withdraw(broker.DECODE_TASK, "", [job.pk])
    except Exception:  # the old message is a harmless duplicate; the new one is what counts
        log.warning("could not withdraw the waiting message of job %s", job.pk, exc_info=True)
    publish_or_leave_to_reaper(lambda _pk: republish(job), job.pk)
