"""Discrete-event simulation of the scheduling policy, on the seed chapter's workload.

Two simulators live in this package (its modules follow these parts; every
public name is importable from `genserver.scheduling.simulator`):

* `seed_simulate` / `seed_waits` (`seed.py`, on `workload.py`'s generator): a
  faithful port of the seed chapter's `simulate()` (FCFS, SJF and static
  pools; non-preemptive, one request per card), with its loop, its generator
  and its percentile, so that its table (images P50/P99 FCFS 17/473 s, SJF
  2/90 s, pools 0/7 s; videos 19/423, 23/614, 152/745 s) comes out exactly.
* `simulate` (`engine.py`, parameterised by `service_policy.py`'s
  `SimConfig`): an event-driven model of the live service that calls the
  scheduling core the service uses: `ClassThresholds.classify` for the
  duration class (= queue), `priority_for` for every message's priority,
  `chunking.steps_per_chunk` for the chunk length, the `PoolLayout` for which
  card consumes which queues in which order, and `admission.decide` on every
  arrival. A card takes the next message by kombu's Redis semantics (priority-
  major over all its queues, then its queue order, FIFO within one (queue,
  priority) list; of several idle cards the one blocked longest gets a new
  message, as Redis serves BRPOP clients), runs one chunk, re-publishes the
  job's next chunk with `priority_for(..., started=True)` and goes back to the
  broker (chunk-level preemption). It charges a checkpoint save + restore at
  every chunk boundary and a model switch whenever a card runs a chunk of a
  model its model cache does not hold (a budget in GiB, least recently used
  out first, as the worker's cache). A worker with k devices is a card
  group (sequence parallelism): it runs one job at a time, `group_speedup(k)`
  times faster than one card (a step of S single-card seconds takes S /
  speedup there).
* `group_table` / `group_layouts` / `simulate_groups` (`groups.py`): the
  seed's "several cards" trade-off (one request per card or per group of
  cards) as its closed-form table and as layouts run through `simulate` on a
  video workload.

Two metrics per class:

* `wait`: arrival → first denoising step (the seed's metric; a model switch
  before the first step counts).
* `delay`: completion − arrival − service seconds (the honest metric for a
  preemptive system: every second a job is not computing its own steps,
  including preemption by other work, checkpoints and model switches).

Plain Python, no Django, deterministic for a given workload and config.
"""

from __future__ import annotations

from .engine import ClassResult, Metric, SimResult, simulate, simulate_rate
from .groups import (
    SEED_VIDEO_SECONDS,
    GroupResult,
    GroupRow,
    group_layout,
    group_layouts,
    group_table,
    simulate_groups,
    video_workload,
)
from .seed import SEED_POLICIES, SeedPolicy, seed_simulate, seed_waits
from .service_policy import (
    DEFAULT_CHECKPOINT_SECONDS,
    DEFAULT_MODEL_CACHE_GIB,
    DEFAULT_MODEL_GIB,
    DEFAULT_SWITCH_SECONDS,
    OVERLOAD_ENGAGE_SHARE,
    SimConfig,
    mixed_layout,
    service_policy_config,
)
from .workload import (
    DEFAULT_MODELS,
    DEFAULT_STEPS,
    IMAGE,
    IMAGE_SECONDS,
    KINDS,
    VIDEO,
    VIDEO_SECONDS,
    Request,
    offered_load,
    pct,
    seed_workload,
)

__all__ = [
    "IMAGE",
    "VIDEO",
    "KINDS",
    "SEED_POLICIES",
    "Request",
    "seed_workload",
    "offered_load",
    "pct",
    "seed_waits",
    "seed_simulate",
    "mixed_layout",
    "SimConfig",
    "service_policy_config",
    "ClassResult",
    "SimResult",
    "simulate",
    "simulate_rate",
    "DEFAULT_CHECKPOINT_SECONDS",
    "DEFAULT_SWITCH_SECONDS",
    "DEFAULT_MODEL_CACHE_GIB",
    "DEFAULT_MODEL_GIB",
    "SEED_VIDEO_SECONDS",
    "GroupRow",
    "group_table",
    "group_layout",
    "group_layouts",
    "video_workload",
    "GroupResult",
    "simulate_groups",
    # also used by the benchmarks and tests
    "Metric",
    "SeedPolicy",
    "IMAGE_SECONDS",
    "VIDEO_SECONDS",
    "DEFAULT_STEPS",
    "DEFAULT_MODELS",
    "OVERLOAD_ENGAGE_SHARE",
]
