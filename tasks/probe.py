"""A no-op task for measuring the bare Celery round trip on the same broker (bench/overhead.py)."""

from __future__ import annotations

import time

from celery import shared_task

from genserver.jobs import broker


@shared_task(name=broker.PING_TASK.name)
def ping(reply_key: str, sent_at: float) -> None:
    """Push the time the task started to `reply_key`, where the sender waits for it (BLPOP)."""
    from genserver.redis_client import client

    client().lpush(reply_key, f"{sent_at} {time.time()}")
    client().expire(reply_key, 60)
