"""Changing a job's step count midway: the API's request, and the worker that notices it."""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from genserver import deployment
from genserver.jobs import broker, flags, selectors
from genserver.jobs.models import Job, JobStage, JobStatus
from genserver.scheduling.admission import decide
from genserver.scheduling.classes import priority_for

from . import observe
from ._common import JobId, announce_on_commit, end_if_cancelled, publish_or_leave_to_reaper
from .estimates import rescale_to_total
from .submission import AdmissionRefused

log = logging.getLogger(__name__)


STEPS_CHANGEABLE = (JobStatus.QUEUED, JobStatus.ENCODING, JobStatus.DENOISING)


class StepsChangeRefused(Exception):
    """The job is past denoising (or being cancelled): its step count can no longer change (→ 409)."""

    def __init__(self, message: str, reason: str, status: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


def change_steps(job: Job, new_steps: int) -> Job:
    """Set a queued or denoising job's total to `new_steps` (validated against the model's limits).

    * More work than before goes through admission like a submit of the added seconds (as a new job
      of the job's class, on its queue): refused → AdmissionRefused, and nothing changes.
    * Cost and ETA scale with the total; the priority of the next message is recomputed
      (`priority_for`); class and queue stay as at submit.
    * A job no worker holds changes here: waiting between chunks with `new_steps` ≤ the steps
      done, it goes to decoding at once (its x0 estimate is decoded; `steps` becomes the steps
      done); otherwise its pending message runs with the new total (re-published when its
      priority moved; the duplicate finds the chunk taken and does nothing).
    * A worker holding it sees the new total (flags.raise_new_total) before its next step, saves its
      checkpoint there and hands the job back (`release_for_new_total`).

    `steps_requested` keeps the total asked at submit. Raises StepsChangeRefused when the job is
    decoding, finished or being cancelled.
    """
    now = timezone.now()
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job.pk)
        _check_steps_changeable(job)
        if new_steps == job.steps:
            return job
        added = job.estimated_seconds * (new_steps - job.steps) / job.steps
        if added > 0:
            _admit_added_work(job, added)
        held = bool(job.lease_owner) and job.lease_expires_at is not None and job.lease_expires_at >= now
        before = job.priority
        if job.status == JobStatus.DENOISING and not held and new_steps <= job.checkpoint_step:
            job.steps_done = job.checkpoint_step
            rescale_to_total(job, job.checkpoint_step)  # nothing runs it: stop now, at the steps done
            job.status, job.stage, job.published_at = JobStatus.DECODING, JobStage.WAITING, now
            job.lease_owner, job.lease_expires_at = "", None  # an expired holder, if any, finds it lost
            job.save()
            observe.transition(job.pk, JobStatus.DENOISING, JobStatus.DECODING, step=job.checkpoint_step)
            _decode_on_commit(job)
        else:
            rescale_to_total(job, new_steps)
            job.save()
            if job.status == JobStatus.DENOISING and not held and job.priority != before:
                transaction.on_commit(
                    lambda: publish_or_leave_to_reaper(
                        broker.send_chunk, job.id, job.checkpoint_step, job.queue, job.priority, job.model
                    )
                )
        total = job.steps
        transaction.on_commit(lambda: _mirror_steps(job.id, total))
        announce_on_commit(job.id, "steps")
    return job


def _check_steps_changeable(job: Job) -> None:
    if job.segment_count > 1:
        raise StepsChangeRefused(
            "The job is a long video made in segments; its steps cannot change midway.", "segmented", job.status
        )
    if job.cancel_requested and not job.is_terminal:
        raise StepsChangeRefused(
            "The job is being cancelled; its steps can no longer change.", "cancelling", job.status
        )
    if job.status not in STEPS_CHANGEABLE:
        when = "has finished" if job.is_terminal else "is already decoding"
        raise StepsChangeRefused(
            f"The job {when} (status {job.status}); its steps can change only while it is queued or denoising.",
            "finished" if job.is_terminal else "too_late",
            job.status,
        )


def _admit_added_work(job: Job, added_seconds: float) -> None:
    """Admission for the work an extension adds: decided as for a new job of that many seconds in the
    job's class and queue (work ahead of it, over the cards serving it, against the class limit)."""
    priority = priority_for(job.duration_class, added_seconds, False, deployment.thresholds())
    queue, capacity = job.queue or job.duration_class, selectors.live_capacity()
    wind = selectors.headwind_for(job.duration_class, queue, capacity)
    decision = decide(queue, priority, selectors.backlog_items(), capacity, deployment.limits(), wind)
    if not decision.accepted:
        raise AdmissionRefused(decision, job.duration_class)


def _decode_on_commit(job: Job) -> None:
    """The job's decode, published once its transition commits (left to the reaper if the broker is down)."""
    transaction.on_commit(lambda: publish_or_leave_to_reaper(broker.send_decode, job.id, job.priority, job.model))


def _mirror_steps(job_id: JobId, steps: int) -> None:
    try:
        flags.raise_new_total(job_id, steps)
    except Exception:  # noqa: BLE001 - the DB is the truth; finish_chunk applies it at the chunk's end
        log.warning("could not mirror the new step count of job %s in Redis", job_id)


def release_for_new_total(job_id: JobId, worker: str, step: int, checkpoint_key: str) -> bool:
    """The worker holding a denoising job saw its total change, saved its state at `step` (key "": no
    step since the last checkpoint) and stops: record it, let the job go, and publish what comes
    next with the new total: decode when the steps done reach it (the job stopped early; `steps`
    becomes the steps done), else the next chunk (which continues on a schedule for the new total).

    False when this worker no longer holds the job (nothing is changed).
    """
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id, lease_owner=worker, status=JobStatus.DENOISING).first()
        if job is None:
            return False
        if checkpoint_key and step > job.checkpoint_step:
            job.checkpoint_step = job.steps_done = step
            job.checkpoint_key = checkpoint_key
        job.lease_owner, job.lease_expires_at = "", None
        job.published_at = timezone.now()
        if end_if_cancelled(job):
            return True
        if job.checkpoint_step >= job.steps:
            rescale_to_total(job, job.checkpoint_step)
            job.status, job.stage = JobStatus.DECODING, JobStage.WAITING
            job.save()
            observe.transition(job.pk, JobStatus.DENOISING, JobStatus.DECODING, worker=worker, step=job.checkpoint_step)
            _decode_on_commit(job)
        else:
            job.priority = priority_for(
                job.duration_class, job.remaining_seconds, job.checkpoint_step > 0, deployment.thresholds()
            )
            job.stage = JobStage.WAITING
            job.save()
            transaction.on_commit(
                lambda: publish_or_leave_to_reaper(
                    broker.send_chunk, job.id, job.checkpoint_step, job.queue, job.priority, job.model
                )
            )
    return True
