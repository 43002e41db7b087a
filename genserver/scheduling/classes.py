"""Duration classes and Redis priority bands.

kombu's Redis transport pops priority-major across every queue a worker
consumes (all queues' priority-0 lists before any priority-1 list), lowest
number first. So the class is encoded in the priority number as well as in the
queue name: a worker that consumes `short` and `long` always takes a waiting
short chunk before any long chunk, at every chunk boundary.

Bands (0 is served first):

    0-3  short   shortest expected remaining time first
    4    medium  continuation chunks of started jobs
    5    medium  new jobs
    6    long    continuation chunks (a started video finishes)
    7-8  long    new jobs, shorter first
    9    default for anything unprioritised (maintenance) — never ahead of work
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SHORT, MEDIUM, LONG = "short", "medium", "long"
CLASSES: tuple[str, ...] = (SHORT, MEDIUM, LONG)
PRIORITY_STEPS: list[int] = list(range(10))
DEFAULT_PRIORITY = 9


@dataclass(frozen=True)
class ClassThresholds:
    """Upper bounds on expected seconds: below `short` → short, below `medium` → medium.

    Lower thresholds put more work in the slower classes (images wait behind
    less but a mid-size image may be treated as long); higher ones let bigger
    jobs share the fast lane and delay the small ones behind them.
    """

    short: float = 15.0
    medium: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.short < self.medium:
            raise ValueError(f"class thresholds must satisfy 0 < short < medium, got {self.short}, {self.medium}")

    def classify(self, seconds: float) -> str:
        if seconds < self.short:
            return SHORT
        if seconds < self.medium:
            return MEDIUM
        return LONG


def _log_bucket(seconds: float, low: float, high: float, buckets: int) -> int:
    """Map seconds in [low, high) onto 0..buckets-1 on a log scale."""
    if buckets <= 1 or seconds <= low:
        return 0
    if seconds >= high:
        return buckets - 1
    position = math.log(seconds / low) / math.log(high / low)
    return min(buckets - 1, int(position * buckets))


def priority_for(duration_class: str, remaining_seconds: float, started: bool, thresholds: ClassThresholds) -> int:
    """Redis priority (0 first) of a job's next message.

    `remaining_seconds` is the expected work left (the whole job for a new one);
    `started` means at least one denoise chunk has run.
    """
    if duration_class == SHORT:
        # 4 buckets between 0.25 s and the class threshold: sub-second drafts first.
        return _log_bucket(remaining_seconds, 0.25, thresholds.short, 4)
    if duration_class == MEDIUM:
        return 4 if started else 5
    if duration_class == LONG:
        if started:
            return 6
        return 7 + _log_bucket(remaining_seconds, thresholds.medium, thresholds.medium * 20, 2)
    raise ValueError(f"unknown duration class {duration_class!r}; known: {CLASSES}")


def yields_to_equal_priority(duration_class: str) -> bool:
    """Whether a started job at a chunk boundary yields its card to a message waiting at its own
    continuation's priority (first come, first served among equals), or only to better priorities.

    In the short band new jobs share the continuations' priorities (by expected remaining time), so a new
    image waiting there goes first. In the medium and long bands a continuation's priority is the started
    jobs' own (4, 6): what waits there is another started job's continuation, and swapping two started jobs
    gains neither anything while each swap pays a checkpoint restore, and cascades: the card that takes
    the waiting job leaves its own waiting, which the next card at a boundary takes in turn.
    """
    if duration_class not in CLASSES:
        raise ValueError(f"unknown duration class {duration_class!r}; known: {CLASSES}")
    return duration_class == SHORT


BANDS: dict[str, tuple[int, int]] = {SHORT: (0, 3), MEDIUM: (4, 5), LONG: (6, 8)}


def band_bounds(duration_class: str) -> tuple[int, int]:
    """The priorities (first, last) a job of the class may take: staff re-prioritise within them, never into
    another class's band (9 is kept for unprioritised maintenance)."""
    try:
        return BANDS[duration_class]
    except KeyError:
        raise ValueError(f"unknown duration class {duration_class!r}; known: {CLASSES}") from None


def band_of(priority: int) -> str:
    """The class a priority number belongs to (for reporting)."""
    if priority <= 3:
        return SHORT
    if priority <= 5:
        return MEDIUM
    return LONG
