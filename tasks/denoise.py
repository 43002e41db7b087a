"""Stage 2: one denoise chunk (queue = the job's class); publishes the next chunk or the decode."""
from __future__ import annotations

import time
import traceback

from celery import shared_task

from genserver.jobs import services
from genserver.redis_client import CANCEL_KEY, client as redis_client
from workers.runtime import stages

from .common import family_of, request_of, storage, worker_id

HEARTBEAT_EVERY_SECONDS = 1.0  # lease renewal + progress write; per step would hammer the DB on fast models


@shared_task(name="tasks.denoise.run_chunk", bind=True)
def run_chunk(self, job_id: str, from_step: int) -> str:
    worker = worker_id(self)
    job = services.claim_chunk(job_id, worker, from_step)
    if job is None:
        return "skipped"  # already past this step, held elsewhere, cancelled or finished
    cancel_key = CANCEL_KEY.format(job_id=job_id)
    last_beat = [time.monotonic()]

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

    try:
        result = stages.denoise_chunk(
            family_of(job), storage(), request_of(job), embeddings_ref=job.embeddings_key,
            checkpoint_ref=job.checkpoint_key, until_step=min(job.steps, from_step + job.chunk_steps),
            preview_every=job.preview_every, should_stop=should_stop,
            on_preview=lambda key, step: services.record_preview(job_id, worker, key, step))
    except Exception:  # noqa: BLE001 - recorded on the job, retried from its checkpoint
        return services.fail_attempt(job_id, worker, traceback.format_exc())
    if result.stopped == "cancelled":
        services.finish_cancelled(job_id, worker)
        return "cancelled"
    if result.stopped:
        return result.stopped
    if services.finish_chunk(job_id, worker, result.step, result.checkpoint_key, result.step_seconds):
        if job.checkpoint_key and job.checkpoint_key != result.checkpoint_key:
            storage().delete_prefix(job.checkpoint_key)  # the older checkpoint is no longer needed
    return f"step {result.step}"
