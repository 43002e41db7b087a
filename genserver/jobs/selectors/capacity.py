"""The capacity that serves the queues: the cards whose workers heartbeat, on every node, and the overload
cap's hold on them; with the learned stage seconds, what a request's picture of the queue reads from Redis, in one
round trip (`cluster_reads`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from genserver import deployment, liveness
from genserver.jobs.models import Job, JobStatus
from genserver.redis_client import LONG_CAP_KEY, STAGE_SECONDS_KEY, client as redis_client
from genserver.scheduling.classes import LONG
from genserver.scheduling.overload import capped_layout
from genserver.scheduling.pools import PoolLayout, worker_from_queues

from .kept import KeptRead


def live_workers() -> list[dict[str, Any]]:
    """Workers that sent a heartbeat recently (see workers/heartbeat.py), every node's, by name
    (`gpu0@NODE`): each with its node, pool entry, queues, cards and loaded models."""
    return _named(liveness.read())


def _named(payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for worker in payloads:
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
    return _held_to(long_cap_state() if capped else LongCapState(), workers)


def _held_to(cap: LongCapState, workers: list[dict[str, Any]]) -> PoolLayout:
    """The cards of `workers` (the configured layout when none reports), the long class capped while `cap` holds."""
    capacity = capacity_of(workers) if workers else deployment.layout()
    return capped_layout(capacity, cap.cap) if cap.engaged else capacity


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
        return _cap_from(redis_client().get(LONG_CAP_KEY))
    except Exception:  # noqa: BLE001 - Redis down: fail open, every card takes long work
        return LongCapState()


def _cap_from(raw: bytes | str | None) -> LongCapState:
    try:
        return LongCapState(**json.loads(raw)) if raw else LongCapState()
    except Exception:  # noqa: BLE001 - a foreign value: fail open, as when Redis is down
        return LongCapState()


# --- The learned stage seconds (written by services.estimates.learn_stage_seconds) -----------------------------
def stage_seconds() -> dict[str, float]:
    """The learned wall seconds around each model's denoising steps, {"{model}:{stage}": seconds} (the stages of
    redis_client.STAGE_SECONDS_KEY); {} before any job measured them, or when Redis is unreachable (an ETA then
    counts the queue and the denoising alone)."""
    try:
        return _stages_from(redis_client().hgetall(STAGE_SECONDS_KEY))
    except Exception:  # noqa: BLE001 - an ETA without them is still an ETA
        return {}


def _stages_from(raw: dict[bytes | str, bytes | str]) -> dict[str, float]:
    return {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in raw.items()}


# --- What a request's picture of the queue reads from Redis ----------------------------------------------------
@dataclass(frozen=True)
class ClusterReads:
    """The live cards (capped while the overload cap holds, as `live_capacity`) and the learned stage seconds."""

    layout: PoolLayout
    stage_seconds: dict[str, float]


def cluster_reads(clock: Callable[[], float] = time.monotonic) -> ClusterReads:
    """`live_capacity()` and `stage_seconds()` in one round trip: every submit and every job's answer reads all
    three keys, and on a busy API process each round trip is a wait for the GIL again as well as for Redis.
    A read is reused by the process's requests for `config.cluster_read_seconds()` (the cards' heartbeats
    themselves come every few seconds). Each part falls back as its own read does when Redis is unreachable;
    such a fallback is not reused."""
    now = clock()
    read = _CLUSTER_READ.get(now)
    if read is not None:
        return read
    read = _read_cluster()
    if read is None:
        return ClusterReads(_held_to(LongCapState(), []), {})
    _CLUSTER_READ.keep(now, read)
    return read


_CLUSTER_READ: KeptRead[ClusterReads] = KeptRead()  # the process's last read from Redis


def forget_cluster_read() -> None:
    """The next `cluster_reads` reads Redis (after this process changed what it reads)."""
    _CLUSTER_READ.forget()


def _read_cluster() -> ClusterReads | None:
    try:
        with redis_client().pipeline(transaction=False) as pipe:
            liveness.read_in(pipe)
            pipe.get(LONG_CAP_KEY)
            pipe.hgetall(STAGE_SECONDS_KEY)
            workers, cap, stages = pipe.execute()
    except Exception:  # noqa: BLE001 - admission must answer when Redis is down: the layout estimates
        return None
    return ClusterReads(_held_to(_cap_from(cap), _named(liveness.payloads(workers))), _stages_from(stages))


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
