"""The overload cap: under a long backlog, at most N−1 cards run long work, so short work always finds a card.

Every card takes video while the long class is calm (the simulator's best
layout). When a new long job's expected wait passes `engage_share` of the long
admission limit, the cap engages: at most `cap(n)` = n − 1 of the n cards that
serve the long class run long chunks at once, and admission, queue positions
and ETAs count the long class on those cards only (`capped_layout`). It lets
go when the wait falls below `release_share` of the limit (hysteresis: a wait
hovering at the threshold does not flip it at every tick). The simulator and
the live service (genserver/jobs/services/overload.py) run this same rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .classes import LONG
from .pools import PoolLayout, WorkerSpec, class_of


@dataclass(frozen=True)
class LongCapPolicy:
    """When the cap engages and lets go, as shares of the long class's admission limit.

    A lower `engage_share` protects images earlier in a video backlog and slows
    videos sooner; the gap to `release_share` trades how quickly the cap lets go
    against how often it flips.
    """

    engage_share: float = 0.5
    release_share: float = 0.4

    def __post_init__(self) -> None:
        if not 0 < self.release_share <= self.engage_share:
            raise ValueError(
                f"the long cap needs 0 < release_share <= engage_share, got {self.release_share}, {self.engage_share}"
            )

    def engaged(self, was_engaged: bool, long_wait: float, long_limit: float) -> bool:
        """Whether the cap holds now, given whether it held before and a new long job's expected wait."""
        threshold = (self.release_share if was_engaged else self.engage_share) * long_limit
        return long_wait > threshold

    @staticmethod
    def cap(long_cards: int) -> int:
        """How many cards may run long work while engaged: all but one (one card at least)."""
        return max(1, long_cards - 1)


def long_cards(layout: PoolLayout) -> int:
    """The denoise workers that take long work (a card group counts as one: it runs one job)."""
    return sum(1 for w in layout.workers if w.denoises and any(class_of(q) == LONG for q in w.consumed_queues()))


def capped_layout(layout: PoolLayout, cap: int) -> PoolLayout:
    """The layout as the long class sees it while the cap holds: long-serving workers beyond the first
    `cap` no longer read long queues. Cards that also take other work give long up first (they still have
    something to do); one that reads long alone keeps it while the cap allows, else sits the cap out."""

    def takes_long(worker: WorkerSpec) -> bool:
        return worker.denoises and any(class_of(q) == LONG for q in worker.consumed_queues())

    def others(worker: WorkerSpec) -> tuple[str, ...]:
        return tuple(q for q in worker.queues if class_of(q) != LONG)

    excess = long_cards(layout) - cap
    giving_up = sorted((w for w in layout.workers if takes_long(w)), key=lambda w: not others(w))[: max(0, excess)]
    names = {w.name for w in giving_up}
    workers = []
    for worker in layout.workers:
        if worker.name not in names:
            workers.append(worker)
        elif others(worker):
            workers.append(replace(worker, queues=others(worker)))
    return PoolLayout(tuple(workers), complete=layout.complete)
