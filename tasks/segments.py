"""Long videos in segments: the denoise loop's segment cursor, and the decode worker's two tasks.

* `SegmentCursor` maps the job's global steps (over all segments) onto the
  segment being denoised: its request (frames, seed, storage namespace) and
  its local step. The denoise task uses it for every job; an ordinary job is
  one segment at offset 0, so nothing changes for it.
* `decode_segment(job_id, index)` (queue `decode`): the segment's clip, while
  the card denoises the next segment.
* `assemble(job_id)` (queue `decode`): once every segment is published, the
  whole video; the job succeeds.
"""

from __future__ import annotations

import dataclasses
import time
import traceback

from celery import shared_task

from genserver import metrics
from genserver.jobs import broker, segment_service, services
from genserver.jobs.models import Job
from genserver.jobs.services import Outcome
from genserver.scheduling.segments import segment_of_step
from workers.runtime import segments as runtime_segments, stages
from workers.runtime.base import DenoiseState, Family, GenerationRequest

from .common import CardEncoder, family_of, preload, renewing, request_of, storage, worker_id


def job_id_of(request: GenerationRequest) -> str:
    """The job a (segment's) request belongs to: a segment's `job_id` is `<job>/segments/<index>`."""
    return request.job_id.split("/", 1)[0]


def segment_request(job: Job, index: int) -> GenerationRequest:
    """Segment `index` of a segmented job as the runtime sees it (an ordinary job: its own request)."""
    request = request_of(job)
    if job.segment_count <= 1:
        return request
    segment = segment_service.plan_of(job)[index]
    return dataclasses.replace(
        request,
        job_id=runtime_segments.segment_job_id(str(job.pk), index),
        num_frames=segment.generate_frames,
        seed=segment.seed,
    )


class SegmentCursor:
    """Where the denoise loop is: `offset` global steps before the current segment's step 0."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.index = 0
        self.offset = 0

    def load_state(
        self, family: Family, store, global_step: int, checkpoint_key: str, encoder: CardEncoder | None = None
    ) -> DenoiseState:
        """The state to continue from `global_step`. A segment's start (global step i × steps) begins
        from the segment's seed: the checkpoint there is the previous segment's end, kept for its decode.
        `encoder`: the model's text encoders, for a prompt not stored yet (a model that encodes on its card)."""
        job = self.job
        index, local = segment_of_step(global_step, job.steps) if job.segment_count > 1 else (0, global_step)
        if index >= job.segment_count:  # every step done (only a decoding job is here)
            index, local = job.segment_count - 1, job.steps
        self.index, self.offset = index, index * job.steps
        resume_from = checkpoint_key if local else ""
        request = segment_request(job, index)
        return stages.load_state(family, store, request, job.embeddings_key, resume_from, encoder)

    def segment_start(self, global_step: int) -> int:
        """The global step at which the segment of `global_step` begins (0 for a job of one segment)."""
        if self.job.segment_count <= 1:
            return 0
        index, local = segment_of_step(global_step, self.job.steps)
        return global_step - local

    def next_state(self, family: Family, state: DenoiseState) -> DenoiseState:
        """At a segment's end, the next segment's fresh state (same embeddings); else `state` itself."""
        job = self.job
        if not state.done or self.index + 1 >= job.segment_count:
            return state
        self.index += 1
        self.offset = self.index * job.steps
        return family.prepare(segment_request(job, self.index), state.embeddings)

    def deletable(self, global_step: int, checkpoint_key: str) -> str:
        """The checkpoint the loop may delete once the next is recorded: not a segment's final one
        (its decode reads it; the job's end deletes it)."""
        if self.job.segment_count > 1 and global_step and global_step % self.job.steps == 0:
            return ""
        return checkpoint_key


@shared_task(name=broker.SEGMENT_DECODE_TASK.name, bind=True)
def decode_segment(self, job_id: str, index: int) -> str:
    worker = worker_id(self)
    if not preload(job_id, "decode"):
        return Outcome.SKIPPED
    taken = segment_service.start_segment_decode(job_id, index, worker)
    if taken is None:
        return Outcome.SKIPPED  # published already, held elsewhere, or the job was cancelled / ended
    job, segment = taken
    started = time.perf_counter()
    try:
        with renewing(lambda: segment_service.renew_segment_lease(job_id, index, worker)):
            key, poster_key = runtime_segments.decode_segment(
                family_of(job, "decode"),
                storage(),
                segment_request(job, index),
                job_id=str(job.pk),
                index=index,
                frames=segment.frames,
                checkpoint_ref=segment.checkpoint_key,
            )
    except Exception:  # noqa: BLE001 - recorded on the segment, retried
        return segment_service.fail_segment_decode(job_id, index, worker, traceback.format_exc())
    metrics.observe(metrics.DECODE_SECONDS, job.model, time.perf_counter() - started)
    published = segment_service.finish_segment_decode(job_id, index, worker, key, poster_key)
    return Outcome.PUBLISHED if published else Outcome.LOST


@shared_task(name=broker.ASSEMBLE_TASK.name, bind=True)
def assemble(self, job_id: str) -> str:
    worker = worker_id(self)
    taken = segment_service.start_assembly(job_id, worker)
    if taken is None:
        return Outcome.SKIPPED  # done, held, cancelled, or a segment is not published yet
    job, segments = taken
    try:
        with renewing(lambda: services.heartbeat(job_id, worker)):
            outputs = runtime_segments.assemble(storage(), str(job.pk), [s.key for s in segments])
    except Exception:  # noqa: BLE001 - recorded on the job, which is retried or fails
        return services.fail_attempt(job_id, worker, traceback.format_exc())
    services.finish_decoding(job_id, worker, outputs)
    return Outcome.SUCCEEDED
