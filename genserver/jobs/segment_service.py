"""The job service's half for long videos: segment decodes, their recovery, and the final assembly.

A video longer than its model's `segment_frames` is denoised segment after
segment on one card (see genserver/scheduling/segments.py for the plan and
the global step numbering). Each segment has a JobSegment row from the moment
its last step is checkpointed:

    denoised ─(decode worker takes it, lease)─▶ decoding ─▶ published
        ▲                                         │ exception / lease expired
        └────────── retried (attempts < MAX) ─────┘ ─▶ failed (the job fails)

The job's own status is untouched by its segments while the card denoises:
`denoising` until the last segment's last step, then `decoding` until every
segment is published and the whole video is assembled (tasks.segments.assemble,
through services.finish_decoding), then `succeeded`. A cancel ends the job at
once as usual and never waits for segment decodes; the segments already
published stay listed and downloadable (their clips live under outputs/, which
only output retention deletes).

Every transition is a compare-and-set on the segment row (its status and
lease), so a redelivered or duplicated decode message finds the segment
taken or published and does nothing.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from genserver import deployment
from genserver.jobs import broker
from genserver.jobs.models import ACTIVE, Job, JobSegment, JobStage, JobStatus, SegmentStatus
from genserver.jobs.services import observe
from genserver.jobs.services._common import (
    JobId,
    Outcome,
    after_end,
    disk_full,
    emit_on_commit,
    lease_free,
    lease_until,
    publish_or_leave_to_reaper,
)
from genserver.scheduling.pools import DECODE
from genserver.scheduling.segments import Segment, segment_plan

log = logging.getLogger(__name__)


def plan_of(job: Job) -> list[Segment]:
    """The job's segments (frames kept and generated, seed); one segment for an ordinary job."""
    frames_step = deployment.registry().get(job.model).limits.frames_step if job.segment_count > 1 else 1
    return segment_plan(job.num_frames, job.segment_frames, frames_step, job.seed)


# --- the card's side (inside services.finish_chunk's transaction) --------------------------


def record_denoised(job: Job, index: int, checkpoint_key: str) -> None:
    """Segment `index` finished denoising (its final checkpoint is `checkpoint_key`): publish its
    decode once the chunk's transaction commits. The card goes on with the next segment meanwhile."""
    segment = plan_of(job)[index]
    row, created = JobSegment.objects.get_or_create(
        job=job,
        index=index,
        defaults=dict(
            frames=segment.frames, seed=segment.seed, checkpoint_key=checkpoint_key, published_at=timezone.now()
        ),
    )
    if not created:
        if row.status in (SegmentStatus.PUBLISHED, SegmentStatus.FAILED):
            # Denoised again (an admin retry from scratch): its clip is already there.
            if index == job.segment_count - 1:
                transaction.on_commit(lambda: check_assembly(job.pk))
            return
        JobSegment.objects.filter(pk=row.pk).update(
            checkpoint_key=checkpoint_key,
            status=SegmentStatus.DENOISED,
            lease_owner="",
            lease_expires_at=None,
            published_at=timezone.now(),
        )
    transaction.on_commit(lambda: _send_decode(job.pk, index, job.priority))


def _send_decode(job_id: JobId, index: int, priority: int) -> None:
    publish_or_leave_to_reaper(broker.send_segment_decode, job_id, index, priority)


# --- the decode worker's side ------------------------------------------------------------------


def start_segment_decode(job_id: JobId, index: int, worker: str) -> tuple[Job, JobSegment] | None:
    """Take segment `index`'s decode. None when it is published, held elsewhere, or the job is
    cancelled or finished (a redelivered message does nothing)."""
    now = timezone.now()
    taken = JobSegment.objects.filter(
        lease_free(now),
        job_id=job_id,
        index=index,
        status__in=(SegmentStatus.DENOISED, SegmentStatus.DECODING),
        job__status__in=ACTIVE,
        job__cancel_requested=False,
    ).update(status=SegmentStatus.DECODING, lease_owner=worker, lease_expires_at=lease_until())
    if not taken:
        return None
    return Job.objects.get(pk=job_id), JobSegment.objects.get(job_id=job_id, index=index)


def renew_segment_lease(job_id: JobId, index: int, worker: str) -> bool:
    return bool(
        JobSegment.objects.filter(job_id=job_id, index=index, lease_owner=worker, status=SegmentStatus.DECODING).update(
            lease_expires_at=lease_until()
        )
    )


def finish_segment_decode(job_id: JobId, index: int, worker: str, key: str, poster_key: str) -> bool:
    """Publish the segment's clip on the job (compare-and-set on the segment's lease). A clip that
    finishes after a cancel is still kept: it is stored, and the user may want it."""
    with transaction.atomic():
        done = JobSegment.objects.filter(
            job_id=job_id, index=index, lease_owner=worker, status=SegmentStatus.DECODING
        ).update(
            status=SegmentStatus.PUBLISHED,
            key=key,
            poster_key=poster_key,
            decoded_at=timezone.now(),
            lease_owner="",
            lease_expires_at=None,
            error="",
        )
        if done:
            emit_on_commit(job_id, "segment", segment=index)
            transaction.on_commit(lambda: check_assembly(job_id))
    return bool(done)


def fail_segment_decode(job_id: JobId, index: int, worker: str | None, error: str) -> Outcome:
    """A segment decode raised (or its worker died: `worker` None, the reaper). Retried like any
    stage; after MAX_ATTEMPTS (or on a full disk) the segment and its job fail."""
    now = timezone.now()
    held = Q(lease_owner=worker) if worker else Q(lease_expires_at__lt=now) & ~Q(lease_owner="")
    with transaction.atomic():
        segment = (
            JobSegment.objects.select_for_update()
            .filter(held, job_id=job_id, index=index, status=SegmentStatus.DECODING)
            .first()
        )
        if segment is None:
            return Outcome.IGNORED
        segment.attempts += 1
        segment.error = error[-4000:]
        segment.lease_owner, segment.lease_expires_at = "", None
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.status not in ACTIVE or job.cancel_requested:
            segment.status = SegmentStatus.DENOISED  # nobody will take it again
            segment.save()
            return Outcome.IGNORED
        full = disk_full(error)
        if full or segment.attempts >= settings.MAX_ATTEMPTS:
            segment.status = SegmentStatus.FAILED
            segment.save()
            observe.transition(job_id, job.status, JobStatus.FAILED, worker=worker or "")
            reason = f"storage full: {full}" if full else f"gave up after {segment.attempts} attempts"
            Job.objects.filter(pk=job_id, status__in=ACTIVE).update(
                status=JobStatus.FAILED,
                stage=JobStage.FAILED,
                finished_at=now,
                lease_owner="",
                lease_expires_at=None,
                error=f"decode of segment {index} failed ({reason}); last error: {segment.error}"[:4000],
            )
            transaction.on_commit(lambda: after_end(job_id))
            return Outcome.FAILED
        segment.status = SegmentStatus.DENOISED
        segment.published_at = now
        segment.save()
        transaction.on_commit(lambda: _send_decode(job_id, index, job.priority))
        return Outcome.RETRIED


# --- the whole video -------------------------------------------------------------------------------


def _all_published(job: Job) -> bool:
    return JobSegment.objects.filter(job=job, status=SegmentStatus.PUBLISHED).count() >= job.segment_count


def check_assembly(job_id: JobId) -> bool:
    """Publish the whole video's assembly once the last segment is denoised and every segment is
    published (called after each segment publishes; a duplicate assembly message does nothing)."""
    job = Job.objects.filter(pk=job_id, status=JobStatus.DECODING, cancel_requested=False).first()
    if job is None or not _all_published(job):
        return False
    Job.objects.filter(pk=job_id).update(published_at=timezone.now())
    return publish_or_leave_to_reaper(broker.send_assemble, job.pk, job.priority)


def start_assembly(job_id: JobId, worker: str) -> tuple[Job, list[JobSegment]] | None:
    """Take the job's final decode stage (the whole video) once every segment is published."""
    now = timezone.now()
    with transaction.atomic():
        job = (
            Job.objects.select_for_update()
            .filter(lease_free(now), pk=job_id, status=JobStatus.DECODING, cancel_requested=False)
            .first()
        )
        if job is None or not _all_published(job):
            return None
        job.stage, job.lease_owner, job.lease_expires_at = JobStage.DECODING, worker, lease_until()
        job.save(update_fields=["stage", "lease_owner", "lease_expires_at", "updated_at"])
    return job, list(JobSegment.objects.filter(job=job, status=SegmentStatus.PUBLISHED).order_by("index"))


def retry_fields(job: Job, has_checkpoint: bool = False) -> dict[str, Any]:
    """An admin retry of a failed long video: published segments stay; denoising goes on at the
    first segment not published: from the checkpoint the failed job kept (`has_checkpoint`: it is
    still stored) when that lies inside this segment, else from the segment's seed. The rows of
    unpublished segments are dropped (they are recorded again when their denoising ends)."""
    published = set(JobSegment.objects.filter(job=job, status=SegmentStatus.PUBLISHED).values_list("index", flat=True))
    JobSegment.objects.filter(job=job).exclude(status=SegmentStatus.PUBLISHED).delete()
    first = next((i for i in range(job.segment_count) if i not in published), None)
    if first is None:
        return {"status": JobStatus.DECODING, "checkpoint_step": job.total_steps, "steps_done": job.total_steps}
    start = first * job.steps
    if has_checkpoint and start < job.checkpoint_step < start + job.steps:  # midway through this segment
        step = job.checkpoint_step
        return {"status": JobStatus.DENOISING, "checkpoint_step": step, "steps_done": step}
    return {"status": JobStatus.DENOISING, "checkpoint_step": start, "steps_done": start, "checkpoint_key": ""}


def republish_decodes(job: Job) -> None:
    """The reaper found the decoding job without a message: publish what it waits for."""
    waiting = list(
        JobSegment.objects.filter(job=job, status=SegmentStatus.DENOISED, lease_owner="").values_list(
            "index", flat=True
        )
    )
    for index in waiting:
        _send_decode(job.pk, index, job.priority)
    check_assembly(job.pk)


def reap_segments(now: datetime | None = None) -> dict[str, int]:
    """Reaper: a segment decode whose worker died (lease expired) is a failed attempt, retried; one
    whose message is gone (nothing waits in the broker for its job) is published again."""
    now = now or timezone.now()
    outcomes: dict[str, int] = {}
    stale = list(
        JobSegment.objects.filter(status=SegmentStatus.DECODING, lease_expires_at__lt=now)
        .exclude(lease_owner="")
        .values_list("job_id", "index", "lease_owner")
    )
    for job_id, index, owner in stale:
        outcome = fail_segment_decode(
            job_id, index, None, f"decode worker {owner} stopped renewing its lease (lost or killed)"
        )
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    quiet_since = now - timedelta(seconds=settings.LEASE_SECONDS)
    orphans = list(
        JobSegment.objects.filter(
            status=SegmentStatus.DENOISED,
            lease_owner="",
            published_at__lt=quiet_since,
            job__status__in=ACTIVE,
            job__cancel_requested=False,
        ).values_list("pk", "job_id", "index", "published_at")
    )
    if orphans:
        waiting = broker.broker_job_ids([DECODE])
        for pk, job_id, index, published_at in orphans:
            if str(job_id) in waiting:
                continue
            if JobSegment.objects.filter(pk=pk, status=SegmentStatus.DENOISED, published_at=published_at).update(
                published_at=now
            ):
                log.warning("reaper: segment %s of job %s had no decode message; re-published", index, job_id)
                priority = Job.objects.filter(pk=job_id).values_list("priority", flat=True).first() or 0
                _send_decode(job_id, index, priority)
                outcomes[Outcome.REPUBLISHED] = outcomes.get(Outcome.REPUBLISHED, 0) + 1
    return outcomes
