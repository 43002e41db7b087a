"""The capacity that serves the queues: the cards whose workers heartbeat, on every node, and the overload
cap's hold on them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from genserver import deployment, liveness
from genserver.jobs.models import Job, JobStatus
from genserver.redis_client import LONG_CAP_KEY, client as redis_client
from genserver.scheduling.classes import LONG
from genserver.scheduling.overload import capped_layout
from genserver.scheduling.pools import PoolLayout, worker_from_queues


def live_workers() -> list[dict[str, Any]]:
    """Workers that sent a heartbeat recently (see workers/heartbeat.py), every node's, by name
    (`gpu0@NODE`): each with its node, pool entry, queues, cards and loaded models."""
    found = []
    for worker in liveness.read():  # two round trips for every worker (each submit reads them)
        name = str(worker.get("name", ""))
        worker.setdefault("worker", name.partition("@")[0])
        worker.setdefault("node", name.partition("@")[2])
        found.append(worker)
    return sorted(found, key=lambda w: (w.get("node", ""), w.get("name", "")))


def _devices(worker: dict[str, Any]) -> tuple[int, ...]:
    text = str(worker.get("devices", "") or "")
    return tuple(int(d) for d in text.split(",") if d.strip().isdigit())


def capacity_of(workers: list[dict[str, Any]]) -> PoolLayout:
    """The capacity these live workers are: one pool entry per worker, named `gpu0@NODE`."""
    specs = []
    for worker in workers:
        try:
            specs.append(worker_from_queues(str(worker["name"]), list(worker.get("queues", [])), _devices(worker)))
        except (KeyError, ValueError):  # a malformed or foreign heartbeat is no capacity
            continue
    return PoolLayout(tuple(specs), complete=False)


def live_capacity(workers: list[dict[str, Any]] | None = None, capped: bool = True) -> PoolLayout:
    """What admission, queue positions and ETAs count: the cards whose workers heartbeat now, on every
    node. A node that dies stops counting when its heartbeats expire (3 intervals, within the lease);
    a new node counts from its first heartbeat. With no worker reporting (before the first heartbeat,
    or Redis unreachable) the configured layout is the estimate, so the service keeps accepting work
    for the nodes that are starting. While the overload cap holds (`capped`), the long class counts the
    cards it may use only (scheduling/overload.py)."""
    if workers is None:
        try:
            workers = live_workers()
        except Exception:  # noqa: BLE001 - admission must answer when Redis is down: the layout estimates
            workers = []
    capacity = capacity_of(workers) if workers else deployment.layout()
    if capped:
        state = long_cap_state()
        if state.engaged:
            return capped_layout(capacity, state.cap)
    return capacity


def nodes_overview(workers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per live node: its workers' names and the denoising cards they are (GET /api/v1/workers/)."""
    nodes: dict[str, dict[str, Any]] = {}
    for spec in capacity_of(workers).workers:
        entry = nodes.setdefault(spec.name.partition("@")[2], {"workers": [], "cards": 0})
        entry["workers"].append(spec.name)
        entry["cards"] += spec.group_size if spec.denoises else 0
    return nodes


# --- The overload cap (scheduling/overload.py; written by services/overload.py on every reaper tick) ------
@dataclass(frozen=True)
class LongCapState:
    """The overload cap as beat last decided it (off when beat has not written it lately)."""

    engaged: bool = False
    cap: int = 0  # cards that may run long work while engaged
    long_cards: int = 0  # live cards that take long work
    long_wait_seconds: float = 0.0  # a new long job's expected wait, over every card, when decided
    changed_at: str = ""  # when it last engaged or let go (ISO 8601)


def long_cap_state() -> LongCapState:
    try:
        raw = redis_client().get(LONG_CAP_KEY)
        return LongCapState(**json.loads(raw)) if raw else LongCapState()
    except Exception:  # noqa: BLE001 - Redis down or a foreign value: fail open, every card takes long work
        return LongCapState()


def cards_running_long(exclude_worker: str = "") -> int:
    """Workers (by lease owner) running a long job's chunk now, other than `exclude_worker`."""
    return (
        Job.objects.filter(duration_class=LONG, status=JobStatus.DENOISING, lease_expires_at__gt=timezone.now())
        .exclude(lease_owner__in=["", exclude_worker])
        .values("lease_owner")
        .distinct()
        .count()
    )


def must_leave_long(worker: str) -> bool:
    """Whether `worker` must not run long work now: the cap holds and its share of cards is taken."""
    state = long_cap_state()
    return state.engaged and cards_running_long(exclude_worker=worker) >= state.cap
