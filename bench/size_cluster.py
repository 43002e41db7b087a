"""Size a cluster: the fewest cards (and their split into pools and groups) that meet the P99 targets.

    python -m bench.size_cluster --rate 0.06 --image-p99 5 --video-p99 600
    python -m bench.size_cluster --rate 0.12 --image-p99 5 --video-p99 600 --mix image=0.7,video=0.3

Runs the event-driven model of the service (genserver.scheduling.simulator:
`simulate`, the scheduling core the service itself uses) on the seed
chapter's workload (Poisson arrivals at --rate; images of 2/3/6 s, videos of
120/300 s; --mix changes the share of each) for 1, 2, 3, ... cards and, for
each count, these splits of the cards:

* `policy`: the production policy (`service_policy_config(N)`: every card takes
  every class, at most N−1 on video under overload);
* `pools i+j`: i cards for images only, j for images and video (`mixed_layout`);
* `group k + singles`: one card group of k (sequence parallelism, a video runs
  `group_speedup(k)` times faster) beside single cards, every worker taking
  every class.

Every request is admitted (admission limits off: sizing serves the offered
load, it does not refuse it). A count whose offered work reaches its cards
(load ≥ 1) cannot be stable and is not simulated. The answer is the first
count where some split meets both P99s of the chosen metric (`wait`: arrival
to first step, the seed's metric; `latency`: arrival to finished denoising).
The table printed is every row searched.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from genserver.scheduling.pools import GROUP_EFFICIENCY
from genserver.scheduling.simulator import (
    IMAGE,
    IMAGE_SECONDS,
    VIDEO,
    VIDEO_SECONDS,
    Request,
    SimConfig,
    mixed_layout,
    pct,
    seed_workload,
    service_policy_config,
    simulate,
)
from genserver.scheduling.simulator.groups import group_layout

SEED_IMAGE_SHARE = 0.8


@dataclass(frozen=True)
class Row:
    cards: int
    split: str
    image_p99: float | None  # None: not simulated (the cards cannot carry the offered work)
    video_p99: float | None
    utilization: float | None
    meets: bool


def parse_mix(text: str) -> float:
    """`image=0.7,video=0.3` → the image share (0.7); the shares must add up to 1."""
    shares = {}
    for part in text.split(","):
        kind, _, value = part.partition("=")
        if kind.strip() not in (IMAGE, VIDEO) or not value:
            raise argparse.ArgumentTypeError(f"--mix takes image=SHARE,video=SHARE, got {text!r}")
        shares[kind.strip()] = float(value)
    image = shares.get(IMAGE, 1.0 - shares.get(VIDEO, 0.0))
    video = shares.get(VIDEO, 1.0 - image)
    if not (0.0 <= image <= 1.0 and abs(image + video - 1.0) < 1e-9):
        raise argparse.ArgumentTypeError(f"--mix shares must be within 0..1 and add up to 1, got {text!r}")
    return image


def workload(rate: float, image_share: float, arrivals: int, seed: int) -> list[Request]:
    """The seed's generator; with another image share, the same draws with that share."""
    if image_share == SEED_IMAGE_SHARE:
        return seed_workload(arrivals, rate, seed)
    rng = random.Random(seed)
    t, requests = 0.0, []
    for _ in range(arrivals):
        t += rng.expovariate(rate)
        if rng.random() < image_share:
            requests.append(Request(t, IMAGE, rng.choice(list(IMAGE_SECONDS))))
        else:
            requests.append(Request(t, VIDEO, rng.choice(list(VIDEO_SECONDS))))
    return requests


def offered_cards(rate: float, image_share: float) -> float:
    """Card-seconds of work offered per second: the cards that would be busy all the time."""
    mean_image = sum(IMAGE_SECONDS) / len(IMAGE_SECONDS)
    mean_video = sum(VIDEO_SECONDS) / len(VIDEO_SECONDS)
    return rate * (image_share * mean_image + (1 - image_share) * mean_video)


def splits(cards: int) -> list[tuple[str, Callable[[], SimConfig]]]:
    """The splits of `cards` tried: the production policy, static pools, one group beside singles."""
    options: list[tuple[str, Callable[[], SimConfig]]] = [("policy", lambda: service_policy_config(cards, limits=None))]
    for image_only in range(1, cards):
        options.append(
            (
                f"pools {image_only} image + {cards - image_only} all",
                lambda i=image_only: SimConfig(layout=mixed_layout(cards, i), limits=None),
            )
        )
    for k in sorted(GROUP_EFFICIENCY):
        if 1 < k < cards:
            options.append(
                (
                    f"group {k} + {cards - k} single",
                    lambda k=k: SimConfig(layout=group_layout([k] + [1] * (cards - k)), limits=None),
                )
            )
    return options


def size_cluster(
    rate: float,
    image_p99: float,
    video_p99: float,
    *,
    image_share: float = SEED_IMAGE_SHARE,
    metric: str = "wait",
    arrivals: int = 400,
    seed: int = 0,
    max_cards: int = 32,
    on_row: Callable[[Row], None] = lambda row: None,
) -> tuple[Row | None, list[Row]]:
    """(the first row meeting both targets, every row searched), cards counted up from 1."""
    requests = workload(rate, image_share, arrivals, seed)
    offered = offered_cards(rate, image_share)
    rows: list[Row] = []
    for cards in range(1, max_cards + 1):
        if offered >= cards:
            rows.append(Row(cards, f"(offered load {offered / cards:.2f} ≥ 1)", None, None, None, False))
            on_row(rows[-1])
            continue
        met: list[Row] = []
        for name, config in splits(cards):
            result = simulate(requests, config())
            p99 = {
                kind: (pct(c.waits if metric == "wait" else c.latencies, 0.99) if c.waits else 0.0)
                for kind, c in result.classes.items()
            }
            row = Row(
                cards,
                name,
                p99.get(IMAGE, 0.0),
                p99.get(VIDEO, 0.0),
                result.utilization,
                p99.get(IMAGE, 0.0) <= image_p99 and p99.get(VIDEO, 0.0) <= video_p99,
            )
            rows.append(row)
            on_row(row)
            if row.meets:
                met.append(row)
        if met:
            return min(met, key=lambda r: (r.image_p99 or 0) / image_p99 + (r.video_p99 or 0) / video_p99), rows
    return None, rows


def _cell(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def print_row(row: Row) -> None:
    print(
        f"| {row.cards} | {row.split} | {_cell(row.image_p99)} | {_cell(row.video_p99)} | "
        f"{_cell(row.utilization, 2)} | {'yes' if row.meets else ''} |",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, required=True, help="arrivals per second")
    parser.add_argument("--image-p99", type=float, required=True, help="images' P99 target, seconds")
    parser.add_argument("--video-p99", type=float, required=True, help="videos' P99 target, seconds")
    parser.add_argument(
        "--mix",
        type=parse_mix,
        default=SEED_IMAGE_SHARE,
        help="image=SHARE,video=SHARE (default the seed's image=0.8,video=0.2)",
    )
    parser.add_argument(
        "--metric",
        choices=("wait", "latency"),
        default="wait",
        help="wait: arrival → first step (the seed's); latency: arrival → denoised",
    )
    parser.add_argument("--arrivals", type=int, default=400, help="requests simulated (the seed's 400)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-cards", type=int, default=32)
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.arrivals < 1:
        parser.error("--rate must be positive and --arrivals at least 1")
    print(
        f"rate {args.rate}/s, image share {args.mix:.2f}, {args.arrivals} arrivals (seed {args.seed}); "
        f"targets: {args.metric} P99 images ≤ {args.image_p99} s, videos ≤ {args.video_p99} s\n"
    )
    print(f"| cards | split | image P99 {args.metric} (s) | video P99 {args.metric} (s) | utilization | meets |")
    print("| ---: | --- | ---: | ---: | ---: | --- |")
    best, _ = size_cluster(
        args.rate,
        args.image_p99,
        args.video_p99,
        image_share=args.mix,
        metric=args.metric,
        arrivals=args.arrivals,
        seed=args.seed,
        max_cards=args.max_cards,
        on_row=print_row,
    )
    if best is None:
        print(f"\nno split of up to {args.max_cards} cards meets the targets")
        return 1
    print(
        f"\nanswer: {best.cards} cards, split: {best.split} "
        f"(image P99 {best.image_p99:.1f} s, video P99 {best.video_p99:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
