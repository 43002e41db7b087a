"""What the workers really did, recorded for the fault drills (bench/chaos.py, tests/reliability).

Loaded into the worker processes through Celery's `imports` (tests/settings.py)
or `--include bench.chaos_probe` (bench/chaos.py). It changes no behaviour; it
counts, in the service's Redis (keys expire after a day):

    genserver:chaos:steps:{job}    step index → times a simulated denoising step ran
    genserver:chaos:chunks:{job}   "step" → times a run of the chunk ending at that step got to its end
                                   and recorded it (services.finish_chunk returned True);
                                   "step:superseded" → times a run got to its end and found the job
                                   taken over (finish_chunk returned False: its lease had expired)
    genserver:chaos:decodes        "job" / "job:superseded" → the same for services.finish_decoding

A chunk or decode recorded twice would be work done twice to completion, which
the job service's compare-and-set must prevent. A superseded run is work
computed twice (a live worker taken for dead) but recorded once. A run killed
before it records is an interrupted run: its steps counted twice are the work
redone after the crash (which must stay within the interrupted chunk).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "genserver:chaos:"
STEPS = PREFIX + "steps:{job}"
CHUNKS = PREFIX + "chunks:{job}"
DECODES = PREFIX + "decodes"
TTL_SECONDS = 24 * 3600
SUPERSEDED = ":superseded"


def _count(key: str, field: Any) -> None:
    from genserver.redis_client import client

    try:
        with client().pipeline() as pipe:
            pipe.hincrby(key, str(field), 1)
            pipe.expire(key, TTL_SECONDS)
            pipe.execute()
    except Exception:
        log.warning("chaos probe: could not record %s %s", key, field, exc_info=True)


def _install() -> None:
    from genserver.jobs import services
    from workers.runtime.simulated import SimulatedFamily

    if getattr(services.finish_chunk, "_chaos_probe", False):
        return
    finish_chunk, finish_decoding, step = services.finish_chunk, services.finish_decoding, SimulatedFamily.step

    @functools.wraps(finish_chunk)
    def counted_finish_chunk(job_id, worker, step_done, *args, **kwargs):
        recorded = finish_chunk(job_id, worker, step_done, *args, **kwargs)
        _count(CHUNKS.format(job=job_id), f"{int(step_done)}{'' if recorded else SUPERSEDED}")
        return recorded

    @functools.wraps(finish_decoding)
    def counted_finish_decoding(job_id, *args, **kwargs):
        recorded = finish_decoding(job_id, *args, **kwargs)
        _count(DECODES, f"{job_id}{'' if recorded else SUPERSEDED}")
        return recorded

    def counted_step(self, state) -> None:
        index = state.step
        step(self, state)
        _count(STEPS.format(job=state.request.job_id), index)

    counted_finish_chunk._chaos_probe = True  # type: ignore[attr-defined]
    services.finish_chunk = counted_finish_chunk
    services.finish_decoding = counted_finish_decoding
    SimulatedFamily.step = counted_step  # type: ignore[method-assign]


_install()


# --- reading (the drills) ----------------------------------------------------------------


def _hash(key: str) -> dict[str, int]:
    from genserver.redis_client import client

    return {k.decode(): int(v) for k, v in client().hgetall(key).items()}


def step_runs(job_id: Any) -> dict[int, int]:
    """Step index → times it ran."""
    return {int(k): v for k, v in _hash(STEPS.format(job=job_id)).items()}


def chunk_completions(job_id: Any) -> dict[int, int]:
    """Step a chunk ended at → times a run of it got to the end and recorded it (committed)."""
    return {int(k): v for k, v in _hash(CHUNKS.format(job=job_id)).items() if not k.endswith(SUPERSEDED)}


def chunks_superseded(job_id: Any) -> dict[int, int]:
    """Step a chunk ended at → times a run of it got to the end but found the job taken over
    (its lease had expired and another worker had it): computed, saved, and discarded."""
    return {
        int(k[: -len(SUPERSEDED)]): v for k, v in _hash(CHUNKS.format(job=job_id)).items() if k.endswith(SUPERSEDED)
    }


def decode_completions(job_id: Any) -> int:
    """Times a decode of the job wrote its outputs and recorded them (committed)."""
    from genserver.redis_client import client

    return int(client().hget(DECODES, str(job_id)) or 0)


def decodes_superseded(job_id: Any) -> int:
    from genserver.redis_client import client

    return int(client().hget(DECODES, f"{job_id}{SUPERSEDED}") or 0)
