"""Worker liveness in Redis: each worker's short-lived key, and the registry that names them for the readers.

A worker's heartbeat (workers/heartbeat.py) writes its key, `genserver:worker:{name}`, expiring three beats
later: the key is the truth, and a worker whose key is gone (expired, or deleted at a clean stop) is not live.
The readers (every submit and every job's ETA count the live cards: selectors/capacity.py) must not look for
those keys by pattern: a SCAN walks the whole database, whose keys grow with the jobs of the last hour (each
job's event stream), and cost 10 ms per read at 10,000 keys, 110 ms at 100,000. So each beat also puts the
worker's name in a registry (a sorted set, scored by when the name was last written), and a reader takes the
names from there and the keys in one MGET. A name whose key is gone reads as nothing; names not written for an
hour leave the registry at the next beat of any worker (an hour, not the key's lifetime, so clocks that
disagree between nodes never drop a live worker's name).
"""

from __future__ import annotations

import json
import time
from typing import Any

from genserver.redis_client import WORKER_KEY, WORKERS_KEY, client

FORGET_AFTER_SECONDS = 3600.0  # a name not written for this long leaves the registry


def write(name: str, payload: dict[str, Any], ttl_seconds: float) -> None:
    """The worker's key (expiring after `ttl_seconds`) and its name in the registry, in one round trip."""
    now = time.time()
    with client().pipeline(transaction=False) as pipe:
        pipe.set(WORKER_KEY.format(name=name), json.dumps(payload), px=max(1, int(ttl_seconds * 1000)))
        pipe.zadd(WORKERS_KEY, {name: now})
        pipe.zremrangebyscore(WORKERS_KEY, "-inf", now - FORGET_AFTER_SECONDS)
        pipe.execute()


def forget(*names: str) -> None:
    """The workers stop counting now (a clean stop), not when their keys expire."""
    if names:
        with client().pipeline(transaction=False) as pipe:
            pipe.delete(*[WORKER_KEY.format(name=name) for name in names])
            pipe.zrem(WORKERS_KEY, *names)
            pipe.execute()


def read() -> list[dict[str, Any]]:
    """Every live worker's payload, as its last beat wrote it: two round trips, however many keys Redis holds."""
    r = client()
    names = [n.decode() if isinstance(n, bytes) else n for n in r.zrange(WORKERS_KEY, 0, -1)]
    if not names:
        return []
    return [json.loads(raw) for raw in r.mget([WORKER_KEY.format(name=name) for name in names]) if raw]
