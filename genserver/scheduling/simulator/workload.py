"""The seed chapter's workload: its requests, its generator draw for draw, its percentile."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

IMAGE, VIDEO = "image", "video"
KINDS: tuple[str, ...] = (IMAGE, VIDEO)

# The seed's durations, and the steps we give them: an image is 20-30 steps
# (0.1-0.2 s each, one chunk at the default chunk length or two for a 6-s one),
# a video 50 steps (2.4 s or 6 s each).
IMAGE_SECONDS: tuple[float, ...] = (2.0, 3.0, 6.0)
VIDEO_SECONDS: tuple[float, ...] = (120.0, 300.0)
DEFAULT_STEPS: Mapping[float, int] = {2.0: 20, 3.0: 30, 6.0: 30, 120.0: 50, 300.0: 50}
DEFAULT_MODELS: Mapping[str, str] = {IMAGE: "sdxl", VIDEO: "wan"}


@dataclass(frozen=True)
class Request:
    """One arrival of the seed's workload."""

    arrival: float
    kind: str  # IMAGE | VIDEO
    seconds: float  # expected (in the simulation also actual) denoising seconds
    lane: str = ""  # the lane it was submitted with ("interactive"), routed like the service does
    user: str = ""  # who submitted it: the fair window (scheduling/fairness.py) is per user and queue


def seed_workload(arrivals: int = 400, rate: float = 0.06, seed: int = 0) -> list[Request]:
    """The seed chapter's generator, draw for draw.

    Poisson arrivals at `rate` per second; 80 % images of 2, 3 or 6 s, 20 %
    videos of 120 or 300 s. The same `seed` gives the chapter's requests.
    """
    rng = random.Random(seed)
    t = 0.0
    requests: list[Request] = []
    for _ in range(arrivals):
        t += rng.expovariate(rate)
        if rng.random() < 0.8:
            requests.append(Request(t, IMAGE, rng.choice(list(IMAGE_SECONDS))))
        else:
            requests.append(Request(t, VIDEO, rng.choice(list(VIDEO_SECONDS))))
    return requests


def offered_load(rate: float, n_cards: int = 4) -> float:
    """Expected work offered per second by the seed's mix at `rate`, as a share of `n_cards`."""
    mean_seconds = 0.8 * sum(IMAGE_SECONDS) / len(IMAGE_SECONDS) + 0.2 * sum(VIDEO_SECONDS) / len(VIDEO_SECONDS)
    return rate * mean_seconds / n_cards


def pct(xs: Iterable[float], q: float) -> float:
    """The seed's percentile: element int(q·n) of the sorted values (0 if there are none)."""
    values = sorted(xs)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0
