"""A faithful port of the seed chapter's `simulate()`: FCFS, SJF and static pools.

Non-preemptive, one request per card, with the chapter's loop, generator and
percentile, so that its table (images P50/P99 FCFS 17/473 s, SJF 2/90 s, pools
0/7 s; videos 19/423, 23/614, 152/745 s) comes out exactly.
"""

from __future__ import annotations

import heapq
from typing import Literal

from .workload import IMAGE, VIDEO, pct, seed_workload

SeedPolicy = Literal["fcfs", "sjf", "pools"]
SEED_POLICIES: tuple[SeedPolicy, ...] = ("fcfs", "sjf", "pools")


def seed_waits(
    policy: SeedPolicy, n_gpus: int = 4, arrivals: int = 400, rate: float = 0.06, seed: int = 0
) -> dict[str, list[float]]:
    """Every request's queueing wait (seconds) under one of the seed's policies, per kind.

    The chapter's `simulate()` loop: requests that have arrived by `now` enter
    a heap keyed by arrival ('fcfs', 'pools') or by duration ('sjf'); the
    earliest-free card pops the heap only when it is free at `now`, otherwise
    time advances to that card's free time or to the next arrival. 'pools'
    runs images on 1 card and videos on the other n_gpus − 1. Non-preemptive
    and without overheads, so the wait is also completion − arrival − service.
    """
    if policy not in SEED_POLICIES:
        raise ValueError(f"unknown seed policy {policy!r}; known: {SEED_POLICIES}")
    reqs = [(r.arrival, r.kind, r.seconds) for r in seed_workload(arrivals, rate, seed)]
    waits: dict[str, list[float]] = {IMAGE: [], VIDEO: []}
    if policy == "pools":
        groups = [([r for r in reqs if r[1] == IMAGE], 1), ([r for r in reqs if r[1] == VIDEO], n_gpus - 1)]
    else:
        groups = [(reqs, n_gpus)]
    for rs, cards in groups:
        free = [0.0] * cards  # when each card frees up
        pending: list[tuple[float, tuple[float, str, float]]] = []
        i, now = 0, 0.0
        while i < len(rs) or pending:
            while i < len(rs) and rs[i][0] <= now:
                heapq.heappush(pending, ((rs[i][2] if policy == "sjf" else rs[i][0]), rs[i]))
                i += 1
            g = min(range(cards), key=lambda k: free[k])
            if pending and free[g] <= now:
                _, (arrival, kind, duration) = heapq.heappop(pending)
                waits[kind].append(now - arrival)
                free[g] = now + duration
            else:  # advance the time to the next event
                nxt = [free[g]] if pending else []
                if i < len(rs):
                    nxt.append(rs[i][0])
                now = max(now, min(nxt)) if nxt else now
    return waits


def seed_simulate(
    policy: SeedPolicy, n_gpus: int = 4, arrivals: int = 400, rate: float = 0.06, seed: int = 0
) -> dict[str, tuple[float, float]]:
    """The chapter's `simulate()`: {kind: (P50 wait, P99 wait)} in seconds."""
    waits = seed_waits(policy, n_gpus, arrivals, rate, seed)
    return {k: (pct(v, 0.5), pct(v, 0.99)) for k, v in waits.items()}
