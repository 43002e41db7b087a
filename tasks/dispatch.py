"""Publishing: which queue and priority each stage's message goes to (the routing step)."""
from __future__ import annotations

from collections.abc import Iterable
from uuid import UUID

from genserver.celery import app
from genserver.scheduling.pools import DECODE, ENCODE, WEBHOOKS


def send_encode(job_id: UUID, priority: int) -> None:
    app.send_task("tasks.encode.encode", args=[str(job_id)], queue=ENCODE, priority=priority)


def send_chunk(job_id: UUID, from_step: int, queue: str, priority: int) -> None:
    """The next denoise chunk goes to the job's queue (its class, or its model's own class queue)
    at its current priority band."""
    app.send_task("tasks.denoise.run_chunk", args=[str(job_id), from_step], queue=queue, priority=priority)


def withdraw_chunks(queue: str, job_ids: Iterable[UUID]) -> int:
    """Take the waiting denoise messages of these jobs off `queue`: they joined a merged batch.

    Left there, each would wake a card only to find its job held (harmless,
    but a card's yield test would also see them as work waiting ahead of the
    batch). A message some worker takes meanwhile is simply not found.
    Returns how many were removed.
    """
    from genserver.jobs.selectors import queue_keys
    from genserver.redis_client import client

    wanted = [str(job_id).encode() for job_id in job_ids]
    if not wanted:
        return 0
    r = client()
    keys = queue_keys(queue)
    with r.pipeline() as pipe:
        for key in keys:
            pipe.lrange(key, 0, -1)
        listed = pipe.execute()
    removed = 0
    for key, messages in zip(keys, listed):
        for raw in messages:
            if b"tasks.denoise.run_chunk" in raw and any(job_id in raw for job_id in wanted):
                removed += int(r.lrem(key, 1, raw))
    return removed


def send_decode(job_id: UUID, priority: int) -> None:
    app.send_task("tasks.decode.decode", args=[str(job_id)], queue=DECODE, priority=priority)


def send_webhook(job_id: UUID, event: str, payload: dict) -> None:
    """A webhook event goes to its own queue, consumed by a worker that holds no card."""
    app.send_task("tasks.webhooks.deliver", args=[str(job_id), event, payload], queue=WEBHOOKS)


def send_segment_decode(job_id: UUID, index: int, priority: int) -> None:
    """A long video's segment is decoded on the decode worker while its card denoises the next one."""
    app.send_task("tasks.segments.decode_segment", args=[str(job_id), index], queue=DECODE, priority=priority)


def send_assemble(job_id: UUID, priority: int) -> None:
    """Every segment is published: the whole video is assembled on the decode worker."""
    app.send_task("tasks.segments.assemble", args=[str(job_id)], queue=DECODE, priority=priority)
