"""Stage 2: denoise chunks (queue = the job's class); publishes the next chunk or the decode.

At each chunk boundary the worker yields its card only when it has to: if a
message it would take before this job's continuation is waiting on its
queues (shorter work, or an earlier message at the same priority), it
re-publishes the continuation and returns to the broker; otherwise it runs
the next chunk in-process from the state in memory, skipping the broker hop
and the checkpoint restore. The order of work is the same as re-publishing
every chunk; the checkpoint is still written at every boundary, so a crash
loses at most one chunk. A task never runs past half the visibility timeout.
"""
from __future__ import annotations

import os
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from celery import shared_task
from django.conf import settings

from genserver import policy
from genserver.jobs import selectors, services
from genserver.redis_client import CANCEL_KEY, client as redis_client
from genserver.scheduling.classes import CLASSES, priority_for
from genserver.scheduling.pools import class_of
from workers.runtime import stages

from .common import family_of, preload, storage, worker_id
from .segments import SegmentCursor

HEARTBEAT_EVERY_SECONDS = 1.0  # lease renewal + progress write; per step would hammer the DB on fast models
_deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-gc")


def _consumed_queues(job_queue: str) -> list[str]:
    """The denoise queues this worker consumes (the launcher sets them; a bare worker assumes the job's)."""
    queues = os.environ.get("GENSERVER_WORKER_QUEUES", "")
    return [q for q in queues.split(",") if class_of(q) in CLASSES] or [job_queue]


@shared_task(name="tasks.denoise.run_chunk", bind=True)
def run_chunk(self, job_id: str, from_step: int) -> str:
    worker = worker_id(self)
    if not preload(job_id):
        return "skipped"
    job = services.claim_chunk(job_id, worker, from_step)
    if job is None:
        return "skipped"  # already past this step, held elsewhere, cancelled or finished
    cancel_key = CANCEL_KEY.format(job_id=job_id)
    last_beat = [time.monotonic()]
    task_started = time.monotonic()

    def should_stop(step: int) -> str:
        if redis_client().exists(cancel_key):
            return "cancelled"
        if step == 0:
            services.heartbeat(job_id, worker, steps_done=0)  # started_at: the first step begins now
        if time.monotonic() - last_beat[0] > HEARTBEAT_EVERY_SECONDS:
            last_beat[0] = time.monotonic()
            if not services.heartbeat(job_id, worker, steps_done=step):
                return "lease-lost"
        return ""

    def keep_card(step: int) -> bool:
        """Run the next chunk here: nothing waits that this card would take first, and time is left."""
        if step >= job.total_steps or time.monotonic() - task_started > settings.CELERY_VISIBILITY_TIMEOUT / 2:
            return False
        remaining = job.estimated_seconds * (job.total_steps - step) / job.total_steps
        continuation = priority_for(job.duration_class, remaining, True, policy.thresholds())
        return not selectors.waiting_at_or_before(_consumed_queues(job.queue), continuation)

    family, store = family_of(job), storage()
    # Steps are global over a long video's segments (an ordinary job is one segment at offset 0).
    cursor = SegmentCursor(job)
    previous_key = cursor.deletable(job.checkpoint_step, job.checkpoint_key)
    try:
        state = cursor.load_state(family, store, job.checkpoint_step, job.checkpoint_key)
        while True:
            result = stages.run_chunk(
                family, store, state, until_step=min(job.steps, state.step + job.chunk_steps),
                preview_every=job.preview_every, should_stop=lambda step: should_stop(cursor.offset + step),
                on_preview=lambda key, step: services.record_preview(job_id, worker, key, cursor.offset + step))
            if result.stopped:
                break
            step = cursor.offset + result.step
            stay = keep_card(step)
            if not services.finish_chunk(job_id, worker, step, result.checkpoint_key, result.step_seconds,
                                         keep_lease=stay):
                return "superseded"
            if previous_key and previous_key != result.checkpoint_key:
                # The older checkpoint is no longer needed; an unlink right after an fsync can take
                # milliseconds, so it happens off the chunk boundary.
                _deleter.submit(store.delete_prefix, previous_key)
            previous_key = cursor.deletable(step, result.checkpoint_key)
            if not stay:
                return f"step {step}"
            state = cursor.next_state(family, state)  # a segment's end: the next one, from its own seed
    except Exception:  # noqa: BLE001 - recorded on the job, retried from its checkpoint
        return services.fail_attempt(job_id, worker, traceback.format_exc())
    if result.stopped == "cancelled":
        services.finish_cancelled(job_id, worker)
    return result.stopped
