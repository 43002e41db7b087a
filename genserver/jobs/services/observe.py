"""What the job service tells operators about a job: one log line per status change, and the wait and delay.

A leaf (`_common` imports it): every transition that changes `status` calls
`transition()`, the first step calls `first_step()`. Both act after the
transaction commits (a rolled-back change is not reported), read the row
once more, and never raise: a log or a metric must not fail a job. In a worker
they act on its background thread (events.in_background), off the card's path.
"""

from __future__ import annotations

import logging
import socket
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db import transaction
from django.utils import timezone

from genserver import metrics
from genserver.jobs import events
from genserver.jobs.models import Job, JobStatus

# Its own logger, so the format and level of these lines are set apart from the rest (settings.LOGGING).
log = logging.getLogger("genserver.transitions")
JobId = UUID | str  # as in _common, which imports this module
_FIELDS = (
    "owner__username",
    "model",
    "duration_class",
    "created_at",
    "finished_at",
    "estimated_seconds",
    "clock_scale",
    "steps_done",
)


_THIS_HOST = socket.gethostname()  # read once: each call is a system call that lets go of the GIL, per submit


def node_of(worker: str) -> str:
    """The node a worker id names (`card0@host:pid` → `host`); this host for the API and the reaper."""
    if "@" in worker:
        return worker.split("@", 1)[1].rsplit(":", 1)[0]
    return _THIS_HOST


def transition(job_id: JobId, from_status: str, to_status: str, *, worker: str = "", step: int | None = None) -> None:
    """Report a status change once it commits (at once outside a transaction)."""
    if from_status == to_status:
        return
    transaction.on_commit(lambda: events.in_background(_report, job_id, str(from_status), str(to_status), worker, step))


def recorded(job: Job) -> None:
    """Report a new job once its row commits, from the row in hand (a submit re-reads nothing for its line)."""
    row = {name: getattr(job, name) for name in _FIELDS if name != "owner__username"}
    row["owner__username"] = job.owner.get_username()
    transaction.on_commit(lambda: _report(job.pk, "", str(job.status), "", None, row))


def first_step(job_id: JobId, now: datetime) -> None:
    """The job's first denoising step began: observe its wait (arrival → first step) in its class (on a worker's
    background thread: the card is about to step)."""
    events.in_background(_observe_wait, job_id, now)


def _observe_wait(job_id: JobId, now: datetime) -> None:
    row = Job.objects.filter(pk=job_id).values_list("duration_class", "created_at").first()
    if row is not None:
        metrics.observe(metrics.JOB_WAIT, row[0], (now - row[1]).total_seconds())


def _report(
    job_id: JobId, from_status: str, to_status: str, worker: str, step: int | None, row: dict[str, Any] | None = None
) -> None:
    try:
        row = row or Job.objects.filter(pk=job_id).values(*_FIELDS).first()
        if row is None:
            return
        now = timezone.now()
        if to_status == JobStatus.SUCCEEDED:
            # The seed's delay: completion − arrival − service seconds (the estimate, in wall seconds).
            finished = row["finished_at"] or now
            service = row["estimated_seconds"] * row["clock_scale"]
            delay = max(0.0, (finished - row["created_at"]).total_seconds() - service)
            metrics.observe(metrics.JOB_DELAY, row["duration_class"], delay)
        fields = {
            "event": "job.transition",
            "job_id": str(job_id),
            "user": row["owner__username"],
            "model": row["model"],
            "class": row["duration_class"],
            "from": from_status or None,
            "to": to_status,
            "step": row["steps_done"] if step is None else step,
            "worker": worker or None,
            "node": node_of(worker),
            "seconds": round((now - row["created_at"]).total_seconds(), 3),
        }
        log.info(
            "job %s %s → %s (user %s, model %s, class %s, step %s, worker %s, %.3f s since arrival)",
            job_id,
            from_status or "new",
            to_status,
            fields["user"],
            fields["model"],
            fields["class"],
            fields["step"],
            worker or "-",
            fields["seconds"],
            extra=fields,
        )
    except Exception:
        logging.getLogger(__name__).debug("could not report job %s's transition", job_id, exc_info=True)
