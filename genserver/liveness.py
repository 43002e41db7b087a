"""Worker liveness in Redis: each worker's short-lived key, and the registry that names them for the readers.

A worker's heartbeat (workers/heartbeat.py) writes its key, `genserver:worker:{name}`, expiring three beats
later: the key is the truth, and a worker whose key is gone (expired, or deleted at a clean stop) is not live.
The readers (every submit and every job's ETA count the live cards: selectors/capacity.py) must not look for
those keys by pattern: a SCAN walks the whole database, whose keys grow with the jobs of the last hour (each
job's event stream), and cost 10 ms per read at 10,000 keys, 110 ms at 100,000. So each beat also puts the
worker's name in a registry (a sorted set, scored by when the name was last written), and a reader takes the
names from there and their keys' values in one round trip: a script, since a pipeline cannot feed the names it
reads to the read of their keys; a request sends it in the pipeline of its other reads (selectors/capacity.py,
`cluster_reads`). A name whose key is gone reads as nothing; names not written for an hour leave the registry at
the next beat of any worker (an hour, not the key's lifetime, so clocks that disagree between nodes never drop a
live worker's name).
"""

from __future__ import annotations

import json
import time
from typing import Any

from redis.client import Pipeline

from genserver.redis_client import WORKER_KEY, WORKERS_KEY, client

FORGET_AFTER_SECONDS = 3600.0  # a name not written for this long leaves the registry

# The registry's names, then each name's key: the values of the keys that are there. The keys are named from the
# registry inside the script, which a single Redis allows (a cluster would need the keys in one hash slot).
_READ_SCRIPT = """
local found = {}
for _, name in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local payload = redis.call('GET', ARGV[1] .. name)
  if payload then found[#found + 1] = payload end
end
return found
"""
_KEY_PREFIX = WORKER_KEY.format(name="")


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
    """Every live worker's payload, as its last beat wrote it: one round trip, however many keys Redis holds."""
    return payloads(client().eval(_READ_SCRIPT, 1, WORKERS_KEY, _KEY_PREFIX))


def read_in(pipe: Pipeline) -> None:
    """Queue `read`'s script on `pipe` (a request's other reads beside it); its answer, given to `payloads`, is
    what `read` returns."""
    pipe.eval(_READ_SCRIPT, 1, WORKERS_KEY, _KEY_PREFIX)


def payloads(answer: list[bytes | str]) -> list[dict[str, Any]]:
    """The payloads of the script's answer (the keys it found)."""
    return [json.loads(raw) for raw in answer]
