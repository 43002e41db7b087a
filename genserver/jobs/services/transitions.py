"""The worker's transitions: claim a stage, renew its lease, record chunks and previews, finish it.

Each is one compare-and-set on status, lease and checkpoint step, so two
workers or a redelivered message race and exactly one wins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from genserver import deployment, metrics
from genserver.jobs import broker, events, rows, segment_service
from genserver.jobs.models import ACTIVE, Job, JobStage, JobStatus
from genserver.redis_client import DECODE, LEAD_IN, STEP, TAIL
from genserver.scheduling.classes import priority_for

from . import fairness, observe, quotas
from ._common import (
    CompiledUpdate,
    CompiledWrite,
    JobId,
    after_end_soon,
    announce_on_commit,
    emit_on_commit,
    end_if_cancelled,
    lease_free,
    lease_until,
    update_returning,
)
from .deadlines import expire_if_overdue, not_overdue
from .estimates import learn_stage_seconds, learn_step_time, rescale_to_total

log = logging.getLogger(__name__)


def start_encoding(job_id: JobId, worker: str) -> Job | None:
    """Take the job's encode stage. None when it was cancelled, finished, is held elsewhere, or missed its
    start deadline (it ends `expired` here instead of running)."""
    now = timezone.now()
    take = {"now": now, "worker": worker, "lease_until": lease_until()}
    # One UPDATE … RETURNING either way; the first says "from".
    if job := _START_ENCODING(job_id, **take, status=JobStatus.QUEUED):
        observe.transition(job_id, JobStatus.QUEUED, JobStatus.ENCODING, worker=worker)
    elif not (job := _START_ENCODING(job_id, **take, status=JobStatus.ENCODING)):  # a retried encode
        expire_if_overdue(job_id, now)  # not taken: an overdue job ends here (the guard refused it)
        return None
    announce_on_commit(job_id, "encoding")
    return job


def _start_encoding_shape(values: dict[str, Any]) -> tuple[Q, dict[str, Any]]:
    now = values["now"]
    free = lease_free(now) & not_overdue(now) & Q(cancel_requested=False, held=False, status=values["status"])
    return free, {
        "status": JobStatus.ENCODING,
        "stage": JobStage.ENCODING,
        "lease_owner": values["worker"],
        "lease_expires_at": values["lease_until"],
    }


# The encode's take (on a miss, the way from submit to first step): compiled once per process; `status` is the one
# it takes the job from (queued, or encoding for a retried encode).
_START_ENCODING = CompiledUpdate(
    _start_encoding_shape,
    {"now": "lease_expires_at", "worker": "lease_owner", "lease_until": "lease_expires_at", "status": "status"},
)


def claim_encode_batch(job: Job, worker: str, limit: int) -> list[Job]:
    """More queued jobs of `job`'s model for the same text-encoder call, best priority first.

    Each is taken with the same compare-and-set as `start_encoding`, so its own
    encode message later finds it taken and does nothing.
    """
    if limit <= 0:
        return []
    candidates = (
        Job.objects.filter(model=job.model, status=JobStatus.QUEUED, lease_owner="", cancel_requested=False, held=False)
        .exclude(pk=job.pk)
        .order_by("priority", "created_at")
        .values_list("pk", flat=True)[:limit]
    )
    return [taken for pk in list(candidates) if (taken := start_encoding(pk, worker)) is not None]


def finish_encoding(job_id: JobId, worker: str, embeddings_key: str, claimed: Job | None = None) -> bool:
    """Record the job's embeddings and publish its first chunk. False when this worker no longer holds its encode.

    `claimed`: the worker's copy of the row as `start_encoding` took it (its `published_at` says when the encode
    was published, what LEAD_IN learns); with it, the common case (not cancelled meanwhile) is one compare-and-set
    and the chunk's publish the first thing after it, on the path from submit to first step. Without it, or when a
    cancel arrived while it encoded, a locked read and save."""
    if claimed is not None:
        encoded = _FINISH_ENCODING(job_id, worker=worker, embeddings_key=embeddings_key, now=timezone.now())
        if encoded is not None:
            transaction.on_commit(lambda: _first_chunk_published(encoded, claimed.published_at, worker))
            return True
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id, lease_owner=worker, status=JobStatus.ENCODING).first()
        if job is None:
            return False
        job.embeddings_key = embeddings_key
        job.lease_owner, job.lease_expires_at = "", None
        if end_if_cancelled(job):
            return True
        encode_published = job.published_at  # its encode message's publish (or release)
        job.status, job.stage, job.published_at = JobStatus.DENOISING, JobStage.WAITING, timezone.now()
        job.save()
        transaction.on_commit(lambda: _first_chunk_published(job, encode_published, worker))
    return True


def _finish_encoding_shape(values: dict[str, Any]) -> tuple[Q, dict[str, Any]]:
    return Q(lease_owner=values["worker"], status=JobStatus.ENCODING, cancel_requested=False), {
        "embeddings_key": values["embeddings_key"],
        "lease_owner": "",
        "lease_expires_at": None,
        "status": JobStatus.DENOISING,
        "stage": JobStage.WAITING,
        "published_at": values["now"],
    }


_FINISH_ENCODING = CompiledUpdate(
    _finish_encoding_shape, {"worker": "lease_owner", "embeddings_key": "embeddings_key", "now": "published_at"}
)


def _first_chunk_published(job: Job, encode_published: datetime | None, worker: str) -> None:
    """After the encoded job's row committed: its chunk first, then what no card waits for."""
    _publish_first_chunk(job)
    observe.transition(job.pk, JobStatus.ENCODING, JobStatus.DENOISING, worker=worker)
    events.publish_soon(job.pk, "waiting")
    if encode_published is not None and job.published_at is not None:
        lead_in = (job.published_at - encode_published).total_seconds()
        events.in_background(learn_stage_seconds, job.model, LEAD_IN, lead_in)


def _publish_first_chunk(job: Job) -> None:
    """The encoded job's chunk, then the end of its announcement (a card holding at a boundary stops holding)."""
    broker.send_chunk(job.id, job.checkpoint_step, job.queue, job.priority, job.model, row=rows.row_of(job))
    broker.arrived(job.id, job.queue)


def _claim_chunk_shape(values: dict[str, Any]) -> tuple[Q, dict[str, Any]]:
    now = values["now"]
    conditions = (
        lease_free(now)
        & not_overdue(now)
        & Q(status=JobStatus.DENOISING, checkpoint_step=values["from_step"], cancel_requested=False, held=False)
    )
    return conditions, {
        "stage": JobStage.DENOISING,
        "lease_owner": values["worker"],
        "lease_expires_at": values["lease_until"],
        "chunks_run": F("chunks_run") + 1,
        "chunk_started_at": now,
    }


# On the way from submit to a job's first step: compiled once per process.
_CLAIM_CHUNK = CompiledUpdate(
    _claim_chunk_shape,
    {
        "now": "chunk_started_at",
        "worker": "lease_owner",
        "from_step": "checkpoint_step",
        "lease_until": "lease_expires_at",
    },
)


def claim_chunk(job_id: JobId, worker: str, from_step: int) -> Job | None:
    """Take the chunk that starts at `from_step`. None when it already ran, runs elsewhere, or must not run
    (an overdue job that never started ends `expired` here instead)."""
    now = timezone.now()
    job = _CLAIM_CHUNK(job_id, now=now, worker=worker, from_step=from_step, lease_until=lease_until())
    if job is None:
        # Only a chunk not taken asks why: one read fewer on the common path (the claim's guard refuses an
        # overdue job with the same `now`).
        expire_if_overdue(job_id, now)
        return None
    announce_on_commit(job_id, "denoising")
    events.publish_queue_moved_on_commit(job.queue)  # the jobs behind it moved up
    if job.chunks_run == 1:  # its first chunk: it started, and leaves its owner's fair window
        # Both off the card's path (a worker's background thread); the reaper releases what a crash left held.
        transaction.on_commit(lambda: events.in_background(fairness.release_held, job.owner_id, job.queue))
        transaction.on_commit(lambda: events.in_background(fairness.clear_ahead, job_id))  # it cuts no chunk now
    return job


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
    candidates = (
        Job.objects.filter(
            lease_free(now),
            status=JobStatus.DENOISING,
            cancel_requested=False,
            held=False,
            attempts=0,
            queue=job.queue,
            model=job.model,
            width=job.width,
            height=job.height,
            num_frames=job.num_frames,
            steps=job.steps,
            guidance_scale=job.guidance_scale,
            checkpoint_step=job.checkpoint_step,
            num_outputs__lte=rows,
        )
        .exclude(pk=job.pk)
        .order_by("priority", "created_at")
        .values_list("pk", "num_outputs")[:rows]
    )
    partners = []
    for pk, outputs in list(candidates):
        if outputs > rows:
            continue
        taken = claim_chunk(pk, worker, job.checkpoint_step)
        if taken is not None:
            partners.append(taken)
            rows -= taken.num_outputs
    if partners:
        try:
            # The lead's own duplicates too (a redelivery, a reaper re-publish): no-ops that the
            # yield test would count as work waiting ahead of the batch.
            broker.withdraw_chunks(job.queue, [job.pk, *(p.pk for p in partners)])
        except Exception:
            log.warning("could not withdraw the merged jobs' messages", exc_info=True)
    return partners


def record_first_step(job_id: JobId, at: datetime) -> None:
    """The job's first step began `at`: its `started_at`, and its `started` event, once (a job retried from its
    start does not start again). The denoise task writes it beside that step rather than before it: the claim has
    just renewed the lease, and a retry resets the progress itself (`fail_attempt`)."""
    if _FIRST_STEP(job_id, at=at):
        emit_on_commit(job_id, "started")
        observe.first_step(job_id, at)


_FIRST_STEP = CompiledWrite(lambda v: (Q(started_at__isnull=True), {"started_at": v["at"]}), {"at": "started_at"})


def heartbeat(job_id: JobId, worker: str, steps_done: int | None = None, *, chunk_starts: bool = False) -> bool:
    """Renew the lease and record progress.

    `chunk_starts`: a boundary where the card keeps the job and writes no checkpoint (GENSERVER_CHECKPOINT_EVERY):
    the next chunk starts now, which the queue picture counts what is left of it from (`chunk_started_at`).
    False when the lease was lost (the reaper gave the job to another worker): stop working.
    """
    beat = _HEARTBEATS[steps_done is not None, chunk_starts]
    renewed = beat(job_id, worker=worker, lease_until=lease_until(), steps_done=steps_done, now=timezone.now())
    if renewed and steps_done:
        announce_on_commit(job_id, "progress")
    return renewed


def _heartbeat_shape(progress: bool, chunk_starts: bool) -> Callable[[dict[str, Any]], tuple[Q, dict[str, Any]]]:
    """A heartbeat's statement: the lease renewed, and the progress and the next chunk's start where given."""

    def shape(values: dict[str, Any]) -> tuple[Q, dict[str, Any]]:
        fields: dict[str, Any] = {"lease_expires_at": values["lease_until"]}
        if progress:
            fields["steps_done"] = values["steps_done"]
        if chunk_starts:
            fields["chunk_started_at"] = values["now"]
        return Q(lease_owner=values["worker"], status__in=ACTIVE), fields

    return shape


# Every running job's, once a second (and at a kept boundary between checkpoints): compiled once per process.
_HEARTBEATS = {
    (progress, chunk_starts): CompiledWrite(
        _heartbeat_shape(progress, chunk_starts),
        {
            "worker": "lease_owner",
            "lease_until": "lease_expires_at",
            "steps_done": "steps_done",
            "now": "chunk_started_at",
        },
    )
    for progress in (False, True)
    for chunk_starts in (False, True)
}


def resume_from_earlier_checkpoint(job_id: JobId, worker: str, lost_key: str, step: int, key: str) -> bool:
    """The job's recorded checkpoint `lost_key` cannot be read (written without its fsync, then the machine lost
    power: workers/runtime/stages.py): its holder resumes it from the earlier checkpoint at `step` (`key`; "" for
    its first step), which the job's row then records, its progress with it. False when the lease or the
    recorded checkpoint changed meanwhile."""
    moved = Job.objects.filter(pk=job_id, lease_owner=worker, status__in=ACTIVE, checkpoint_key=lost_key).update(
        checkpoint_key=key, checkpoint_step=step, steps_done=step
    )
    if moved:
        log.warning("job %s: checkpoint %s unreadable, resumed from step %d (%s)", job_id, lost_key, step, key or "-")
    return bool(moved)


def record_preview(job_id: JobId, worker: str, key: str, step: int) -> None:
    """A preview taken after `step` steps: it is the job's progress too (heartbeats record steps only
    every few seconds, so without this a poll or the preview event would still say step 0)."""
    if Job.objects.filter(pk=job_id, lease_owner=worker).update(preview_key=key, preview_step=step, steps_done=step):
        emit_on_commit(job_id, "preview")


def finish_chunk(
    job_id: JobId,
    worker: str,
    step: int,
    checkpoint_key: str,
    step_seconds: float | None,
    keep_lease: bool = False,
    chunk_seconds: float | None = None,
    claimed: Job | None = None,
    learn: bool = True,
) -> bool:
    """Record a saved checkpoint; then either keep the card (`keep_lease`: the worker runs the next
    chunk in-process) or publish what comes next (the next chunk, or decode) and let it go.

    `chunk_seconds`: the chunk's measured wall seconds for this job (its share of a merged batch);
    without it, `step_seconds` × the chunk's steps. Times the worker's cards, it adds to the job's
    measured `card_seconds` (what its owner's daily quota is settled with when it ends).
    `claimed`: the worker's copy of the job's row as it claimed it; with it, a boundary where nothing else happens
    (the card keeps the job, or yields it to better work: `_record_chunk_alone`; or the job's last step hands it to
    its decode: `_record_last_chunk`) is one conditional UPDATE instead of a locked read and save.
    `learn=False`: the caller folds the step time into the model's correction itself, off its critical path
    (`learn_from_chunk`). False when this worker no longer holds the job or the step was already recorded.
    """
    group_size = _group_size(worker)
    if claimed is not None and chunk_seconds is not None:
        card_seconds = chunk_seconds * group_size
        if _record_chunk_alone(claimed, worker, step, checkpoint_key, step_seconds, card_seconds, keep_lease) or (
            not keep_lease and _record_last_chunk(claimed, worker, step, checkpoint_key, step_seconds, card_seconds)
        ):
            if learn:
                learn_from_chunk(claimed, step_seconds, worker)
            return True
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id, lease_owner=worker, status=JobStatus.DENOISING).first()
        if job is None or job.checkpoint_step >= step:
            return False
        if chunk_seconds is None and step_seconds is not None:
            chunk_seconds = step_seconds * (step - job.checkpoint_step)
        job.card_seconds += (chunk_seconds or 0.0) * group_size
        job.checkpoint_step = job.steps_done = step
        job.checkpoint_key = checkpoint_key
        job.measured_step_seconds = step_seconds
        job.chunks_run += 1 if keep_lease else 0  # an in-process chunk counts like a claimed one
        if end_if_cancelled(job):
            return True
        if job.segment_count <= 1 and step > job.steps:  # the total was lowered below what this chunk did
            rescale_to_total(job, step)  # the job stops here
        if job.segment_count > 1 and step % job.steps == 0:
            segment_service.record_denoised(job, step // job.steps - 1, checkpoint_key)  # its decode overlaps
        if step < job.total_steps:
            job.priority = priority_for(job.duration_class, job.remaining_seconds, True, deployment.thresholds())
        if keep_lease and step < job.total_steps:
            job.lease_expires_at, job.chunk_started_at = lease_until(), timezone.now()
            job.save()
        else:
            job.lease_owner, job.lease_expires_at = "", None
            job.published_at = timezone.now()
            if step >= job.total_steps:
                job.status, job.stage = JobStatus.DECODING, JobStage.WAITING
                job.save()
                observe.transition(job.pk, JobStatus.DENOISING, JobStatus.DECODING, worker=worker, step=step)
                announce_on_commit(job_id, "decoding")
                if job.segment_count <= 1:  # a segmented job is assembled once its last segment is decoded
                    transaction.on_commit(lambda: broker.send_decode(job.id, job.priority, job.model))
            else:
                job.stage = JobStage.WAITING
                job.save()
                announce_on_commit(job_id, "waiting")
                transaction.on_commit(lambda: broker.send_chunk(job.id, step, job.queue, job.priority, job.model))
    if learn:
        learn_from_chunk(job, step_seconds, worker)
    return True


def _record_chunk_alone(
    claimed: Job,
    worker: str,
    step: int,
    checkpoint_key: str,
    step_seconds: float | None,
    card_seconds: float,
    keep_lease: bool,
) -> bool:
    """The common boundary as one compare-and-set: the card keeps the job for its next chunk (`keep_lease`:
    the lease renewed), or yields it to better work (the lease let go, the next chunk published once this
    commits). A yield is on the way to the waiting job's first step, a kept boundary on the way to this
    job's next one.

    It writes what the locked path would (checkpoint, progress, card seconds, the next chunk's priority). It
    applies only where nothing else happens at the boundary: not the job's last step, not a segment's end,
    and `_alone`'s guard. The priority comes from `claimed`'s estimate, which only a change of steps changes.
    False when any of that does not hold (or the lease is gone): the caller then takes the locked path, which
    decides.
    """
    if step >= claimed.total_steps or (claimed.segment_count > 1 and step % claimed.steps == 0):
        return False
    remaining = claimed.estimated_seconds * (claimed.total_steps - step) / claimed.total_steps
    priority = priority_for(claimed.duration_class, remaining, True, deployment.thresholds())
    chunk = _alone(claimed, worker, step, checkpoint_key, step_seconds, card_seconds)
    if keep_lease:
        return _KEPT_CHUNK(claimed.pk, **chunk, priority=priority, lease_until=lease_until())
    if not _YIELDED_CHUNK(claimed.pk, **chunk, priority=priority):
        return False
    announce_on_commit(claimed.pk, "waiting")
    transaction.on_commit(lambda: broker.send_chunk(claimed.pk, step, claimed.queue, priority, claimed.model))
    return True


def _record_last_chunk(
    claimed: Job, worker: str, step: int, checkpoint_key: str, step_seconds: float | None, card_seconds: float
) -> bool:
    """A job's last denoising step as one statement: the chunk recorded, the lease let go, the job `decoding`,
    and its decode published once this commits (on the way to its outputs: every job's tail). It applies where
    the locked path would do that and nothing else: one segment (a segmented job's decodes are the segments'),
    the total reached exactly, and `_alone`'s guard. False otherwise (or the lease is gone)."""
    if step != claimed.total_steps or claimed.segment_count > 1:
        return False
    job = _LAST_CHUNK(claimed.pk, **_alone(claimed, worker, step, checkpoint_key, step_seconds, card_seconds))
    if job is None:
        return False
    observe.transition(job.pk, JobStatus.DENOISING, JobStatus.DECODING, worker=worker, step=step)
    announce_on_commit(job.pk, "decoding")
    transaction.on_commit(lambda: broker.send_decode(job.id, job.priority, job.model))  # its priority as it stands
    return True


def _alone(
    claimed: Job, worker: str, step: int, checkpoint_key: str, step_seconds: float | None, card_seconds: float
) -> dict[str, Any]:
    """A chunk recorded in one statement: the named values of `_alone_shape`."""
    return {
        "worker": worker,
        "step": step,
        "steps": claimed.steps,
        "segment_count": claimed.segment_count,
        "queue": claimed.queue,
        "checkpoint_key": checkpoint_key,
        "step_seconds": step_seconds,
        "card_seconds": card_seconds,
        "now": timezone.now(),
    }


def _alone_shape(values: dict[str, Any]) -> tuple[Q, dict[str, Any]]:
    """Its guard (this worker's lease, the step not recorded yet, no cancel asked, the total, segments and queue
    still the claimed row's: a change of steps goes the locked way, which rescales) and the chunk's fields."""
    guard = Q(
        lease_owner=values["worker"],
        status=JobStatus.DENOISING,
        checkpoint_step__lt=values["step"],
        cancel_requested=False,
        steps=values["steps"],
        segment_count=values["segment_count"],
        queue=values["queue"],
    )
    chunk = {
        "checkpoint_step": values["step"],
        "steps_done": values["step"],
        "checkpoint_key": values["checkpoint_key"],
        "measured_step_seconds": values["step_seconds"],
        "card_seconds": F("card_seconds") + values["card_seconds"],
        "updated_at": values["now"],
    }
    return guard, chunk


def _kept_chunk_shape(values: dict[str, Any]) -> tuple[Q, dict[str, Any]]:
    """The card keeps the job: an in-process chunk counts like a claimed one, the next chunk starts now."""
    guard, chunk = _alone_shape(values)
    lease = {
        "chunks_run": F("chunks_run") + 1,
        "lease_expires_at": values["lease_until"],
        "chunk_started_at": values["now"],
    }
    return guard, chunk | lease | {"priority": values["priority"]}


def _yielded_chunk_shape(values: dict[str, Any]) -> tuple[Q, dict[str, Any]]:
    """The card yields the job to better work: it waits for its next chunk's message."""
    guard, chunk = _alone_shape(values)
    return guard, chunk | _handed_on(values) | {"priority": values["priority"]}


def _last_chunk_shape(values: dict[str, Any]) -> tuple[Q, dict[str, Any]]:
    """The job's last step: it waits decoding (its decode's message published once this commits)."""
    guard, chunk = _alone_shape(values)
    return guard, chunk | _handed_on(values) | {"status": JobStatus.DECODING}


def _handed_on(values: dict[str, Any]) -> dict[str, Any]:
    """The card lets the job go: the lease released, the job waiting for the message published now."""
    return {"lease_owner": "", "lease_expires_at": None, "published_at": values["now"], "stage": JobStage.WAITING}


# A card's chunk boundaries: compiled once per process (the named values are `_alone`'s, each stored as the field
# named, and the kept and yielded boundaries' priority and lease).
_ALONE_FIELDS = {
    "worker": "lease_owner",
    "step": "checkpoint_step",
    "steps": "steps",
    "segment_count": "segment_count",
    "queue": "queue",
    "checkpoint_key": "checkpoint_key",
    "step_seconds": "measured_step_seconds",
    "card_seconds": "card_seconds",
    "now": "updated_at",
}
_KEPT_CHUNK = CompiledWrite(
    _kept_chunk_shape, _ALONE_FIELDS | {"priority": "priority", "lease_until": "lease_expires_at"}
)
_YIELDED_CHUNK = CompiledWrite(_yielded_chunk_shape, _ALONE_FIELDS | {"priority": "priority"})
_LAST_CHUNK = CompiledUpdate(_last_chunk_shape, _ALONE_FIELDS)


def learn_from_chunk(job: Job, step_seconds: float | None, worker: str) -> None:
    """A recorded chunk's measured step time: the step-time metric, and the model's online correction (a simulated
    model's: what a step took beyond its estimate, the ETAs' STEP)."""
    spec = deployment.layout().worker(worker.split("@", 1)[0])
    metrics.observe(metrics.STEP_SECONDS, job.model, step_seconds)
    if not step_seconds:
        return
    speedup = spec.speedup if spec is not None else 1.0
    # The correction learns single-card step times: a step on a group of k cards counts k × eff.
    learn_step_time(job, step_seconds * speedup)
    if job.backend == "simulated" and job.total_steps:
        # A simulated model never corrects its cost model (its sleep *is* the cost model), but its steps also
        # pay the service's own work per step (the callback, the cancel check): 9 % of a 20-ms step in
        # bench.replay at ×0.2. A real model's correction counts that work in its estimate; this one's ETAs
        # count it as STEP, in wall seconds per step on this worker.
        expected = job.estimated_seconds / job.total_steps * job.clock_scale / speedup
        learn_stage_seconds(job.model, STEP, max(0.0, step_seconds - expected))


def start_decoding(job_id: JobId, worker: str) -> Job | None:
    """Take the job's decode (its lease), and the job as the take left it, in one statement; None when it is not
    waiting for one (decoded already, held elsewhere, cancelled)."""
    job = _START_DECODING(job_id, now=timezone.now(), worker=worker, lease_until=lease_until())
    if job is not None:
        announce_on_commit(job_id, "decoding")
    return job


def _start_decoding_shape(values: dict[str, Any]) -> tuple[Q, dict[str, Any]]:
    conditions = lease_free(values["now"]) & Q(status=JobStatus.DECODING, cancel_requested=False)
    return conditions, {
        "stage": JobStage.DECODING,
        "lease_owner": values["worker"],
        "lease_expires_at": values["lease_until"],
        # Its decode's start, as a chunk's (what is left of it counts in the ETAs behind it).
        "chunk_started_at": values["now"],
    }


def finish_decoding(job_id: JobId, worker: str, outputs: list[dict[str, str]]) -> bool:
    now = timezone.now()
    job = _FINISH_DECODING(job_id, now=now, worker=worker, outputs=outputs)
    if job is None:
        return False
    observe.transition(job_id, JobStatus.DECODING, JobStatus.SUCCEEDED, worker=worker)
    # Its decode's publish (finish_chunk set published_at when denoising ended): what its tail took; and when
    # this worker took it (start_decoding set chunk_started_at): what its decode alone took. The statement left both.
    if job.published_at is not None:
        learn_stage_seconds(job.model, TAIL, (now - job.published_at).total_seconds())
    if job.chunk_started_at is not None:
        learn_stage_seconds(job.model, DECODE, (now - job.chunk_started_at).total_seconds())
    after_end_soon(job)
    return True


def _finish_decoding_shape(values: dict[str, Any]) -> tuple[Q, dict[str, Any]]:
    return Q(lease_owner=values["worker"], status=JobStatus.DECODING), {
        "status": JobStatus.SUCCEEDED,
        "stage": JobStage.DONE,
        "outputs": values["outputs"],
        "finished_at": values["now"],
        "lease_owner": "",
        "lease_expires_at": None,
        **quotas.settled_charge(),  # its quota charge settled here: after_end does not
    }


# Every job's tail (its decode taken, its outputs recorded): compiled once per process.
_START_DECODING = CompiledUpdate(
    _start_decoding_shape, {"now": "chunk_started_at", "worker": "lease_owner", "lease_until": "lease_expires_at"}
)
_FINISH_DECODING = CompiledUpdate(
    _finish_decoding_shape, {"now": "finished_at", "worker": "lease_owner", "outputs": "outputs"}
)


def _group_size(worker: str) -> int:
    """The cards of `worker`'s group (1 for a worker the layout does not name): a chunk's seconds on it cost this
    many card seconds."""
    spec = deployment.layout().worker(worker.split("@", 1)[0])
    return spec.group_size if spec is not None else 1


def finish_cancelled(job_id: JobId, worker: str, chunk_seconds: float = 0.0) -> bool:
    """The worker holding a job saw its cancel flag and stopped. `chunk_seconds`: the denoising it ran since its
    last recorded chunk (a checkpoint interval's unrecorded chunks), billed as `finish_chunk` bills a chunk."""
    before = Job.objects.filter(pk=job_id, lease_owner=worker).values_list("status", flat=True).first()
    added = chunk_seconds * _group_size(worker)
    job = update_returning(
        job_id,
        Q(lease_owner=worker, status__in=ACTIVE),
        status=JobStatus.CANCELLED,
        stage=JobStage.CANCELLED,
        finished_at=timezone.now(),
        lease_owner="",
        lease_expires_at=None,
        card_seconds=F("card_seconds") + added,
        **quotas.settled_charge(added),  # its charge settled here: after_end does not
    )
    if job is None:
        return False
    observe.transition(job_id, before or "", JobStatus.CANCELLED, worker=worker)
    after_end_soon(job)
    return True
