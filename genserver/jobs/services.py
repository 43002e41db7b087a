"""The job service: every write to a Job, and the only code that changes `status`.

Each transition is one conditional UPDATE (compare-and-set on status, lease
and checkpoint step), so two workers, a redelivered message and the reaper
can race on a job and exactly one of them wins. Tasks are published only
after the transaction that made them valid commits.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, F, OuterRef, Q
from django.utils import timezone

from genserver import policy
from genserver.jobs import segment_service, selectors
from genserver.jobs.models import ACTIVE, TERMINAL, Job, JobSegment, JobStatus
from genserver.redis_client import CANCEL_KEY, CORRECTION_KEY, STEPS_KEY, client as redis_client
from genserver.scheduling.admission import Decision, decide
from genserver.scheduling.chunking import steps_per_chunk
from genserver.scheduling.classes import priority_for
from genserver.scheduling.cost import JobShape, StepTimeCorrection, estimate_job_seconds
from genserver.scheduling.pools import ALL_QUEUES, WEBHOOKS
from genserver.scheduling.segments import estimate_segmented_seconds, segment_plan, segment_shape

log = logging.getLogger(__name__)


class AdmissionRefused(Exception):
    def __init__(self, decision: Decision, duration_class: str) -> None:
        super().__init__(decision.reason)
        self.decision = decision
        self.duration_class = duration_class


class InFlightLimitReached(Exception):
    """The user already has MAX_JOBS_IN_FLIGHT unfinished jobs (→ 429 with Retry-After)."""

    def __init__(self, limit: int, in_flight: int, retry_after_seconds: int) -> None:
        super().__init__(f"You have {in_flight} unfinished jobs; at most {limit} may be queued or running at once. "
                         "Wait for one to finish or cancel one.")
        self.limit = limit
        self.in_flight = in_flight
        self.retry_after_seconds = retry_after_seconds


@dataclass(frozen=True)
class Estimate:
    seconds: float
    duration_class: str
    priority: int
    chunk_steps: int
    clock_scale: float
    segment_frames: int = 0  # a long video runs as segments of this many frames (0: one piece)
    segment_count: int = 1


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
    # A long video costs all its segments (each at the frames it generates).
    plan = segment_plan(data["num_frames"], spec.segment_frames, spec.limits.frames_step)
    # Simulated models *are* the cost model; only real ones learn from measured steps.
    correction = 1.0 if spec.backend == "simulated" else _correction(
        spec.name, segment_shape(shape, spec.segment_frames).bucket())
    seconds = estimate_segmented_seconds(shape, plan, spec.cost_points, settings.EFFECTIVE_TFLOPS, correction)
    duration_class = policy.thresholds().classify(seconds)
    total_steps = data["steps"] * len(plan)
    chunk_steps = min(data["steps"], steps_per_chunk(settings.CHUNK_SECONDS, seconds / total_steps))
    return Estimate(seconds=seconds, duration_class=duration_class,
                    priority=priority_for(duration_class, seconds, False, policy.thresholds()),
                    chunk_steps=chunk_steps, clock_scale=policy.clock_scale(spec.backend),
                    segment_frames=spec.segment_frames if len(plan) > 1 else 0, segment_count=len(plan))


def _on_queue(est: Estimate, queue: str, steps: int) -> Estimate:
    """Chunks of CHUNK_SECONDS of wall time where the job runs: a card group of k runs a step
    group_speedup(k) times faster, so its chunks hold that many more steps."""
    speedup = policy.layout().job_speedup(queue)
    if speedup == 1.0:
        return est
    chunk_steps = min(steps, steps_per_chunk(settings.CHUNK_SECONDS, est.seconds / steps / speedup))
    return replace(est, chunk_steps=chunk_steps)


# --- submit and cancel (API side) ------------------------------------------------

class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before for a different request (→ 422)."""


def fingerprint(data: dict[str, Any]) -> str:
    """A stable digest of a validated request (the seed included once it is drawn)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def replayed_job(owner: Any, idempotency_key: str, data: dict[str, Any]) -> Job | None:
    """The job an earlier submit with this key created, or None. Raises IdempotencyConflict when
    the key came with a different request. A request without a seed matches on everything else."""
    if not idempotency_key:
        return None
    job = Job.objects.filter(owner=owner, idempotency_key=idempotency_key).first()
    if job is None:
        return None
    candidate = {k: v for k, v in data.items() if k != "seed_drawn"}
    if data.get("seed_drawn"):
        candidate["seed"] = job.seed  # the retry drew its own seed; the first one's counts
    if job.request_fingerprint != fingerprint(candidate):
        raise IdempotencyConflict(f"Idempotency-Key {idempotency_key!r} was used for a different request "
                                  f"(job {job.pk}); use a new key for a new request.")
    return job


def submit_job(owner: Any, data: dict[str, Any], idempotency_key: str = "") -> Job:
    """Admit and record a validated request, then publish its encode task.

    Raises AdmissionRefused (→ 429) and writes nothing when the class is over its limit,
    and InFlightLimitReached (→ 429) when the owner has too many unfinished jobs; an
    IntegrityError when another submit recorded the same `idempotency_key` first.
    """
    from tasks import dispatch

    spec = policy.registry().get(data["model"])
    est = estimate(data)
    queue = policy.layout().queue_for(est.duration_class, spec.name, data.get("lane", ""))
    est = _on_queue(est, queue, data["steps"])
    decision = decide(queue, est.priority, selectors.backlog_items(), policy.layout(), policy.limits())
    if not decision.accepted:
        raise AdmissionRefused(decision, est.duration_class)
    recorded = {k: v for k, v in data.items() if k != "seed_drawn"}
    with transaction.atomic():
        check_in_flight(owner)
        job = _record_job(owner, spec, data, est, queue, idempotency_key, fingerprint(recorded))
        transaction.on_commit(lambda: publish_or_leave_to_reaper(dispatch.send_encode, job.id, job.priority))
    return job


def submit_or_replay(owner: Any, data: dict[str, Any], idempotency_key: str = "") -> tuple[Job, bool]:
    """(the job, whether it is a replay): a submit that a client may safely retry with the same key."""
    replay = replayed_job(owner, idempotency_key, data)
    if replay is not None:
        return replay, True
    try:
        return submit_job(owner, data, idempotency_key), False
    except IntegrityError:
        replay = replayed_job(owner, idempotency_key, data)  # a concurrent retry committed first
        if replay is None:
            raise
        return replay, True


def _record_job(owner: Any, spec: Any, data: dict[str, Any], est: Estimate, queue: str, idempotency_key: str,
                request_fingerprint: str) -> Job:
    return Job.objects.create(
        owner=owner, model=spec.name, family=spec.family, kind=spec.kind, backend=spec.backend,
        prompt=data["prompt"], negative_prompt=data.get("negative_prompt", ""),
        width=data["width"], height=data["height"], num_frames=data["num_frames"],
        steps=data["steps"], guidance_scale=data["guidance_scale"], seed=data["seed"],
        num_outputs=data["num_outputs"], preview_every=data.get("preview_every", 0),
        webhook_url=data.get("webhook_url", ""),
        estimated_seconds=est.seconds, clock_scale=est.clock_scale,
        duration_class=est.duration_class, queue=queue, priority=est.priority, chunk_steps=est.chunk_steps,
        segment_frames=est.segment_frames, segment_count=est.segment_count,
        published_at=timezone.now(), idempotency_key=idempotency_key, request_fingerprint=request_fingerprint,
    )


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


# --- changing the step count midway (API side, and the worker that notices) -------------

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
    * A worker holding it sees the new total in Redis (STEPS_KEY) before its next step, saves its
      checkpoint there and hands the job back (`release_for_new_total`).

    `steps_requested` keeps the total asked at submit. Raises StepsChangeRefused when the job is
    decoding, finished or being cancelled.
    """
    from tasks import dispatch

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
            _retotal(job, job.checkpoint_step)  # nothing runs it: stop now, at the steps done
            job.status, job.stage, job.published_at = JobStatus.DECODING, "waiting", now
            job.lease_owner, job.lease_expires_at = "", None  # an expired holder, if any, finds it lost
            job.save()
            transaction.on_commit(lambda: publish_or_leave_to_reaper(dispatch.send_decode, job.id, job.priority))
        else:
            _retotal(job, new_steps)
            job.save()
            if job.status == JobStatus.DENOISING and not held and job.priority != before:
                transaction.on_commit(lambda: publish_or_leave_to_reaper(
                    dispatch.send_chunk, job.id, job.checkpoint_step, job.queue, job.priority))
        total = job.steps
        transaction.on_commit(lambda: _mirror_steps(job.id, total))
    return job


def _check_steps_changeable(job: Job) -> None:
    if job.segment_count > 1:
        raise StepsChangeRefused("The job is a long video made in segments; its steps cannot change midway.",
                                 "segmented", job.status)
    if job.cancel_requested and not job.is_terminal:
        raise StepsChangeRefused("The job is being cancelled; its steps can no longer change.", "cancelling",
                                 job.status)
    if job.status not in STEPS_CHANGEABLE:
        when = "has finished" if job.is_terminal else "is already decoding"
        raise StepsChangeRefused(f"The job {when} (status {job.status}); its steps can change only while it is "
                                 f"queued or denoising.", "finished" if job.is_terminal else "too_late", job.status)


def _admit_added_work(job: Job, added_seconds: float) -> None:
    """Admission for the work an extension adds: decided as for a new job of that many seconds in the
    job's class and queue (work ahead of it, over the cards serving it, against the class limit)."""
    priority = priority_for(job.duration_class, added_seconds, False, policy.thresholds())
    decision = decide(job.queue or job.duration_class, priority, selectors.backlog_items(), policy.layout(),
                      policy.limits())
    if not decision.accepted:
        raise AdmissionRefused(decision, job.duration_class)


def _retotal(job: Job, steps: int) -> None:
    """Give `job` (locked, saved by the caller) the total `steps`: the cost scales with it, the chunk
    length and the next message's priority follow; class and queue stay as at submit."""
    if job.steps_requested is None:
        job.steps_requested = job.steps
    per_step = job.estimated_seconds / job.steps if job.steps else 0.0
    job.estimated_seconds = per_step * steps
    job.steps = steps
    job.chunk_steps = max(1, min(steps, steps_per_chunk(settings.CHUNK_SECONDS, per_step))) if per_step else steps
    job.priority = priority_for(job.duration_class, job.remaining_seconds, job.checkpoint_step > 0,
                                policy.thresholds())


def _mirror_steps(job_id, steps: int) -> None:
    try:
        redis_client().set(STEPS_KEY.format(job_id=job_id), str(steps), ex=7 * 24 * 3600)
    except Exception:  # noqa: BLE001 - the DB is the truth; finish_chunk applies it at the chunk's end
        log.warning("could not mirror the new step count of job %s in Redis", job_id)


def release_for_new_total(job_id, worker: str, step: int, checkpoint_key: str) -> bool:
    """The worker holding a denoising job saw its total change, saved its state at `step` (key "": no
    step since the last checkpoint) and stops: record it, let the job go, and publish what comes
    next with the new total: decode when the steps done reach it (the job stopped early; `steps`
    becomes the steps done), else the next chunk (which continues on a schedule for the new total).

    False when this worker no longer holds the job (nothing is changed).
    """
    from tasks import dispatch

    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id, lease_owner=worker,
                                                     status=JobStatus.DENOISING).first()
        if job is None:
            return False
        if checkpoint_key and step > job.checkpoint_step:
            job.checkpoint_step = job.steps_done = step
            job.checkpoint_key = checkpoint_key
        job.lease_owner, job.lease_expires_at = "", None
        job.published_at = timezone.now()
        if _end_if_cancelled(job):
            return True
        if job.checkpoint_step >= job.steps:
            _retotal(job, job.checkpoint_step)
            job.status, job.stage = JobStatus.DECODING, "waiting"
            job.save()
            transaction.on_commit(lambda: publish_or_leave_to_reaper(dispatch.send_decode, job.id, job.priority))
        else:
            job.priority = priority_for(job.duration_class, job.remaining_seconds, job.checkpoint_step > 0,
                                        policy.thresholds())
            job.stage = "waiting"
            job.save()
            transaction.on_commit(lambda: publish_or_leave_to_reaper(
                dispatch.send_chunk, job.id, job.checkpoint_step, job.queue, job.priority))
    return True


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


def claim_encode_batch(job: Job, worker: str, limit: int) -> list[Job]:
    """More queued jobs of `job`'s model for the same text-encoder call, best priority first.

    Each is taken with the same compare-and-set as `start_encoding`, so its own
    encode message later finds it taken and does nothing.
    """
    if limit <= 0:
        return []
    candidates = (Job.objects.filter(model=job.model, status=JobStatus.QUEUED, lease_owner="",
                                     cancel_requested=False).exclude(pk=job.pk)
                  .order_by("priority", "created_at").values_list("pk", flat=True)[:limit])
    return [taken for pk in list(candidates) if (taken := start_encoding(pk, worker)) is not None]


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
                                                          job.queue, job.priority))
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


def claim_merge_partners(job: Job, worker: str, max_rows: int) -> list[Job]:
    """Other jobs waiting to denoise with `job`'s shape at its step, to run as one batch with it.

    The shape is the merge key (model, size, frames, steps, guidance) and the
    step must match, so every member takes the same timestep. Candidates wait
    on the same queue (this worker consumes it) in priority order; their rows
    (outputs) together with `job`'s stay within `max_rows`. Each is taken with
    `claim_chunk`'s compare-and-set, so its own chunk message later finds it
    held and does nothing (their waiting messages are withdrawn from the
    broker, so the batch's yield test doesn't see them as work ahead of it;
    any that was missed does nothing). A job that failed once (attempts > 0) is never
    merged, neither way, so a poison job retries alone and cannot use up its
    batch mates' attempts.
    """
    rows = max_rows - job.num_outputs
    if rows <= 0 or job.attempts:
        return []
    now = timezone.now()
    candidates = (Job.objects.filter(_lease_free(now), status=JobStatus.DENOISING, cancel_requested=False,
                                     attempts=0, queue=job.queue, model=job.model, width=job.width,
                                     height=job.height, num_frames=job.num_frames, steps=job.steps,
                                     guidance_scale=job.guidance_scale, checkpoint_step=job.checkpoint_step,
                                     num_outputs__lte=rows)
                  .exclude(pk=job.pk).order_by("priority", "created_at")
                  .values_list("pk", "num_outputs")[:rows])
    partners = []
    for pk, outputs in list(candidates):
        if outputs > rows:
            continue
        taken = claim_chunk(pk, worker, job.checkpoint_step)
        if taken is not None:
            partners.append(taken)
            rows -= taken.num_outputs
    if partners:
        from tasks import dispatch

        try:
            # The lead's own duplicates too (a redelivery, a reaper re-publish): no-ops that the
            # yield test would count as work waiting ahead of the batch.
            dispatch.withdraw_chunks(job.queue, [job.pk, *(p.pk for p in partners)])
        except Exception:
            log.warning("could not withdraw the merged jobs' messages", exc_info=True)
    return partners


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
        if Job.objects.filter(pk=job_id, started_at__isnull=True).update(started_at=now):
            _emit_on_commit(job_id, "started")  # once: a resumed job does not start again
    return bool(renewed)


def record_preview(job_id, worker: str, key: str, step: int) -> None:
    if Job.objects.filter(pk=job_id, lease_owner=worker).update(preview_key=key, preview_step=step):
        _emit_on_commit(job_id, "preview")


def _emit_on_commit(job_id, event: str) -> None:
    """Publish the job's webhook event once the transition that made it true commits."""
    from genserver import webhooks

    transaction.on_commit(lambda: webhooks.emit(job_id, event))


def finish_chunk(job_id, worker: str, step: int, checkpoint_key: str, step_seconds: float | None,
                 keep_lease: bool = False) -> bool:
    """Record a saved checkpoint; then either keep the card (`keep_lease`: the worker runs the next
    chunk in-process) or publish what comes next (the next chunk, or decode) and let it go.

    False when this worker no longer holds the job or the step was already recorded.
    """
    from tasks import dispatch

    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id, lease_owner=worker,
                                                     status=JobStatus.DENOISING).first()
        if job is None or job.checkpoint_step >= step:
            return False
        job.checkpoint_step = job.steps_done = step
        job.checkpoint_key = checkpoint_key
        job.measured_step_seconds = step_seconds
        job.chunks_run += 1 if keep_lease else 0  # an in-process chunk counts like a claimed one
        if _end_if_cancelled(job):
            return True
        if job.segment_count <= 1 and step > job.steps:  # the total was lowered below what this chunk did
            _retotal(job, step)  # the job stops here
        if job.segment_count > 1 and step % job.steps == 0:
            segment_service.record_denoised(job, step // job.steps - 1, checkpoint_key)  # its decode overlaps
        if step < job.total_steps:
            job.priority = priority_for(job.duration_class, job.remaining_seconds, True, policy.thresholds())
        if keep_lease and step < job.total_steps:
            job.lease_expires_at = _lease_until()
            job.save()
        else:
            job.lease_owner, job.lease_expires_at = "", None
            job.published_at = timezone.now()
            if step >= job.total_steps:
                job.status, job.stage = JobStatus.DECODING, "waiting"
                job.save()
                if job.segment_count <= 1:  # a segmented job is assembled once its last segment is decoded
                    transaction.on_commit(lambda: dispatch.send_decode(job.id, job.priority))
            else:
                job.stage = "waiting"
                job.save()
                transaction.on_commit(lambda: dispatch.send_chunk(job.id, step, job.queue, job.priority))
    if step_seconds:
        # The correction learns single-card step times: a step on a group of k cards counts k × eff.
        spec = policy.layout().worker(worker.split("@", 1)[0])
        _learn_step_time(job, step_seconds * (spec.speedup if spec is not None else 1.0))
    return True


def _learn_step_time(job: Job, measured_step_seconds: float) -> None:
    if job.backend == "simulated":
        return
    shape = segment_shape(JobShape(job.family, job.width, job.height, job.num_frames, job.steps,
                                   job.guidance_scale, job.num_outputs), job.segment_frames)
    key = StepTimeCorrection.key(job.model, shape.bucket())
    try:
        r = redis_client()
        correction = StepTimeCorrection(ratios={key: float(r.hget(CORRECTION_KEY, key) or 1.0)})
        uncorrected_step = estimate_job_seconds(shape, policy.registry().get(job.model).cost_points,
                                                settings.EFFECTIVE_TFLOPS) / job.steps
        r.hset(CORRECTION_KEY, key, correction.observe(job.model, shape.bucket(), uncorrected_step,
                                                        measured_step_seconds))
    except Exception:
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
        full = disk_full(error)
        if full:  # retrying cannot help until someone frees space: fail now, with the reason first
            job.status, job.stage, job.finished_at = JobStatus.FAILED, "failed", now
            job.error = (f"storage full: {full} The job failed at once (not retried); free space and retry it "
                         f"from the admin.\n\n{job.error}")[:4000]
            job.save()
            transaction.on_commit(lambda: _after_end(job.pk))
            return "failed"
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
        dispatch.send_chunk(job.id, job.checkpoint_step, job.queue, job.priority)
    elif job.status == JobStatus.DECODING and job.segment_count > 1:
        segment_service.republish_decodes(job)  # the missing segment decodes, or the assembly
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
        # A waiting webhook delivery names the job too, but does not move it on.
        waiting = selectors.broker_job_ids((set(ALL_QUEUES) | policy.layout().all_queues()) - {WEBHOOKS})
        for job in orphans:
            if str(job.pk) in waiting:
                continue
            if Job.objects.filter(pk=job.pk, lease_owner="", published_at=job.published_at).update(published_at=now):
                log.warning("reaper: job %s had no message in the broker; re-published", job.pk)
                _republish(job)
                outcomes["republished"] = outcomes.get("republished", 0) + 1
    for outcome, n in segment_service.reap_segments(now).items():
        outcomes[f"segments {outcome}"] = n
    return outcomes


def _after_end(job_id) -> None:
    """Once a job is terminal (called after the transition committed): drop its checkpoints and
    cancel flag, and publish its webhook event (succeeded, failed or cancelled)."""
    from genserver import webhooks
    from genserver.storage import default_storage

    default_storage().delete_prefix(f"checkpoints/{job_id}")
    try:
        redis_client().delete(CANCEL_KEY.format(job_id=job_id))
    except Exception:  # noqa: BLE001 - a stale cancel flag expires with its job; Redis down must not block the end
        pass
    status = Job.objects.filter(pk=job_id).values_list("status", flat=True).first()
    if status in TERMINAL:
        webhooks.emit(job_id, status)


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
        JobStatus.DECODING if has_checkpoint and job.checkpoint_step >= job.total_steps else JobStatus.DENOISING)
    fields = dict(status=status, stage="retrying", attempts=0, error="", finished_at=None,
                  published_at=timezone.now())
    if not has_checkpoint:
        fields.update(checkpoint_step=0, checkpoint_key="", steps_done=0)
        if status == JobStatus.DECODING:
            fields["status"] = JobStatus.DENOISING
    if job.segment_count > 1 and job.embeddings_key:
        fields.update(segment_service.retry_fields(job))  # from the first segment not yet published
    if not Job.objects.filter(pk=job.pk, status=JobStatus.FAILED).update(**fields):
        return False
    job.refresh_from_db()
    _republish(job)
    return True


# --- limits ---------------------------------------------------------------------------

def check_in_flight(owner: Any) -> None:
    """Inside submit_job's transaction: refuse a user's job beyond MAX_JOBS_IN_FLIGHT unfinished ones.

    The owner's row is locked first (SELECT ... FOR UPDATE on PostgreSQL; SQLite's
    IMMEDIATE transactions serialise writers anyway), so two concurrent submits
    cannot both take the last place.
    """
    limit = settings.MAX_JOBS_IN_FLIGHT
    if limit <= 0:
        return
    list(type(owner).objects.select_for_update().filter(pk=owner.pk).values_list("pk", flat=True))
    active = list(Job.objects.filter(owner=owner, status__in=ACTIVE)
                  .values_list("estimated_seconds", "steps", "steps_done", "clock_scale", "segment_count"))
    if len(active) < limit:
        return
    # The soonest any of them can finish: its remaining work (all its segments), in wall seconds.
    soonest = min(est * max(0, steps * n - done) / (steps * n) * scale if steps else 0.0
                  for est, steps, done, scale, n in active)
    raise InFlightLimitReached(limit, len(active), max(1, math.ceil(soonest)))


# --- broker errors ------------------------------------------------------------------

def publish_or_leave_to_reaper(send, job_id, *args: Any) -> bool:
    """Publish a job's message after its row committed; if the broker is down, leave it to the reaper.

    The row is the truth and carries `published_at`: the reaper re-publishes an
    unheld job whose message is missing once LEASE_SECONDS have passed, so an
    accepted job is never lost, and the API still answers 201 (not a 500 for a
    job it did record, which a client would submit again).
    """
    try:
        send(job_id, *args)
        return True
    except Exception:
        log.warning("broker unavailable: job %s is recorded and the reaper will publish it", job_id, exc_info=True)
        return False


# --- storage errors -----------------------------------------------------------------

_DISK_FULL = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def disk_full(error: str) -> str | None:
    """The message of a stage's final exception (the last line of its traceback) when it is a full
    disk or quota (a StorageError from a write, or a bare OSError), else None."""
    lines = error.strip().splitlines()
    last = lines[-1] if lines else ""
    if any(marker in last for marker in _DISK_FULL):
        return last.split(": ", 1)[-1].strip()
    return None


# --- retention ------------------------------------------------------------------------

def retain(now=None) -> dict[str, int]:
    """Beat task body: expire old outputs and drop unused embeddings (checkpoints go when a job ends)."""
    now = now or timezone.now()
    return {"outputs_expired": expire_outputs(now), "embeddings_deleted": sweep_embeddings(now)}


def expire_outputs(now=None, batch: int = 500) -> int:
    """Delete outputs and previews of jobs that ended more than OUTPUT_TTL_SECONDS ago.

    The job row stays (its history, its error); a succeeded one shows stage
    "expired" and no outputs, and its old output URLs answer 404.
    """
    from genserver.storage import default_storage

    ttl = settings.OUTPUT_TTL_SECONDS
    if ttl <= 0:
        return 0
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=ttl)
    storage = default_storage()
    expired = 0
    has_segments = Exists(JobSegment.objects.filter(job=OuterRef("pk")))  # a long video's published clips
    candidates = (Job.objects.filter(~Q(outputs=[]) | ~Q(preview_key="") | has_segments, status__in=TERMINAL,
                                     finished_at__lt=cutoff)
                  .order_by("finished_at").values_list("pk", "status")[:batch])
    for pk, status in candidates:
        storage.delete_prefix(f"outputs/{pk}")
        storage.delete_prefix(f"previews/{pk}")
        fields: dict[str, Any] = {"outputs": [], "preview_key": ""}
        if status == JobStatus.SUCCEEDED:
            fields["stage"] = "expired"
        expired += Job.objects.filter(pk=pk, status__in=TERMINAL).update(**fields)
        JobSegment.objects.filter(job_id=pk).delete()
    return expired


def sweep_embeddings(now=None) -> int:
    """Delete cached prompt embeddings that no active job uses and none has used for EMBEDDINGS_TTL_SECONDS.

    Files referenced by an active job get their mtime refreshed (mtime = last
    seen in use). Candidates are renamed aside first, then the database is
    asked again: if an active job now references one, or any job is encoding
    (it may have just found the file in the cache), they are put back.
    """
    from genserver.storage import default_storage

    now = now or timezone.now()
    root = default_storage().path("embeddings")
    if not root.is_dir():
        return 0

    def in_use() -> set[str]:
        return set(Job.objects.filter(status__in=ACTIVE).exclude(embeddings_key="")
                   .values_list("embeddings_key", flat=True))

    for tomb in root.glob(".deleting-*"):  # left by a sweep that died midway: put back, decide again
        original = tomb.with_name(tomb.name[len(".deleting-"):])
        try:
            if original.exists():
                tomb.unlink(missing_ok=True)
            else:
                os.replace(tomb, original)
        except OSError:
            pass
    used = in_use()
    stamp = now.timestamp()
    for key in used:
        try:
            os.utime(default_storage().path(key), (stamp, stamp))
        except Exception:  # noqa: BLE001 - a missing file or an odd key: nothing to keep fresh
            pass
    oldest = stamp - settings.EMBEDDINGS_TTL_SECONDS
    aside: list[tuple[str, Path, Path]] = []
    for path in root.iterdir():
        key = f"embeddings/{path.name}"
        if not path.is_file() or path.name.startswith(".") or key in used:
            continue
        try:
            if path.stat().st_mtime >= oldest:
                continue
            tomb = path.with_name(f".deleting-{path.name}")
            os.replace(path, tomb)
        except OSError:
            continue
        aside.append((key, path, tomb))
    if not aside:
        return 0
    keep_all = Job.objects.filter(status=JobStatus.ENCODING).exists()
    used = in_use()
    deleted = 0
    for key, path, tomb in aside:
        try:
            if keep_all or key in used:
                os.replace(tomb, path)
            else:
                tomb.unlink(missing_ok=True)
                deleted += 1
        except OSError:
            log.warning("retention: could not settle %s", tomb, exc_info=True)
    return deleted
