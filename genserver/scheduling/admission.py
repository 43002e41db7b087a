"""Admission: refuse work whose expected wait exceeds its class's limit.

The expected wait of a job is the work that will run before it (everything
queued or running at its priority or better, on the cards that can serve it)
divided by the number of those cards, a group of k cards counting as
`group_speedup(k)` cards (it runs one job that many times faster). Because short work has the best
priorities, a short job only waits for short work while a long job waits for
everything: under overload the long class crosses its limit first, so video
is refused while images are still accepted.

Two things slow the work ahead of a job beyond its own seconds (`Headwind`):
higher-priority work that arrives while it waits (a short job preempts a
long one at every chunk boundary), and the card time paid at chunk
boundaries. Without them a long job's estimate is optimistic and an accepted
video can start after its class's limit.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .classes import CLASSES, LONG, MEDIUM, SHORT
from .pools import PoolLayout, class_of


@dataclass(frozen=True)
class WorkItem:
    """A job in the system, as admission sees it."""

    queue: str  # the broker queue: the duration class, or "class.model" for a dedicated model
    priority: int
    remaining_seconds: float  # expected work left
    running: bool = False
    chunk_remaining_seconds: float = 0.0  # a running job holds its card until its chunk ends
    count: int = 1  # the jobs it sums (a waiting group of the live service's tally), each of the mean size


@dataclass(frozen=True)
class Headwind:
    """What slows the work ahead of a job beyond its seconds.

    higher_share: the share of the serving cards' time that work of better classes, arriving while the job
        waits, will take (their recent arrival rate × service seconds / cards), in [0, MAX_HIGHER_SHARE].
    boundary_overhead: card seconds paid at chunk boundaries per second of work (save + restore / chunk).
    """

    higher_share: float = 0.0
    boundary_overhead: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.higher_share <= MAX_HIGHER_SHARE or self.boundary_overhead < 0:
            raise ValueError(f"a headwind needs 0 <= higher_share <= {MAX_HIGHER_SHARE} and boundary_overhead >= 0")

    def stretch(self) -> float:
        """Wall seconds per second of work ahead, per card."""
        return (1.0 + self.boundary_overhead) / (1.0 - self.higher_share)


# Better classes are never counted as taking more than this share of the cards: at saturation the estimate
# stays finite (× 10) and admission refuses on the long limit instead of dividing by zero.
MAX_HIGHER_SHARE = 0.9
CALM = Headwind()
HIGHER_CLASSES: dict[str, tuple[str, ...]] = {SHORT: (), MEDIUM: (SHORT,), LONG: (SHORT, MEDIUM)}


def headwind(
    recent_seconds: dict[str, float], duration_class: str, window_seconds: float, cards: float, boundary: float = 0.0
) -> Headwind:
    """The headwind of a job of `duration_class`: `recent_seconds` is the work (single-card seconds) of each
    class that arrived in the last `window_seconds`; `cards` the card-equivalents serving the job's queue;
    `boundary` the boundary overhead (checkpoint seconds / chunk seconds)."""
    if window_seconds <= 0 or cards <= 0:
        return Headwind(0.0, boundary)
    arriving = sum(recent_seconds.get(c, 0.0) for c in HIGHER_CLASSES[duration_class])
    return Headwind(min(MAX_HIGHER_SHARE, arriving / window_seconds / cards), boundary)


@dataclass(frozen=True)
class AdmissionLimits:
    """Longest expected wait (seconds) each class accepts before answering 429.

    Higher limits accept more work and let queues (and latency) grow; lower
    ones refuse earlier. Keep long < medium < short in strictness: the long
    class's wait counts all work, so it trips first.
    """

    short: float = 60.0
    medium: float = 300.0
    long: float = 1800.0

    def for_class(self, duration_class: str) -> float:
        return {SHORT: self.short, MEDIUM: self.medium, LONG: self.long}[duration_class]


@dataclass(frozen=True)
class Decision:
    accepted: bool
    expected_wait_seconds: float
    limit_seconds: float
    retry_after_seconds: int = 0
    reason: str = ""


@functools.lru_cache(maxsize=1024)
def _serving(layout: PoolLayout, queue: str) -> Mapping[str, float]:
    """The workers reading `queue`, each with its card-equivalents (a group of k: group_speedup(k)).

    Cached: layouts are frozen, and every estimate asks this of the same few (the simulator, once per
    event, spent half its time here)."""
    return MappingProxyType({w.name: w.speedup for w in layout.workers if queue in w.consumed_queues()})


def work_ahead(queue: str, priority: int, items: Iterable[WorkItem], layout: PoolLayout) -> tuple[float, float]:
    """(single-card seconds of work that runs before a job at `priority` on `queue`, the card-equivalents
    serving it: one per single card, `group_speedup(k)` per group of k)."""
    ahead = _ahead(queue, priority, items, layout)
    return ahead.seconds, ahead.cards


@dataclass(frozen=True)
class _Ahead:
    seconds: float  # single-card seconds that run before the job (work_ahead)
    cards: float  # card-equivalents serving its queue
    queued: float  # of those seconds, the work at its priority or better that waits unstarted
    busy: tuple[tuple[float, float], ...]  # per running job on those cards: (seconds until it frees its card, share)
    # Of `queued`, the jobs whose queue only these cards serve, per (priority, queue): (jobs, seconds). They take
    # a card each, whole (expected_start); the rest of `queued` lands on these cards only in part.
    whole: tuple[tuple[tuple[int, str], int, float], ...] = ()


def _ahead(queue: str, priority: int, items: Iterable[WorkItem], layout: PoolLayout) -> _Ahead:
    mine = _serving(layout, queue)
    if not mine:
        return _Ahead(math.inf, 0.0, 0.0, ())
    shares: dict[str, float] = {}  # per queue: the share of its work that lands on the cards serving us
    total = queued = 0.0
    busy: list[tuple[float, float]] = []
    whole: dict[tuple[int, str], tuple[int, float]] = {}
    for item in items:
        share = shares.get(item.queue)
        if share is None:  # once per queue, not per item (a scan of a deep queue is thousands of items)
            theirs = _serving(layout, item.queue)
            share = sum(theirs[name] for name in mine.keys() & theirs.keys()) / sum(theirs.values()) if theirs else 0.0
            shares[item.queue] = share
        if share == 0:
            continue
        if item.priority <= priority:
            total += item.remaining_seconds * share
            if item.running:
                busy.append((item.remaining_seconds, share))
            else:
                queued += item.remaining_seconds * share
                if share >= 1.0:
                    count, seconds = whole.get((item.priority, item.queue), (0, 0.0))
                    whole[(item.priority, item.queue)] = (count + item.count, seconds + item.remaining_seconds)
        elif item.running:
            # Worse priority, but it holds a card until its chunk boundary.
            until = min(item.chunk_remaining_seconds, item.remaining_seconds)
            total += until * share
            busy.append((until, share))
    return _Ahead(total, sum(mine.values()), queued, tuple(busy), tuple((k, n, sec) for k, (n, sec) in whole.items()))


def _start_level(ahead: _Ahead) -> float:
    """When the job takes a card: the cards free up at their running jobs' times (idle ones now), and the
    waiting work ahead of it fills the earliest-free cards first (water-filling). With nothing waiting that
    is the first card to free up; once the waiting work covers every card's running rest, it is the fluid
    estimate, seconds ahead / cards."""
    held = sum(share for _, share in ahead.busy)
    scale = min(1.0, ahead.cards / held) if held else 1.0  # more running jobs than cards: merged batches
    free = sorted([(until, share * scale) for until, share in ahead.busy] + [(0.0, max(0.0, ahead.cards - held))])
    capacity = filled = 0.0
    for until, cards in free:
        if capacity > 0 and (ahead.queued + filled) / capacity <= until:
            break
        capacity += cards
        filled += cards * until
    return (ahead.queued + filled) / capacity


def expected_wait(
    queue: str, priority: int, items: Iterable[WorkItem], layout: PoolLayout, wind: Headwind = CALM
) -> float:
    """Wall seconds before a new job at `priority` on `queue` starts (`_start_level`: the earliest-free cards
    serving it, after the work that waits at its priority or better), stretched by the headwind (boundaries,
    and the cards' share that better classes will take meanwhile). A group of k cards counts group_speedup(k)."""
    ahead = _ahead(queue, priority, items, layout)
    if ahead.cards == 0:
        return math.inf
    return _start_level(ahead) * wind.stretch()


# Whole jobs ahead are placed one by one (expected_start) up to this many; beyond, the fluid level: placing
# more costs time per ETA, and a job with that many ahead waits long enough that half a job is little of it.
WHOLE_JOBS_AHEAD = 256


def expected_start(
    queue: str, priority: int, items: Iterable[WorkItem], layout: PoolLayout, wind: Headwind = CALM
) -> float:
    """Wall seconds before a new job at `priority` on `queue` takes a card, for its ETA: `expected_wait`, but
    the jobs waiting ahead of it are whole jobs, each taken by the first card to free up (list scheduling), so
    that it starts once the last of them has started, not once their work has drained evenly off every card.

    The fluid level (`expected_wait`) is the safe side for admission, which keeps its word on the limit; for an
    ETA it is late by up to a job ahead's length (seen in bench.replay: videos behind other videos started
    7-10 % before their estimates). Placed one by one: the waiting jobs of the queue's own cards (all of their
    cards serve it) at its priority or better, grouped per (queue, priority), each group's jobs of its mean
    size, in priority order. The work that only partly lands on its cards (a queue shared with other cards),
    and the running jobs' rests there, fill the cards first as the fluid level does. With cards that are
    groups (group_speedup), merged batches holding more cards than there are, or more than WHOLE_JOBS_AHEAD
    whole jobs ahead, it is the fluid level."""
    ahead = _ahead(queue, priority, items, layout)
    if ahead.cards == 0:
        return math.inf
    cards = len(_serving(layout, queue))
    jobs = sum(n for _, n, _ in ahead.whole)
    full_cards = [until for until, share in ahead.busy if share >= 1.0]
    if ahead.cards != cards or len(full_cards) > cards or jobs > WHOLE_JOBS_AHEAD:
        return _start_level(ahead) * wind.stretch()
    # The cards' free times: each running job's on its card, the others now; then the work that only partly
    # lands on them and the running rests that only partly hold them, water-filled from the lowest.
    free = full_cards + [0.0] * (cards - len(full_cards))
    partial = ahead.queued - sum(seconds for _, _, seconds in ahead.whole)
    free = _fill(free, max(0.0, partial) + sum(until * share for until, share in ahead.busy if share < 1.0))
    for _, count, seconds in sorted(ahead.whole):  # priority order (then the queue's name: fixed among equals)
        for _ in range(count):
            heapq.heappush(free, heapq.heappop(free) + seconds / count)
    return free[0] * wind.stretch()


def _fill(levels: list[float], work: float) -> list[float]:
    """Sorted card free times after `work` seconds are poured onto the lowest (water-filling)."""
    levels = sorted(levels)
    for k in range(1, len(levels) + 1):
        top = levels[k] if k < len(levels) else math.inf
        room = top * k - sum(levels[:k])
        if work <= room:
            level = (sum(levels[:k]) + work) / k
            return sorted([level] * k + levels[k:])
    return levels


def decide(
    queue: str,
    priority: int,
    items: Iterable[WorkItem],
    layout: PoolLayout,
    limits: AdmissionLimits,
    wind: Headwind = CALM,
) -> Decision:
    """Accept or refuse a new job for `queue` (its class, or "class.model") at `priority`."""
    duration_class = class_of(queue)
    if duration_class not in CLASSES:
        raise ValueError(f"unknown duration class {duration_class!r}")
    wait = expected_wait(queue, priority, items, layout, wind)
    limit = limits.for_class(duration_class)
    if wait <= limit:
        return Decision(True, wait, limit)
    if math.isinf(wait):
        return Decision(
            False,
            wait,
            limit,
            retry_after_seconds=60,
            reason=f"no worker serves the {queue!r} queue; check the pool layout",
        )
    retry = max(1, math.ceil(wait - limit))
    return Decision(
        False,
        wait,
        limit,
        retry_after_seconds=retry,
        reason=(
            f"the {duration_class} class is overloaded: expected wait {wait:.0f} s exceeds its "
            f"{limit:.0f} s limit; retry after {retry} s or submit a shorter job"
        ),
    )
