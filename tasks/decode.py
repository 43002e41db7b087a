"""Stage 3: VAE decode on its own worker (queue `decode`); the job succeeds with its outputs."""

from __future__ import annotations

import time
import traceback

from celery import shared_task

from genserver import metrics
from genserver.jobs import broker, services
from genserver.jobs.services import Outcome
from workers.runtime import stages

from .common import family_of, preload, renewing, request_of, storage, worker_id


@shared_task(name=broker.DECODE_TASK.name, bind=True)
def decode(self, job_id: str, model: str = "") -> str:
    worker = worker_id(self)
    if not preload(job_id, "decode", model):
        return Outcome.SKIPPED
    job = services.start_decoding(job_id, worker)
    if job is None:
        return Outcome.SKIPPED
    started = time.perf_counter()
    try:
        with renewing(lambda: services.heartbeat(job_id, worker)):
            outputs = stages.decode(
                family_of(job, "decode"),
                storage(),
                request_of(job),
                checkpoint_ref=job.checkpoint_key,
            )
    except Exception:  # noqa: BLE001 - any decode error is recorded on the job, which is retried or fails
        return services.fail_attempt(job_id, worker, traceback.format_exc())
    metrics.observe(metrics.DECODE_SECONDS, job.model, time.perf_counter() - started)
    services.finish_decoding(job_id, worker, outputs)
    return Outcome.SUCCEEDED
