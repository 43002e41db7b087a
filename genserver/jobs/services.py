"""The job service: every write to a Job, and the only code that changes `status`.

Each transition is one conditional UPDATE (compare-and-set on status, lease
and checkpoint step), so two workers, a redelivered message and the reaper
can race on a job and exactly one of them wins. Tasks are published only
after the transaction that made them valid commits.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from genserver import policy
from genserver.jobs import selectors
from genserver.jobs.models import ACTIVE, Job, JobStatus
from genserver.redis_client import CANCEL_KEY, CORRECTION_KEY, client as redis_client
from genserver.scheduling.admission import Decision, decide
from genserver.scheduling.chunking import steps_per_chunk
from genserver.scheduling.classes import priority_for
from genserver.scheduling.cost import JobShape, StepTimeCorrection, estimate_job_seconds
from genserver.scheduling.pools import ALL_QUEUES

log = logging.getLogger(__name__)


class AdmissionRefused(Exception):
    def __init__(self, decision: Decision, duration_class: str) -> None:
        super().__init__(decision.reason)
        self.decision = decision
        self.duration_class = duration_class


@dataclass(frozen=True)
class Estimate:
    seconds: float
    duration_class: str
    priority: int
    chunk_steps: int
    clock_scale: float


# --- estimates -----------------------------------------------------------------

def _correction(model: str, bucket: str) -> float:
    try:
        raw = redis_client().hget(CORRECTION_KEY, StepTimeCorrection.key(model, bucket))
    except Exception:  # noqa: BLE001 - a missing correction must never block a submit
        return 1.0
    return float(raw) if raw else 1.0


def estimate(data: dict[str, Any]) -> Estimate:
    """Cost, class, priority and chunking of a validated request."""
    spec = policy.registry().get(data["model"])
    shape = JobShape(family=spec.family, width=data["width"], height=data["height"],
                     num_frames=data["num_frames"], steps=data["steps"],
                     guidance_scale=data["guidance_scale"], num_outputs=data["num_outputs"])
    # Simulated models *are* the cost model; only real ones learn from measured steps.
    correction = 1.0 if spec.backend == "simulated" else _correction(spec.name, shape.bucket())
    seconds = estimate_job_seconds(shape, spec.cost_points, settings.EFFECTIVE_TFLOPS, correction)
    duration_class = policy.thresholds().classify(seconds)
    chunk_steps = min(data["steps"], steps_per_chunk(settings.CHUNK_SECONDS, seconds / data["steps"]))
    return Estimate(seconds=seconds, duration_class=duration_class,
                    priority=priority_for(duration_class, seconds, False, policy.thresholds()),
                    chunk_steps=chunk_steps, clock_scale=policy.clock_scale(spec.backend))


# --- submit and cancel (API side) ------------------------------------------------

def submit_job(owner: Any, data: dict[str, Any]) -> Job:
    """Admit and record a validated request, then publish its encode task.

    Raises AdmissionRefused (→ 429) and writes nothing when the class is over its limit.
    """
    from tasks import dispatch

    spec = policy.registry().get(data["model"])
    est = estimate(data)
    decision = decide(est.duration_class, est.priority, selectors.backlog_items(), policy.layout(),
                      policy.limits())
    if not decision.accepted:
        raise AdmissionRefused(decision, est.duration_class)
    with transaction.atomic():
        job = Job.objects.create(
            owner=owner, model=spec.name, family=spec.family, kind=spec.kind, backend=spec.backend,
            prompt=data["prompt"], negative_prompt=data.get("negative_prompt", ""),
            width=data["width"], height=data["height"], num_frames=data["num_frames"],
            steps=data["steps"], guidance_scale=data["guidance_scale"], seed=data["seed"],
            num_outputs=data["num_outputs"], preview_every=data.get("preview_every", 0),
            estimated_seconds=est.seconds, clock_scale=est.clock_scale,
            duration_class=est.duration_class, priority=est.priority, chunk_steps=est.chunk_steps,
            published_at=timezone.now(),
        )
        transaction.on_commit(lambda: dispatch.send_encode(job.id, job.priority))
    return job


def cancel_job(job: Job) -> Job:
    """Ask a job to stop. Idempotent; a finished job stays as it is.

    A job no worker holds ends `cancelled` at once (its queued message finds it
    terminal and does nothing); a running one sees the flag before its next
    step and ends itself, skipping decode.
    """
    if job.is_terminal:
        return job
    try:
        redis_client().set(CANCEL_KEY.format(job_id=job.id), "1", ex=7 * 24 * 3600)
    except Exception:  # noqa: BLE001 - the DB flag is the truth; workers also check it per chunk
        log.warning("could not mirror the cancel flag of job %s in Redis", job.id)
    now = timezone.now()
    Job.objects.filter(pk=job.pk, status__in=ACTIVE).update(cancel_requested=True)
    unheld = Q(lease_owner="") | Q(lease_expires_at__lt=now)
    ended = Job.objects.filter(unheld, pk=job.pk, status__in=ACTIVE).update(
        status=JobStatus.CANCELLED, stage="cancelled", finished_at=now, lease_owner="", lease_expires_at=None)
    if ended:
        _after_end(job.pk)
    job.refresh_from_db()
    return job


# --- worker side ------------------------------------------------------------------

def _lease_free(now) -> Q:
    return Q(lease_owner="") | Q(lease_expires_at__lt=now)


def _lease_until():
    return timezone.now() + timedelta(seconds=settings.LEASE_SECONDS)


def start_encoding(job_id, worker: str) -> Job | None:
    """Take the job's encode stage. None when it was cancelled, finished or is held elsewhere."""
    now = timezone.now()
    taken = Job.objects.filter(_lease_free(now), pk=job_id, cancel_requested=False,
                               status__in=(JobStatus.QUEUED, JobStatus.ENCODING)).update(
        status=JobStatus.ENCODING, stage="encoding", lease_owner=worker, lease_expires_at=_lease_until())
    return Job.objects.get(pk=job_id) if taken else None


def finish_encoding(job_id, worker: str, embeddings_key: str) -> bool:
    from tasks import dispatch

    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id, lease_owner=worker,
                                                     status=JobStatus.ENCODING).first()
        if job is None:
            return False
        job.embeddings_key = embeddings_key
        job.lease_owner, job.lease_expires_at = "", None
        if _end_if_cancelled(job):
            return True
        job.status, job.stage, job.published_at = JobStatus.DENOISING, "waiting", timezone.now()
        job.save()
        transaction.on_commit(lambda: dispatch.send_chunk(job.id, job.checkpoint_step,
                                                          job.duration_class, job.priority))
    return True


def _end_if_cancelled(job: Job) -> bool:
    """Inside a locked transition: a cancel that arrived while the stage ran ends the job here."""
    if not job.cancel_requested:
        return False
    job.status, job.stage, job.finished_at = JobStatus.CANCELLED, "cancelled", timezone.now()
    job.lease_owner, job.lease_expires_at = "", None
    job.save()
    transaction.on_commit(lambda: _after_end(job.pk))
    return True


def claim_chunk(job_id, worker: str, from_step: int) -> Job | None:
    """Take the chunk that starts at `from_step`. None when it already ran, runs elsewhere, or must not run."""
    now = timezone.now()
    taken = Job.objects.filter(_lease_free(now), pk=job_id, status=JobStatus.DENOISING,
                               checkpoint_step=from_step, cancel_requested=False).update(
        stage="denoising", lease_owner=worker, lease_expires_at=_lease_until(), chunks_run=F("chunks_run") + 1)
    return Job.objects.get(pk=job_id) if taken else None


def heartbeat(job_id, worker: str, steps_done: int | None = None) -> bool:
    """Renew the lease and record progress (steps_done=0: the first step begins, `started_at`).

    False when the lease was lost (the reaper gave the job to another worker): stop working.
    """
    now = timezone.now()
    fields: dict[str, Any] = {"lease_expires_at": _lease_until()}
    if steps_done is not None:
        fields["steps_done"] = steps_done
    renewed = Job.objects.filter(pk=job_id, lease_owner=worker, status__in=ACTIVE).update(**fields)
    if renewed and steps_done == 0:
        Job.objects.filter(pk=job_id, started_at__isnull=True).update(started_at=now)
    return bool(renewed)


def record_preview(job_id, worker: str, key: str, step: int) -> None:
    Job.objects.filter(pk=job_id, lease_owner=worker).update(preview_key=key, preview_step=step)


def finish_chunk(job_id, worker: str, step: int, checkpoint_key: str, step_seconds: float | None) -> bool:
    """Record a saved checkpoint and publish what comes next (the next chunk, or decode)."""
    from tasks import dispatch

    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id, lease_owner=worker,
                                                     status=JobStatus.DENOISING).first()
        if job is None or job.checkpoint_step >= step:
            return False
        job.checkpoint_step = job.steps_done = step
        job.checkpoint_key = checkpoint_key
        job.lease_owner, job.lease_expires_at = "", None
        job.published_at = timezone.now()
        job.measured_step_seconds = step_seconds
        if _end_if_cancelled(job):
            return True
        if step >= job.steps:
            job.status, job.stage = JobStatus.DECODING, "waiting"
            job.save()
            transaction.on_commit(lambda: dispatch.send_decode(job.id, job.priority))
        else:
            job.stage = "waiting"
            job.priority = priority_for(job.duration_class, job.remaining_seconds, True, policy.thresholds())
            job.save()
            transaction.on_commit(lambda: dispatch.send_chunk(job.id, step, job.duration_class, job.priority))
    if step_seconds:
        _learn_step_time(job, step_seconds)
    return True


def _learn_step_time(job: Job, measured_step_seconds: float) -> None:
    if job.backend == "simulated":
        return
    shape = JobShape(job.family, job.width, job.height, job.num_frames, job.steps, job.guidance_scale,
                     job.num_outputs)
    key = StepTimeCorrection.key(job.model, shape.bucket())
    try:
        r = redis_client()
        correction = StepTimeCorrection(ratios={key: float(r.hget(CORRECTION_KEY, key) or 1.0)})
        uncorrected_step = estimate_job_seconds(shape, policy.registry().get(job.model).cost_points,
                                                settings.EFFECTIVE_TFLOPS) / job.steps
        r.hset(CORRECTION_KEY, key, correction.observe(job.model, shape.bucket(), uncorrected_step,
                                                        measured_step_seconds))
    except Exception:  # noqa: BLE001 - learning is best effort
        log.warning("could not record step time of job %s", job.id, exc_info=True)


def start_decoding(job_id, worker: str) -> Job | None:
    now = timezone.now()
    taken = Job.objects.filter(_lease_free(now), pk=job_id, status=JobStatus.DECODING,
                               cancel_requested=False).update(
        stage="decoding", lease_owner=worker, lease_expires_at=_lease_until())
    return Job.objects.get(pk=job_id) if taken else None


def finish_decoding(job_id, worker: str, outputs: list[dict[str, str]]) -> bool:
    now = timezone.now()
    done = Job.objects.filter(pk=job_id, lease_owner=worker, status=JobStatus.DECODING).update(
        status=JobStatus.SUCCEEDED, stage="done", outputs=outputs, finished_at=now,
        lease_owner="", lease_expires_at=None)
    if done:
        _after_end(job_id)
    return bool(done)


def finish_cancelled(job_id, worker: str) -> bool:
    """The worker holding a job saw its cancel flag and stopped."""
    done = Job.objects.filter(pk=job_id, lease_owner=worker, status__in=ACTIVE).update(
        status=JobStatus.CANCELLED, stage="cancelled", finished_at=timezone.now(),
        lease_owner="", lease_expires_at=None)
    if done:
        _after_end(job_id)
    return bool(done)


def fail_attempt(job_id, worker: str | None, error: str) -> str:
    """A run of the job failed (an exception, or its worker died). Retry from the checkpoint or give up.

    `worker` None means the reaper, acting on an expired lease. Returns the outcome:
    "retried", "failed", or "ignored" (someone else already moved the job on).
    """
    now = timezone.now()
    held = Q(lease_owner=worker) if worker else Q(lease_expires_at__lt=now) & ~Q(lease_owner="")
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(held, pk=job_id, status__in=ACTIVE).first()
        if job is None:
            return "ignored"
        job.attempts += 1
        job.error = error[-4000:]
        job.lease_owner, job.lease_expires_at = "", None
        if _end_if_cancelled(job):
            return "cancelled"
        if job.attempts >= settings.MAX_ATTEMPTS:
            job.status, job.stage, job.finished_at = JobStatus.FAILED, "failed", now
            job.error = f"gave up after {job.attempts} attempts; last error: {job.error}"
            job.save()
            transaction.on_commit(lambda: _after_end(job.pk))
            return "failed"
        job.stage = "retrying"
        job.published_at = now
        job.save()
        transaction.on_commit(lambda: _republish(job))
        return "retried"


def _republish(job: Job) -> None:
    """Publish the task that continues `job` from where the database says it is."""
    from tasks import dispatch

    if job.status in (JobStatus.QUEUED, JobStatus.ENCODING):
        dispatch.send_encode(job.id, job.priority)
    elif job.status == JobStatus.DENOISING:
        dispatch.send_chunk(job.id, job.checkpoint_step, job.duration_class, job.priority)
    elif job.status == JobStatus.DECODING:
        dispatch.send_decode(job.id, job.priority)


def reap_stale() -> dict[str, int]:
    """Beat task body: recover jobs whose worker died or whose message was lost.

    1. A job whose lease expired lost its worker mid-stage: a failed attempt,
       retried from its checkpoint (or failed after MAX_ATTEMPTS).
    2. A job nobody holds, whose message is no longer waiting in the broker
       and was published more than a lease ago, lost its message (a worker
       died between taking it and claiming the job, or between committing a
       chunk and publishing the next; or Redis lost its data). It is
       re-published from the database; a duplicate would be harmless.
    """
    now = timezone.now()
    stale = list(Job.objects.filter(status__in=ACTIVE, lease_expires_at__lt=now)
                 .exclude(lease_owner="").values_list("pk", "lease_owner"))
    outcomes: dict[str, int] = {}
    for pk, owner in stale:
        outcome = fail_attempt(pk, None, f"worker {owner} stopped renewing its lease (lost or killed)")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome != "ignored":
            log.warning("reaper: job %s held by %s → %s", pk, owner, outcome)
    quiet_since = now - timedelta(seconds=settings.LEASE_SECONDS)
    orphans = list(Job.objects.filter(status__in=ACTIVE, lease_owner="", published_at__lt=quiet_since))
    if orphans:
        waiting = selectors.broker_job_ids(ALL_QUEUES)
        for job in orphans:
            if str(job.pk) in waiting:
                continue
            if Job.objects.filter(pk=job.pk, lease_owner="", published_at=job.published_at).update(published_at=now):
                log.warning("reaper: job %s had no message in the broker; re-published", job.pk)
                _republish(job)
                outcomes["republished"] = outcomes.get("republished", 0) + 1
    return outcomes


def _after_end(job_id) -> None:
    """Retention once a job is terminal: drop its checkpoints and cancel flag."""
    from genserver.storage import default_storage

    default_storage().delete_prefix(f"checkpoints/{job_id}")
    try:
        redis_client().delete(CANCEL_KEY.format(job_id=job_id))
    except Exception:  # noqa: BLE001
        pass


def reprioritise(job: Job, priority: int) -> Job:
    """Admin action: move a waiting job's next message to another priority (re-published)."""
    if not 0 <= priority <= 9:
        raise ValueError("priority must be between 0 (first) and 9")
    Job.objects.filter(pk=job.pk).update(priority=priority)
    job.refresh_from_db()
    if not job.is_terminal and not job.lease_owner:
        _republish(job)
    return job



def retry_failed(job: Job) -> bool:
    """Admin action: give a failed job a fresh set of attempts, continuing from its checkpoint."""
    from genserver.storage import default_storage

    if job.status != JobStatus.FAILED:
        return False
    has_checkpoint = bool(job.checkpoint_key) and default_storage().exists(job.checkpoint_key)
    status = JobStatus.QUEUED if not job.embeddings_key else (
        JobStatus.DECODING if has_checkpoint and job.checkpoint_step >= job.steps else JobStatus.DENOISING)
    fields = dict(status=status, stage="retrying", attempts=0, error="", finished_at=None,
                  published_at=timezone.now())
    if not has_checkpoint:
        fields.update(checkpoint_step=0, checkpoint_key="", steps_done=0)
        if status == JobStatus.DECODING:
            fields["status"] = JobStatus.DENOISING
    if not Job.objects.filter(pk=job.pk, status=JobStatus.FAILED).update(**fields):
        return False
    job.refresh_from_db()
    _republish(job)
    return True
