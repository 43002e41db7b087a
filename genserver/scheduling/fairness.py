"""Fair share between users inside a class: the per-user publish window, and which held job goes next.

kombu pops each (queue, priority) Redis list first-in first-out, so a user who
submits 300 images at once would put everybody else's image behind all 300.
The service therefore keeps at most `window` of a user's jobs *published but
not yet started* per denoise queue (published: its encode or first denoise
message is in the broker; started: a card claimed its first chunk). A submit
beyond the window is recorded but *held* (no message). When one of the user's
window jobs starts, or ends without starting, the user's best held job of that
queue is published (`release_key`: lowest priority number, then oldest). Another
user's job is therefore published behind at most `window` messages of each
other user at its priority; a held job is published at its own priority, so
shortest-first between bands still holds.

Who is held: every user beyond the window except the lightest, a user with
fewer unstarted jobs in the queue than every other user waiting there (alone,
a user is held beyond the window). The lightest user's jobs are published at
once, however many of them wait: holding them too would share the cards job for job with the burst,
which is less than a user of small jobs needs when the burst's jobs are
bigger (B's 2-s images against A's 2-6-s ones get 35 % of the cards that
way, and B asks for 50 %). Two bursts of equal size are both held, and
served alternately.

Who goes ahead: the lightest user's new job is published one priority step
better than its own, within its class's band (`ahead_priority`). FIFO inside a
(queue, priority) list would otherwise put it behind the heavier users'
window messages and behind their started jobs' continuations at the same
priority, so it would wait for two or three chunk ends instead of the first
(B's wait P99 3.3× alone against 1.9× with the step). Then, if it still waits
`CUT_AFTER_SECONDS` for a card, it ends one card's chunk of a heavier user at
that chunk's next step (one card per waiting job), so that it does not wait for a
whole chunk of the burst's (1.55× with the cut). The step never leaves
the band, so a class never jumps another; inside the short band it can pass a
slightly shorter image of a heavier user, which is what fair share means.

The live job service (genserver/jobs/services/fairness.py) and the simulator
(simulator/engine.py) both decide with this module. Plain Python, no Django.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from .classes import band_bounds

# One published-but-unstarted job per user and queue: measured in bench/fairness.py (docs/BENCHMARKS.md,
# "Fair share"): another user's image waits behind at most one of a burst's messages (B's latency P99
# 1.9× alone in the simulator, 2.4× with a window of 2), and the burst still keeps every card fed (the
# claim that starts one of its jobs releases the next).
DEFAULT_FAIR_WINDOW = 1

# A job published ahead that has waited this long (seconds of card time) for a card cuts one other user's
# running chunk at its next step. Sooner: its wait is shorter, but more chunks are cut, each costing the burst
# a checkpoint save and restore; later: the cards' planned chunk ends take most of them. Measured in
# bench/fairness.py (docs/BENCHMARKS.md, "Fair share"): at 1 s, B's wait P99 1.55× alone and A's drain 566 s;
# cutting at once, 1.38× and 598 s; never, 1.91× and 565 s.
CUT_AFTER_SECONDS = 1.0

T = TypeVar("T")


@dataclass(frozen=True)
class FairWindow:
    """At most `size` of a user's jobs published and not yet started per queue (0: off, first-come)."""

    size: int = DEFAULT_FAIR_WINDOW

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"the fair window must be >= 0 (0: off), got {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def holds(self, in_window: int, waiting: int, others_waiting: Iterable[int] = ()) -> bool:
        """Whether a new job is held: its user has `in_window` jobs published and unstarted in its queue,
        `waiting` unstarted there in all (held ones included), and the other users with unstarted jobs in
        the queue have `others_waiting` each. Held once the window is full, unless every other user has
        more waiting: the lightest user is never held behind heavier ones' bursts (which would share the
        cards job for job between them, too little for a user of small jobs)."""
        if not self.enabled or in_window < self.size:
            return False
        fewest = min(others_waiting, default=None)
        return fewest is None or waiting >= fewest

    def goes_ahead(self, waiting: int, others_waiting: Iterable[int] = ()) -> bool:
        """Whether a new job that is not held is published one step ahead (`ahead_priority`): its user has
        fewer unstarted jobs in its queue (`waiting`, before this one) than every other user waiting there
        (`others_waiting`, each > 0). Alone, or with the window off, nobody goes ahead."""
        fewest = min(others_waiting, default=None)
        return self.enabled and fewest is not None and waiting < fewest

    def room(self, in_window: int) -> int | float:
        """How many held jobs may be published now for a user with `in_window` in the window (inf: off)."""
        return max(0, self.size - in_window) if self.enabled else math.inf


def ahead_priority(priority: int, duration_class: str) -> int:
    """One priority step better than `priority`, never out of the class's band (0 is served first)."""
    return max(band_bounds(duration_class)[0], priority - 1)


def release_key(priority: int, created: Any) -> tuple[int, Any]:
    """The order held jobs leave a user's hold in: lowest priority number (shortest) first, then oldest."""
    return (priority, created)


def next_held(held: Iterable[T], key: Callable[[T], tuple[int, Any]]) -> T | None:
    """The held job to publish next among one user's held jobs of one queue (`key`: its `release_key`)."""
    return min(held, key=key, default=None)


def held_jobs_ahead(own_ahead: int, users_waiting: int) -> int:
    """About how many jobs will start before a held job, beyond the published ones ahead of it.

    Round-robin: each of the owner's `own_ahead` held jobs released before it is matched by about
    one job of every other user waiting in the queue (`users_waiting`, the owner included), and the
    job itself waits one more round for the others.
    """
    others = max(0, users_waiting - 1)
    return own_ahead + (own_ahead + 1) * others
