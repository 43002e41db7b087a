"""Stage 3: VAE decode on its own worker (queue `decode`); the job succeeds with its outputs."""
from __future__ import annotations

import traceback

from celery import shared_task

from genserver.jobs import services
from workers.runtime import stages

from .common import family_of, preload, renewing, request_of, storage, worker_id


@shared_task(name="tasks.decode.decode", bind=True)
def decode(self, job_id: str) -> str:
    worker = worker_id(self)
    if not preload(job_id, "decode"):
        return "skipped"
    job = services.start_decoding(job_id, worker)
    if job is None:
        return "skipped"
    try:
        with renewing(lambda: services.heartbeat(job_id, worker)):
            outputs = stages.decode(family_of(job, "decode"), storage(), request_of(job), embeddings_ref=job.embeddings_key,
                                    checkpoint_ref=job.checkpoint_key)
    except Exception:  # noqa: BLE001
        return services.fail_attempt(job_id, worker, traceback.format_exc())
    services.finish_decoding(job_id, worker, outputs)
    return "succeeded"
