"""Service counters kept in Redis (shared by every process), read by the API and /metrics."""
from __future__ import annotations

import logging

from genserver.redis_client import client

log = logging.getLogger(__name__)
EMBEDDING_CACHE_KEY = "genserver:embedding-cache"


def _count(key: str, **increments: int) -> None:
    try:
        with client().pipeline() as pipe:
            for field, amount in increments.items():
                pipe.hincrby(key, field, amount)
            pipe.execute()
    except Exception:
        log.debug("could not count %s", key, exc_info=True)


def count_embedding_cache(hits: int, misses: int) -> None:
    _count(EMBEDDING_CACHE_KEY, hits=hits, misses=misses)


def embedding_cache_counts() -> dict[str, int]:
    raw = client().hgetall(EMBEDDING_CACHE_KEY)
    return {"hits": int(raw.get(b"hits", 0)), "misses": int(raw.get(b"misses", 0))}


MERGE_KEY = "genserver:merged-denoise"


def count_merged_batch(jobs: int) -> None:
    """A denoise task took `jobs` (≥ 2) same-shape jobs as one batch."""
    _count(MERGE_KEY, batches=1, jobs=jobs)


def merged_counts() -> dict[str, int]:
    """Merged denoise batches started so far, and the jobs they held."""
    raw = client().hgetall(MERGE_KEY)
    return {"batches": int(raw.get(b"batches", 0)), "jobs": int(raw.get(b"jobs", 0))}
