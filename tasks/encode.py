"""Stage 1: text encode (queue `encode`), then the first denoise chunk is published.

The task takes its job and, with it, other queued jobs of the same model (up
to GENSERVER_ENCODE_BATCH), so prompts that wait together share one
text-encoder call; embeddings are cached by a hash of (encoder, prompts).
"""

from __future__ import annotations

import traceback

from celery import shared_task
from django.conf import settings

from genserver.jobs import broker, events, services
from genserver.jobs.services import Outcome
from genserver.metrics import count_embedding_cache
from workers.runtime import stages

from .common import family_of, preload, request_of, storage, worker_id


@shared_task(name=broker.ENCODE_TASK.name, bind=True)
def encode(self, job_id: str) -> str:
    events.card_busy()  # to the chunk's publish, this process's background threads wait (genserver/jobs/events.py)
    try:
        return _encode(self, job_id)
    finally:
        events.card_stepping()


def _encode(self, job_id: str) -> str:
    worker = worker_id(self)
    if not preload(job_id, "encode"):
        return Outcome.SKIPPED
    job = services.start_encoding(job_id, worker)
    if job is None:
        return Outcome.SKIPPED  # cancelled, finished, or another worker has it: a redelivery does nothing
    batch = [job] + services.claim_encode_batch(job, worker, settings.ENCODE_BATCH - 1)
    try:
        results = stages.encode(family_of(job, "encode"), storage(), [request_of(j) for j in batch])
    except Exception:  # noqa: BLE001 - recorded on the jobs, retried from the database
        error = traceback.format_exc()
        return ",".join(services.fail_attempt(j.pk, worker, error) for j in batch)
    for member, result in zip(batch, results):
        services.finish_encoding(member.pk, worker, result.key, claimed=member)
    hits = sum(r.cache_hit for r in results)
    count_embedding_cache(hits, len(results) - hits)
    return f"{len(batch)} encoded, {hits} from the cache"
