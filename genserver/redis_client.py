"""One Redis connection pool per process, for flags, counters and worker heartbeats (not the broker)."""

from __future__ import annotations

from functools import lru_cache

import redis
from django.conf import settings

CANCEL_KEY = "genserver:cancel:{job_id}"
STEPS_KEY = "genserver:steps:{job_id}"  # the job's latest total; a worker running another total stops
CORRECTION_KEY = "genserver:step-correction"
WORKER_KEY = "genserver:worker:{name}"
LONG_CAP_KEY = "genserver:long-cap"  # the overload cap's state, written by beat (services/overload.py)


@lru_cache(maxsize=1)
def client() -> redis.Redis:
    return redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5, health_check_interval=30
    )
