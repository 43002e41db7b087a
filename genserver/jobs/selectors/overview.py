"""What GET /api/v1/queues/ and /models/ show, and the headwind admission stretches a wait by."""

from __future__ import annotations

import math
from typing import Any

from genserver import deployment
from genserver.jobs.broker import broker_depth
from genserver.redis_client import CORRECTION_KEY, client as redis_client
from genserver.scheduling.admission import expected_wait
from genserver.scheduling.classes import CLASSES, LONG, priority_for
from genserver.scheduling.cost import StepTimeCorrection
from genserver.scheduling.pools import PoolLayout, class_of

from . import capacity  # capacity.live_workers: one name to stand in for in tests
from .capacity import live_capacity, long_cap_state
from .positions import (
    _work_item,
    headwind_for,
    running_jobs,
    waiting_groups,
)


def _cards(capacity: PoolLayout, duration_class: str) -> tuple[int, dict[str, int]]:
    """The cards serving a class (any of its queues: plain, a model's, a lane's), in all and per node."""
    by_node: dict[str, int] = {}
    for spec in capacity.workers:
        if any(class_of(q) == duration_class for q in spec.consumed_queues()):
            node = spec.name.partition("@")[2]
            by_node[node] = by_node.get(node, 0) + spec.group_size
    return sum(by_node.values()), by_node


# What a user who is not staff sees of a class: its summary, nothing that names a worker or a machine.
QUEUE_SUMMARY_FIELDS = (
    "name",
    "depth",
    "running",
    "backlog_seconds",
    "capacity_source",
    "cards",
    "expected_wait_seconds",
    "wait_limit_seconds",
    "accepting",
    "capped",
)


def queue_overview(staff: bool = True) -> list[dict[str, Any]]:
    """Per duration class: depth, backlog, the cards serving it (live, per node), and whether a new job
    would be accepted now (every figure in wall seconds, like the jobs' estimates and ETAs).

    `staff` False: the class summary only (QUEUE_SUMMARY_FIELDS): no worker names, nodes or
    broker internals."""
    full = _queue_overview()
    if staff:
        return full
    return [{k: entry[k] for k in QUEUE_SUMMARY_FIELDS} for entry in full]


def _queue_overview() -> list[dict[str, Any]]:
    thresholds, limits = deployment.thresholds(), deployment.limits()
    groups, running = waiting_groups(), running_jobs()
    items = [*(g.item() for g in groups), *(_work_item(j, wall=True) for j in running)]
    try:
        workers = capacity.live_workers()
    except Exception:  # noqa: BLE001 - the overview must answer even when Redis is down
        workers = None
    layout = live_capacity(workers or [])
    capped = long_cap_state().engaged
    result = []
    for cls in CLASSES:
        waiting = [g for g in groups if g.duration_class == cls]
        mine = [j for j in running if j.duration_class == cls]
        # A typical new job of the class: its worst (latest-served) new-job priority.
        typical = {
            "short": thresholds.short * 0.99,
            "medium": thresholds.medium * 0.99,
            "long": thresholds.medium * 20,
        }[cls]
        wind = headwind_for(cls, cls, layout)  # as admission decides
        wait = expected_wait(cls, priority_for(cls, typical, False, thresholds), items, layout, wind)
        limit = limits.for_class(cls)
        entry: dict[str, Any] = {
            "name": cls,
            "depth": sum(g.count for g in waiting),
            "running": len(mine),
            "backlog_seconds": round(
                sum(g.seconds for g in waiting) + sum(j.remaining_seconds * j.clock_scale for j in mine), 3
            ),
            "workers": [w.name for w in layout.workers if cls in w.queues],  # dedicated ones included
            # live: counted from heartbeats; layout: nothing reports yet, the configured layout estimates
            "capacity_source": "live" if workers else "layout",
            "cards": _cards(layout, cls)[0],
            "cards_by_node": _cards(layout, cls)[1],
            "expected_wait_seconds": None if math.isinf(wait) else round(wait, 3),
            "wait_limit_seconds": limit,
            "accepting": wait <= limit,
            "capped": cls == LONG and capped,
        }
        if workers is not None:
            entry["live_workers"] = [w["name"] for w in workers if cls in w.get("queues", [])]
            try:
                entry["broker_messages"] = broker_depth(cls)
            except Exception:  # noqa: BLE001 - the overview answers without the depth when Redis is down
                entry["broker_messages"] = None
        result.append(entry)
    return result


def step_time_corrections() -> dict[str, dict[str, float]]:
    """The step-time factors the service has learned (measured / modelled step seconds), by model, then by
    shape bucket (`family:log2(tokens)`): {} for a model that has none yet (simulated ones never learn).
    Redis unreachable: {} (a read for display must not fail the request)."""
    try:
        raw = redis_client().hgetall(CORRECTION_KEY)
    except Exception:  # noqa: BLE001 - the factors are shown, never needed
        return {}
    learned: dict[str, dict[str, float]] = {}
    for key, value in raw.items():
        model, bucket = StepTimeCorrection.split(key.decode() if isinstance(key, bytes) else key)
        learned.setdefault(model, {})[bucket] = round(float(value), 4)
    return learned
