"""Fair share between users (issue 17, item 1): user A's burst of 300 images at once, user B one image a second.

    .venv/bin/python -m bench.fairness            # the simulator's table (Markdown) on stdout
    .venv/bin/python -m bench.fairness --seeds 20 # and the ratios over 20 workloads
    .venv/bin/python -m bench.fairness --live     # and the same two users on the live stack

B's image wait (arrival → first denoising step) and latency (arrival → done)
P50/P99 alone, with A's burst first-come (GENSERVER_FAIR_WINDOW=0), and with
A's burst under the fair window; A's drain time (its first arrival → its last
job done) alone and with B. The layout is the seed's 4 cards, every card
taking every class (`service_policy_config(4)`, with the denoise task's yield on
demand and synchronous checkpoint), admission limits lifted (A's
burst is 1,100 card-seconds: the short class's 60-s limit would refuse most
of it, which is not what is measured here). B's images are the seed's 2-s
image (one a second, Poisson: half of the 4 cards), so that B alone already
waits a little; A's are the seed's 2/3/6-s images drawn at random.

A's drain with B cannot equal A's drain alone under any order that serves B:
B's half of the cards is work that A waits for. "At full speed" is read as
work-conserving: no card idles while A has work, i.e. A's drain with B is
(A's work + B's work done meanwhile) / cards; the table prints that bound.
"""

from __future__ import annotations

import argparse
import importlib
import random
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from genserver.scheduling.fairness import DEFAULT_FAIR_WINDOW
from genserver.scheduling.simulator import (
    IMAGE,
    IMAGE_SECONDS,
    Request,
    SimResult,
    pct,
    service_policy_config,
    simulate,
)

CARDS = 4
BURST = 300  # A's images, all at once
BURST_AT = 60.0  # seconds after B starts
B_RATE = 1.0  # B's images per second
B_SECONDS = 2.0  # the seed's 2-s image
B_DURATION = 900.0  # seconds of B's arrivals (past A's drain under every policy)
SEED = 0
# The denoise task as it runs (tasks/denoise.py): at a chunk boundary it yields only to a message it would take
# first, and it writes the checkpoint synchronously at every boundary (in_process_seconds=None); the lightest
# user's waiting job cuts one card's chunk at its next step (cut_chunks, on in service_policy_config).
AS_THE_SERVICE_RUNS = dict(yield_on_demand=True, in_process_seconds=None)


def user_a(n: int | None = None, at: float | None = None, seed: int = SEED) -> list[Request]:
    """A's burst: `n` (BURST) of the seed's images (2, 3 or 6 s) at the same instant `at` (BURST_AT)."""
    n, at = BURST if n is None else n, BURST_AT if at is None else at
    rng = random.Random(seed)
    return [Request(at, IMAGE, rng.choice(list(IMAGE_SECONDS)), user="A") for _ in range(n)]


def user_b(
    rate: float = B_RATE, duration: float | None = None, seconds: float = B_SECONDS, seed: int = SEED
) -> list[Request]:
    """B's images: Poisson arrivals at `rate` per second for `duration` (B_DURATION) seconds."""
    duration = B_DURATION if duration is None else duration
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(Request(t, IMAGE, seconds, user="B"))


def merged(*parts: Sequence[Request]) -> list[Request]:
    return sorted((r for part in parts for r in part), key=lambda r: r.arrival)


@dataclass(frozen=True)
class Row:
    """One scenario's figures (seconds)."""

    name: str
    b_wait: tuple[float, float] | None  # P50, P99
    b_latency: tuple[float, float] | None
    a_drain: float | None
    bound: float | None = None  # A's drain if no card idles while A waits (work-conserving)


def _user(result: SimResult, user: str) -> tuple[list[float], list[float], list[float]]:
    part = result.users.get(user)
    return (part.waits, part.latencies, part.ends) if part is not None else ([], [], [])


def b_figures(waits: Sequence[float], latencies: Sequence[float]) -> tuple[tuple[float, float], tuple[float, float]]:
    return (pct(waits, 0.5), pct(waits, 0.99)), (pct(latencies, 0.5), pct(latencies, 0.99))


def drain_bound(a: Sequence[Request], b: Sequence[Request], drain: float, cards: int = CARDS) -> float:
    """A's drain if the cards never idle while A waits and B's work that arrived meanwhile is served first."""
    start = min(r.arrival for r in a)
    a_work = sum(r.seconds for r in a)
    b_work = sum(r.seconds for r in b if start <= r.arrival < start + drain)
    return (a_work + b_work) / cards


def simulate_scenarios(window: int = DEFAULT_FAIR_WINDOW, seed: int = SEED) -> dict[str, Row]:
    """B alone, A alone, A+B first-come (window 0), A+B fair (`window`), in the simulator."""
    a, b = user_a(seed=seed), user_b(seed=seed)
    rows: dict[str, Row] = {}

    def run(requests: Sequence[Request], fair: int) -> SimResult:
        return simulate(requests, service_policy_config(CARDS, limits=None, fair_window=fair, **AS_THE_SERVICE_RUNS))

    alone_b = run(b, window)
    bw, bl, _ = _user(alone_b, "B")
    rows["B alone"] = Row("B alone", *b_figures(bw, bl), None)
    alone_a = run(a, window)
    _, _, ends = _user(alone_a, "A")
    rows["A alone"] = Row("A alone", None, None, max(ends) - BURST_AT, sum(r.seconds for r in a) / CARDS)
    assert a[0].arrival == BURST_AT
    for name, fair in (("A + B, first-come (window 0)", 0), (f"A + B, fair (window {window})", window)):
        res = run(merged(a, b), fair)
        bw, bl, _ = _user(res, "B")
        _, _, ends = _user(res, "A")
        drain = max(ends) - BURST_AT
        rows[name] = Row(name, *b_figures(bw, bl), drain, drain_bound(a, b, drain))
    return rows


def table(rows: dict[str, Row], title: str) -> str:
    def pair(p: tuple[float, float] | None) -> str:
        return "–" if p is None else f"{p[0]:.1f} / {p[1]:.1f}"

    def one(x: float | None) -> str:
        return "–" if x is None else f"{x:.0f}"

    lines = [
        f"#### {title}",
        "",
        "| scenario | B wait P50 / P99 (s) | B latency P50 / P99 (s) | A's drain (s) | A's drain, no idle card (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows.values():
        cells = (row.name, pair(row.b_wait), pair(row.b_latency), one(row.a_drain), one(row.bound))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(rows: dict[str, Row], window: int) -> str:
    alone = rows["B alone"]
    fair = rows[f"A + B, fair (window {window})"]
    fcfs = rows["A + B, first-come (window 0)"]
    assert alone.b_wait and fair.b_wait and fcfs.b_wait and alone.b_latency and fair.b_latency and fcfs.b_latency
    assert fair.a_drain and fair.bound
    return (
        f"B's wait P99: alone {alone.b_wait[1]:.1f} s, fair {fair.b_wait[1]:.1f} s "
        f"({fair.b_wait[1] / max(alone.b_wait[1], 1e-9):.2f}×), first-come {fcfs.b_wait[1]:.1f} s "
        f"({fcfs.b_wait[1] / max(alone.b_wait[1], 1e-9):.1f}×); latency P99 fair "
        f"{fair.b_latency[1] / alone.b_latency[1]:.2f}× alone, "
        f"first-come {fcfs.b_latency[1] / alone.b_latency[1]:.1f}×. "
        f"A's drain with B, fair: {fair.a_drain:.0f} s against {fair.bound:.0f} s with no idle card "
        f"({fair.a_drain / fair.bound:.3f}×)."
    )


def over_seeds(window: int, seeds: int) -> str:
    """B's wait and latency P99 against alone on `seeds` workloads (seeds 0..seeds-1): the worst ratio, and
    how many meet the 2× target."""
    waits, latencies = [], []
    for seed in range(seeds):
        rows = simulate_scenarios(window, seed)
        alone, fair = rows["B alone"], rows[f"A + B, fair (window {window})"]
        assert alone.b_wait and fair.b_wait and alone.b_latency and fair.b_latency
        waits.append(fair.b_wait[1] / alone.b_wait[1])
        latencies.append(fair.b_latency[1] / alone.b_latency[1])
    met = sum(1 for w in waits if w <= 2.0), sum(1 for x in latencies if x <= 2.0)
    return (
        f"Over {seeds} workloads (window {window}): B's wait P99 / alone worst {max(waits):.2f}×, within 2× in "
        f"{met[0]} of {seeds}; latency P99 / alone worst {max(latencies):.2f}×, within 2× in {met[1]} of {seeds}."
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=DEFAULT_FAIR_WINDOW, help="the fair window measured")
    parser.add_argument("--windows", default="", help="also sweep these windows in the simulator, e.g. 1,2,4,8")
    parser.add_argument("--seeds", type=int, default=0, help="also the ratios over this many workloads")
    parser.add_argument("--live", action="store_true", help="also run the two users on the live stack")
    parser.add_argument("--boots", default="fair,fcfs", help="live: which boots to run (fair, fcfs)")
    parser.add_argument("--scale", type=float, default=0.1, help="live: GENSERVER_TIME_SCALE")
    parser.add_argument("--burst", type=int, default=BURST, help="A's images at once")
    parser.add_argument("--burst-at", type=float, default=BURST_AT, help="when A's burst arrives (s)")
    parser.add_argument("--b-duration", type=float, default=B_DURATION, help="seconds of B's arrivals")
    args = parser.parse_args(argv)
    # This module, and the same one imported by name (`python -m` runs it as __main__, bench.fairness_live
    # imports bench.fairness): both read the scenario's sizes.
    for this in {sys.modules[__name__], importlib.import_module("bench.fairness")}:
        this.BURST, this.BURST_AT, this.B_DURATION = args.burst, args.burst_at, args.b_duration  # type: ignore[attr-defined]
    rows = simulate_scenarios(args.window)
    print(table(rows, f"Simulator: {CARDS} cards, A {BURST} images at once, B one 2-s image a second"), flush=True)
    print()
    print(verdict(rows, args.window))
    for w in [int(x) for x in args.windows.split(",") if x]:
        print()
        print(verdict(simulate_scenarios(w), w).replace("fair", f"window {w}", 1))
    if args.seeds:
        print()
        print(over_seeds(args.window, args.seeds))
    boots = tuple(b for b in args.boots.split(",") if b)
    if args.live and len(boots) > 1:
        # One process reads one stack's database and broker (Django's settings and the Redis client are set up
        # once), so each boot runs in a process of its own, with the same sizes.
        sizes = ["--burst", str(args.burst), "--burst-at", str(args.burst_at), "--b-duration", str(args.b_duration)]
        for boot in boots:
            argv = ["--live", "--boots", boot, "--window", str(args.window), "--scale", str(args.scale), *sizes]
            subprocess.run([sys.executable, "-m", "bench.fairness", *argv], check=True)
    elif args.live:
        from bench.fairness_live import run_live

        print()
        live = run_live(args.window, args.scale, boots)
        print(table(live, f"Live stack: {CARDS} simulated cards, clock ×{args.scale}, seconds of model time"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
