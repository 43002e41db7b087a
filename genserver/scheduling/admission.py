"""Admission: refuse work whose expected wait exceeds its class's limit.

The expected wait of a job is the work that will run before it (everything
queued or running at its priority or better, on the cards that can serve it)
divided by the number of those cards, a group of k cards counting as
`group_speedup(k)` cards (it runs one job that many times faster). Because short work has the best
priorities, a short job only waits for short work while a long job waits for
everything: under overload the long class crosses its limit first, so video
is refused while images are still accepted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

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


def _serving(layout: PoolLayout, queue: str) -> dict[str, float]:
    """The workers reading `queue`, each with its card-equivalents (a group of k: group_speedup(k))."""
    return {w.name: w.speedup for w in layout.workers if queue in w.consumed_queues()}


def work_ahead(queue: str, priority: int, items: Iterable[WorkItem], layout: PoolLayout) -> tuple[float, float]:
    """(single-card seconds of work that runs before a job at `priority` on `queue`, the card-equivalents
    serving it: one per single card, `group_speedup(k)` per group of k)."""
    mine = _serving(layout, queue)
    if not mine:
        return math.inf, 0.0
    serving_cache: dict[str, dict[str, float]] = {}
    total = 0.0
    for item in items:
        theirs = serving_cache.setdefault(item.queue, _serving(layout, item.queue))
        if not theirs:
            continue
        # The share of that item's work that lands on the cards serving us (by capacity).
        share = sum(theirs[name] for name in mine.keys() & theirs.keys()) / sum(theirs.values())
        if share == 0:
            continue
        if item.priority <= priority:
            total += item.remaining_seconds * share
        elif item.running:
            # Worse priority, but it holds a card until its chunk boundary.
            total += min(item.chunk_remaining_seconds, item.remaining_seconds) * share
    return total, sum(mine.values())


def expected_wait(queue: str, priority: int, items: Iterable[WorkItem], layout: PoolLayout) -> float:
    """Wall seconds before a new job at `priority` on `queue` starts: the single-card seconds ahead
    of it divided by the card-equivalents serving it (a group of k counts group_speedup(k))."""
    ahead, cards = work_ahead(queue, priority, items, layout)
    return math.inf if cards == 0 else ahead / cards


def decide(
    queue: str, priority: int, items: Iterable[WorkItem], layout: PoolLayout, limits: AdmissionLimits
) -> Decision:
    """Accept or refuse a new job for `queue` (its class, or "class.model") at `priority`."""
    duration_class = class_of(queue)
    if duration_class not in CLASSES:
        raise ValueError(f"unknown duration class {duration_class!r}")
    wait = expected_wait(queue, priority, items, layout)
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
