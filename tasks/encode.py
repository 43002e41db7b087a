"""Stage 1: text encode (queue `encode`), then the first denoise chunk is published."""
from __future__ import annotations

import traceback

from celery import shared_task

from genserver.jobs import services
from workers.runtime import stages

from .common import family_of, request_of, storage, worker_id


@shared_task(name="tasks.encode.encode", bind=True)
def encode(self, job_id: str) -> str:
    worker = worker_id(self)
    job = services.start_encoding(job_id, worker)
    if job is None:
        return "skipped"  # cancelled, finished, or another worker has it: a redelivery does nothing
    try:
        result = stages.encode(family_of(job), storage(), request_of(job))
    except Exception:  # noqa: BLE001 - recorded on the job, retried from the database
        return services.fail_attempt(job_id, worker, traceback.format_exc())
    services.finish_encoding(job_id, worker, result.key)
    return "cache-hit" if result.cache_hit else "encoded"
