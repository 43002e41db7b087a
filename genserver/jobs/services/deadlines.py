"""Start deadlines: the quote a `start_within` submit is refused with, and the end of a job that missed its start.

A job submitted with `start_within` records `start_deadline`. Until its first
denoising step (`started_at`) it may end `expired`, never after: the beat
sweeper (`expire_overdue`) ends the unheld ones, and a worker that takes the
message of an overdue job ends it instead of running it (`expire_if_overdue`,
called by the claims in `transitions`). Both are one compare-and-set on
status, lease and `started_at`, so a job that started is never expired and an
expired one never starts.
"""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from genserver.jobs import broker
from genserver.jobs.models import Job, JobStage, JobStatus

from . import observe
from ._common import JobId, after_end, lease_free

log = logging.getLogger(__name__)

# What may expire: not started, and not past the point of no return (decoding never happens before a step).
EXPIRABLE = (JobStatus.QUEUED, JobStatus.ENCODING, JobStatus.DENOISING)


class StartDeadlineRefused(Exception):
    """The expected start is later than the request's `start_within` (→ 429 with the quote); nothing recorded."""

    def __init__(self, start_within: int, expected_wait_seconds: float, own_seconds: float) -> None:
        now = timezone.now()
        self.start_within = start_within
        self.expected_start_at: datetime | None = None
        self.expected_finish_at: datetime | None = None
        if math.isinf(expected_wait_seconds):
            self.retry_after_seconds = 60
            message = (
                f"No live card serves this job's queue now, so it cannot start within {start_within} s; "
                "retry later or submit without start_within."
            )
        else:
            self.expected_start_at = now + timedelta(seconds=round(expected_wait_seconds, 3))
            self.expected_finish_at = now + timedelta(seconds=round(expected_wait_seconds + own_seconds, 3))
            self.retry_after_seconds = max(1, math.ceil(expected_wait_seconds - start_within))
            message = (
                f"Expected to start in {expected_wait_seconds:.1f} s, later than start_within={start_within} s; "
                f"raise start_within to at least {math.ceil(expected_wait_seconds)}, or retry after "
                f"{self.retry_after_seconds} s."
            )
        super().__init__(message)


def deadline_from(start_within: int | None) -> datetime | None:
    """The `start_deadline` of a job submitted now with `start_within` seconds (None: no deadline)."""
    return timezone.now() + timedelta(seconds=start_within) if start_within else None


def _overdue(now: datetime) -> Q:
    return Q(status__in=EXPIRABLE, started_at__isnull=True, start_deadline__lt=now) & lease_free(now)


def not_overdue(now: datetime) -> Q:
    """A claim's guard with the same `now` as `expire_if_overdue`: a job that never started and is past its
    deadline is not taken (it is expired instead, by that call or the sweeper)."""
    return Q(start_deadline__isnull=True) | Q(start_deadline__gte=now) | Q(started_at__isnull=False)


def _reason(deadline: datetime | None, now: datetime) -> str:
    late = f" ({(now - deadline).total_seconds():.1f} s ago)" if deadline else ""
    return (
        f"start deadline passed: the job had not started by {deadline.isoformat() if deadline else '?'}{late} "
        "(start_within at submit); nothing ran. Submit it again, with a longer start_within or none."
    )


def expire_if_overdue(job_id: JobId, now: datetime | None = None) -> bool:
    """End the job `expired` when its start deadline passed and nobody holds it (a worker's claim, the sweeper).

    True when this call ended it. One compare-and-set: a job that started, or that another worker holds,
    is left as it is.
    """
    now = now or timezone.now()
    row = Job.objects.filter(_overdue(now), pk=job_id).values_list("status", "start_deadline").first()
    if row is None:
        return False
    before, deadline = row
    ended = Job.objects.filter(_overdue(now), pk=job_id).update(
        status=JobStatus.EXPIRED,
        stage=JobStage.EXPIRED,
        error=_reason(deadline, now),
        finished_at=now,
        lease_owner="",
        lease_expires_at=None,
        held=False,  # a held job expires without ever being published
    )
    if not ended:
        return False
    observe.transition(job_id, before, JobStatus.EXPIRED)
    transaction.on_commit(lambda: after_end(job_id))  # its checkpoints, events and webhook, as every end
    return True


def expire_overdue(now: datetime | None = None) -> int:
    """Beat task body: end every queued job whose start deadline passed (its waiting message is withdrawn;
    one a worker takes meanwhile finds it terminal). Returns how many it ended."""
    now = now or timezone.now()
    overdue = list(Job.objects.filter(_overdue(now)).values_list("pk", "status", "queue"))
    expired = 0
    for pk, status, queue in overdue:
        if not expire_if_overdue(pk, now):
            continue
        expired += 1
        try:
            if status == JobStatus.DENOISING:
                broker.withdraw(broker.CHUNK_TASK, queue, [pk])
            else:
                broker.withdraw(broker.ENCODE_TASK, "", [pk])
        except Exception:  # a message left behind finds the job terminal and does nothing
            log.warning("could not withdraw the message of expired job %s", pk, exc_info=True)
    return expired
