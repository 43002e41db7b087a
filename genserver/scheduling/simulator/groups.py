"""The seed's "several cards" trade-off: one request per card or per group of cards.

As its closed-form table (`group_table`) and as layouts run through `simulate`
on a video workload (`group_layouts`, `simulate_groups`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..classes import LONG, MEDIUM, SHORT
from ..pools import CONTROL, DECODE, ENCODE, GROUP_EFFICIENCY, INTERACTIVE, PoolLayout, WorkerSpec, group_speedup
from .engine import simulate
from .service_policy import SimConfig
from .workload import VIDEO, Request, pct

SEED_VIDEO_SECONDS = 25 * 60.0  # the seed's 5-second 720p Wan video: 25 minutes on one card


@dataclass(frozen=True)
class GroupRow:
    """One line of the seed's "several cards" table: `cards` split into groups of `group`."""

    group: int  # cards per group
    groups: int  # groups on the machine
    latency_minutes: float  # one video, alone on a group
    videos_per_hour: float  # the whole machine, every group busy


def group_table(single_seconds: float = SEED_VIDEO_SECONDS, cards: int = 8) -> list[GroupRow]:
    """The seed's closed-form table: latency = single / (k × eff), throughput = cards / k / latency.

    One row per group size of `GROUP_EFFICIENCY` that divides `cards`; with the
    defaults: 25.0 min / 19.2 videos/h (k=1), 13.2 / 18.2, 7.1 / 16.9, 3.9 / 15.4 (k=8).
    """
    rows = []
    for k in sorted(GROUP_EFFICIENCY):
        if k > cards or cards % k:
            continue
        latency = single_seconds / group_speedup(k)
        rows.append(GroupRow(k, cards // k, latency / 60, cards / k / latency * 3600))
    return rows


def group_layout(groups: Sequence[int], group_lane: str = "") -> PoolLayout:
    """A layout of denoise workers, one per entry of `groups` (its card count), on consecutive
    devices, every one consuming short, medium and long; plus encode/decode on the CPU.
    With `group_lane`, the groups (k > 1) serve only that lane (as `default_layout(group_cards=k)`
    does), the single cards everything else."""
    workers, first = [], 0
    for i, k in enumerate(groups):
        group_speedup(k)  # refuse an unknown group size here, not mid-simulation
        workers.append(
            WorkerSpec(
                name=f"g{i}x{k}",
                queues=(SHORT, MEDIUM, LONG),
                devices=tuple(range(first, first + k)),
                lane=group_lane if k > 1 else "",
            )
        )
        first += k
    workers.append(WorkerSpec(name="encode", queues=(ENCODE, CONTROL)))
    workers.append(WorkerSpec(name="decode", queues=(DECODE,)))
    return PoolLayout(tuple(workers))


def group_layouts(cards: int = 8) -> dict[str, PoolLayout]:
    """The layouts compared for `cards` cards: every uniform split, and the seed's pooled one
    (one group of half the cards beside single cards; "two groups of 4 serving interactive
    requests and the rest ... a card at a time" scaled to one machine)."""
    layouts = {
        f"{cards // k}×{k}": group_layout([k] * (cards // k))
        for k in sorted(GROUP_EFFICIENCY)
        if k <= cards and cards % k == 0
    }
    half = cards // 2
    if half in GROUP_EFFICIENCY and half > 1:
        layouts[f"pooled: 1×{half} + {cards - half}×1"] = group_layout([half] + [1] * (cards - half))
        layouts[f"pooled, routed: 1×{half} {INTERACTIVE} + {cards - half}×1"] = group_layout(
            [half] + [1] * (cards - half), group_lane=INTERACTIVE
        )
    return layouts


def video_workload(
    arrivals: int = 400,
    rate: float = 0.7 * 8 / SEED_VIDEO_SECONDS,
    seed: int = 0,
    seconds: float = SEED_VIDEO_SECONDS,
    interactive_share: float = 0.0,
) -> list[Request]:
    """Poisson arrivals at `rate` per second of videos of `seconds` single-card seconds each
    (the default rate offers 70 % of 8 single cards). A share `interactive_share` of them is
    submitted on the interactive lane (drawn from a second generator, so the arrivals are the
    same whatever the share)."""
    rng, lanes = random.Random(seed), random.Random(seed + 1)
    t, requests = 0.0, []
    for _ in range(arrivals):
        t += rng.expovariate(rate)
        lane = INTERACTIVE if lanes.random() < interactive_share else ""
        requests.append(Request(t, VIDEO, seconds, lane))
    return requests


@dataclass(frozen=True)
class GroupResult:
    """One layout on the video workload."""

    layout: str
    capacity_per_hour: float  # videos/hour with every worker busy
    load: float  # offered work / capacity
    p50_minutes: float  # completion − arrival
    p99_minutes: float
    videos_per_hour: float  # finished / (last completion − first arrival)
    interactive_p50_minutes: float = 0.0  # the requests submitted on the interactive lane
    interactive_p99_minutes: float = 0.0
    other_p50_minutes: float = 0.0  # the others (offline)
    other_p99_minutes: float = 0.0


def simulate_groups(
    cards: int = 8,
    load: float = 0.7,
    arrivals: int = 400,
    seed: int = 0,
    single_seconds: float = SEED_VIDEO_SECONDS,
    interactive_share: float = 0.4,
) -> list[GroupResult]:
    """Every layout of `group_layouts(cards)` on one video workload offering `load` of `cards`
    single cards: latency P50/P99 (minutes, arrival → completion) and throughput, overall and
    for the `interactive_share` of requests submitted on the interactive lane and the others.

    Everything is admitted (no admission limits, no long cap), so the layouts are
    compared on the same requests; checkpoint costs are the defaults. In every layout but
    the routed one all workers consume the same queue (the lane has no worker, so its
    requests go to the class queue, as in the service), idle workers popping the way
    Redis serves them (the one blocked longest first): the unrouted pooled layout's group
    takes whichever video comes when it is the longest idle. In the routed one the group
    serves only the interactive lane and the single cards the rest.
    """
    rate = load * cards / single_seconds
    requests = video_workload(arrivals, rate, seed, single_seconds, interactive_share)
    results = []
    for name, layout in group_layouts(cards).items():
        cfg = SimConfig(layout=layout, limits=None, steps={single_seconds: 50})
        run = simulate(requests, cfg)
        res = run.classes[VIDEO]
        capacity = sum(group_speedup(w.group_size) for w in layout.workers if w.denoises) * 3600 / single_seconds
        span = run.makespan - requests[0].arrival  # the last event is the last completion
        lanes = {lane: r.latencies for lane, r in run.lanes.items()}
        fast, rest = lanes.get(INTERACTIVE, []), lanes.get("", [])
        results.append(
            GroupResult(
                name,
                capacity,
                rate * 3600 / capacity,
                pct(res.latencies, 0.5) / 60,
                pct(res.latencies, 0.99) / 60,
                len(res.latencies) / span * 3600,
                pct(fast, 0.5) / 60,
                pct(fast, 0.99) / 60,
                pct(rest, 0.5) / 60,
                pct(rest, 0.99) / 60,
            )
        )
    return results
