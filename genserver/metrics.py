"""Service counters kept in Redis (shared by every process), read by the API and /metrics."""
from __future__ import annotations

import logging

from genserver.redis_client import client

log = logging.getLogger(__name__)
EMBEDDING_CACHE_KEY = "genserver:embedding-cache"


def count_embedding_cache(hits: int, misses: int) -> None:
    try:
        with client().pipeline() as pipe:
            pipe.hincrby(EMBEDDING_CACHE_KEY, "hits", hits)
            pipe.hincrby(EMBEDDING_CACHE_KEY, "misses", misses)
            pipe.execute()
    except Exception:  # noqa: BLE001 - counting never fails a job
        log.debug("could not count embedding cache use", exc_info=True)


def embedding_cache_counts() -> dict[str, int]:
    raw = client().hgetall(EMBEDDING_CACHE_KEY)
    return {"hits": int(raw.get(b"hits", 0)), "misses": int(raw.get(b"misses", 0))}


MERGE_KEY = "genserver:merged-denoise"


def count_merged_batch(jobs: int) -> None:
    """A denoise task took `jobs` (≥ 2) same-shape jobs as one batch."""
    try:
        with client().pipeline() as pipe:
            pipe.hincrby(MERGE_KEY, "batches", 1)
            pipe.hincrby(MERGE_KEY, "jobs", jobs)
            pipe.execute()
    except Exception:  # noqa: BLE001 - counting never fails a job
        log.debug("could not count a merged batch", exc_info=True)


def merged_counts() -> dict[str, int]:
    """Merged denoise batches started so far, and the jobs they held."""
    raw = client().hgetall(MERGE_KEY)
    return {"batches": int(raw.get(b"batches", 0)), "jobs": int(raw.get(b"jobs", 0))}
