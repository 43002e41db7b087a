"""How a job is cut into chunks: the unit of scheduling, preemption and recovery.

A chunk is K denoising steps, K chosen so that a chunk lasts about
`CHUNK_SECONDS` of GPU time but never less than one step:

    K = max(1, floor(CHUNK_SECONDS / step_seconds))

Between two chunks the worker goes back to the broker (chunk-level
preemption), so a waiting short job runs after at most one chunk of long work.
Plain Python, no Django: the denoise task and the simulator share it.
"""

from __future__ import annotations

import math

# The default chunk length (seconds of GPU time), chosen from the simulator's
# trade-off curve (docs/BENCHMARKS.md, "Scheduling policy (simulator)").
DEFAULT_CHUNK_SECONDS = 4.0

# Tolerance for float division: 4.8 s / 2.4 s must be 2 steps, not 1.999… → 1.
_EPS = 1e-9


def steps_per_chunk(chunk_seconds: float, step_seconds: float) -> int:
    """K = max(1, floor(chunk_seconds / step_seconds)): a chunk is never shorter than one step."""
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be positive, got {step_seconds}")
    if chunk_seconds <= 0:
        return 1
    return max(1, math.floor(chunk_seconds / step_seconds + _EPS))


def chunk_plan(total_steps: int, chunk_seconds: float, step_seconds: float) -> list[int]:
    """The step count of each chunk of a job, in order (the last one may be shorter)."""
    if total_steps <= 0:
        raise ValueError(f"a job needs at least one step, got {total_steps}")
    k = steps_per_chunk(chunk_seconds, step_seconds)
    full, rest = divmod(total_steps, k)
    return [k] * full + ([rest] if rest else [])
