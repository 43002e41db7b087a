"""The seed chapter's scheduling table reproduced, and our policy on the same workload.

    .venv/bin/python -m bench.seed_table                  # tables (Markdown) on stdout
    .venv/bin/python -m bench.seed_table --plots docs/img # and the PNGs
    .venv/bin/python -m bench.seed_table --seeds 20       # robustness over more workloads
    .venv/bin/python -m bench.seed_table --groups         # only the card-group tables (8 cards)

Everything runs in the plain-Python simulator (`genserver.scheduling.simulator`),
which calls the scheduling core the live service uses. The workload is the
seed's: 400 Poisson arrivals, 80 % images of 2/3/6 s, 20 % videos of 120/300 s,
seed 0, 4 cards. Two metrics: `wait` (arrival → first denoising step, the
seed's) and `delay` (completion − arrival − service, the honest one for a
preemptive system). For the seed's non-preemptive policies they are equal.
The output is the section "Scheduling policy (simulator)" of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from genserver.scheduling.admission import AdmissionLimits
from genserver.scheduling.chunking import DEFAULT_CHUNK_SECONDS
from genserver.scheduling.simulator import (
    DEFAULT_CHECKPOINT_SECONDS,
    DEFAULT_MODEL_CACHE_GIB,
    DEFAULT_SWITCH_SECONDS,
    IMAGE,
    KINDS,
    SEED_POLICIES,
    SEED_VIDEO_SECONDS,
    VIDEO,
    SimConfig,
    SimResult,
    group_table,
    mixed_layout,
    offered_load,
    pct,
    seed_waits,
    seed_workload,
    service_policy_config,
    simulate,
    simulate_groups,
)

RATES: tuple[float, ...] = (0.06, 0.08)
OVERLOAD_RATE = 0.12
CHUNKS: tuple[float, ...] = (1.0, 2.4, 4.0, 4.8, 6.0, 9.6, 12.0, 24.0, 60.0)
IMAGE_FACTOR, VIDEO_FACTOR = 0.6, 1.1  # targets: images P99 ≤ 0.6 × pools', videos P99 ≤ 1.1 × FCFS'
# The chapter's "several cards" table (8 cards): cards per group → latency minutes, videos/hour.
SEED_GROUP_FIGURES: dict[int, tuple[float, float]] = {1: (25.0, 19.2), 2: (13.2, 18.2), 4: (7.1, 16.9), 8: (3.9, 15.4)}
SEED_FIGURES = {  # the chapter's printed table (rate 0.06): images P50/P99, videos P50/P99
    "fcfs": (17, 473, 19, 423),
    "sjf": (2, 90, 23, 614),
    "pools": (0, 7, 152, 745),
}
OURS, OURS_YOD = "ours", "ours + yield-on-demand"


@dataclass
class Outcome:
    """Per kind: every finished job's wait and delay, and the refusals."""

    name: str
    waits: dict[str, list[float]]
    delays: dict[str, list[float]]
    refused: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    result: SimResult | None = None

    def p(self, kind: str, metric: str, q: float) -> float:
        return pct((self.waits if metric == "wait" else self.delays)[kind], q)

    @classmethod
    def seed(cls, policy: str, rate: float, seed: int = 0) -> Outcome:
        waits = seed_waits(policy, rate=rate, seed=seed)  # type: ignore[arg-type]
        return cls(policy, waits, waits)

    @classmethod
    def sim(cls, name: str, config: SimConfig, rate: float, seed: int = 0) -> Outcome:
        r = simulate(seed_workload(400, rate, seed), config)
        return cls(
            name,
            {k: c.waits for k, c in r.classes.items()},
            {k: c.delays for k, c in r.classes.items()},
            {k: c.refused for k, c in r.classes.items()},
            r,
        )


def ours(**overrides: object) -> SimConfig:
    return service_policy_config(**overrides)  # type: ignore[arg-type]


def ours_yod(**overrides: object) -> SimConfig:
    return service_policy_config(yield_on_demand=True, **overrides)  # type: ignore[arg-type]


OUR_POLICIES: dict[str, Callable[..., SimConfig]] = {OURS: ours, OURS_YOD: ours_yod}


def targets(rate: float, seed: int = 0) -> tuple[float, float]:
    """(image P99 bound, video P99 bound) at `rate`: 0.6 × pools' image P99, 1.1 × FCFS' video P99."""
    return (
        IMAGE_FACTOR * pct(seed_waits("pools", rate=rate, seed=seed)[IMAGE], 0.99),
        VIDEO_FACTOR * pct(seed_waits("fcfs", rate=rate, seed=seed)[VIDEO], 0.99),
    )


# --------------------------------------------------------------------------- formatting


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(x: object) -> str:
        return f"{x:.1f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def pair(a: float, b: float, digits: int = 0) -> str:
    return f"{a:.{digits}f} / {b:.{digits}f}"


def mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


# --------------------------------------------------------------------------- sections


def section_groups(cards: int = 8, load: float = 0.7, interactive_share: float = 0.4) -> str:
    """The seed's card-group table (closed form), then the layouts simulated on a video workload."""
    closed = table(
        [f"cards per group ({cards} cards)", "groups", "latency (min)", "videos/hour", "the chapter prints"],
        [
            [
                r.group,
                r.groups,
                f"{r.latency_minutes:.1f}",
                f"{r.videos_per_hour:.1f}",
                " / ".join(map(str, SEED_GROUP_FIGURES.get(r.group, ()))),
            ]
            for r in group_table(cards=cards)
        ],
    )
    sims = table(
        [
            "layout",
            "capacity videos/h",
            "load",
            "latency P50 / P99 (min)",
            "interactive P50 / P99",
            "others P50 / P99",
            "videos/h",
        ],
        [
            [
                r.layout,
                f"{r.capacity_per_hour:.1f}",
                f"{r.load:.0%}",
                f"{r.p50_minutes:.1f} / {r.p99_minutes:.1f}",
                f"{r.interactive_p50_minutes:.1f} / {r.interactive_p99_minutes:.1f}",
                f"{r.other_p50_minutes:.1f} / {r.other_p99_minutes:.1f}",
                f"{r.videos_per_hour:.1f}",
            ]
            for r in simulate_groups(cards, load, interactive_share=interactive_share)
        ],
    )
    return (
        f"{closed}\n\nSimulated: 400 Poisson arrivals (seed 0) of {SEED_VIDEO_SECONDS / 60:.0f}-min videos "
        f"offering {load:.0%} of {cards} single cards, {interactive_share:.0%} of them submitted on the "
        "interactive lane, everything admitted, latency = arrival → completion (minutes):\n\n"
        f"{sims}"
    )


def section_seed_table() -> str:
    rows = []
    for policy in SEED_POLICIES:
        o = Outcome.seed(policy, 0.06)
        got = (o.p(IMAGE, "wait", 0.5), o.p(IMAGE, "wait", 0.99), o.p(VIDEO, "wait", 0.5), o.p(VIDEO, "wait", 0.99))
        rows.append(
            [
                policy,
                *(f"{x:.0f}" for x in got),
                " / ".join(map(str, SEED_FIGURES[policy])),
                "yes" if tuple(round(x) for x in got) == SEED_FIGURES[policy] else "NO",
            ]
        )
    return table(["policy", "images P50", "images P99", "videos P50", "videos P99", "the chapter prints", "same"], rows)


def section_side_by_side(rate: float) -> tuple[str, dict[str, Outcome]]:
    outcomes = {p: Outcome.seed(p, rate) for p in SEED_POLICIES}
    for name, make in OUR_POLICIES.items():
        outcomes[name] = Outcome.sim(name, make(), rate)
    rows = []
    for name, o in outcomes.items():
        rows.append(
            [
                name,
                pair(o.p(IMAGE, "wait", 0.5), o.p(IMAGE, "wait", 0.99), 1),
                pair(o.p(IMAGE, "delay", 0.5), o.p(IMAGE, "delay", 0.99), 1),
                pair(o.p(VIDEO, "wait", 0.5), o.p(VIDEO, "wait", 0.99)),
                pair(o.p(VIDEO, "delay", 0.5), o.p(VIDEO, "delay", 0.99)),
                f"{o.refused[IMAGE]} / {o.refused[VIDEO]}",
            ]
        )
    text = table(
        [
            "policy",
            "images wait P50 / P99",
            "images delay P50 / P99",
            "videos wait P50 / P99",
            "videos delay P50 / P99",
            "refused img / vid",
        ],
        rows,
    )
    return text, outcomes


def section_targets(all_outcomes: dict[float, dict[str, Outcome]]) -> str:
    rows = []
    for rate, outcomes in all_outcomes.items():
        ti, tv = targets(rate)
        for name in OUR_POLICIES:
            o = outcomes[name]
            for kind, bound, label in (
                (IMAGE, ti, f"≤ {IMAGE_FACTOR} × pools = {ti:.2f} s"),
                (VIDEO, tv, f"≤ {VIDEO_FACTOR} × FCFS = {tv:.0f} s"),
            ):
                w, d = o.p(kind, "wait", 0.99), o.p(kind, "delay", 0.99)
                digits = 2 if kind == IMAGE else 0
                rows.append(
                    [
                        f"{rate}",
                        name,
                        f"{kind}s P99 {label}",
                        f"{w:.{digits}f}",
                        mark(w <= bound),
                        f"{d:.{digits}f}",
                        mark(d <= bound),
                    ]
                )
    return table(["rate", "policy", "target", "wait", "", "delay", ""], rows)


def section_overload(base: dict[str, Outcome]) -> str:
    rows = []
    limit = AdmissionLimits().long
    configs = {"image card (one of four)": SimConfig(), **{n: f() for n, f in OUR_POLICIES.items()}}
    for name, cfg in configs.items():
        o = Outcome.sim(name, cfg, OVERLOAD_RATE)
        b = base.get(name) or Outcome.sim(name, cfg, 0.06)
        r = o.result
        assert r is not None
        img_w, img_d = o.p(IMAGE, "wait", 0.99), o.p(IMAGE, "delay", 0.99)
        ok_img = img_w <= b.p(IMAGE, "wait", 0.99) and img_d <= b.p(IMAGE, "delay", 0.99)
        start = max(o.waits[VIDEO]) if o.waits[VIDEO] else 0.0
        rows.append(
            [
                name,
                f"{r.classes[IMAGE].accepted} / {o.refused[IMAGE]}",
                f"{r.classes[VIDEO].accepted} / {o.refused[VIDEO]}",
                f"{pair(img_w, img_d, 1)} (at 0.06: {pair(b.p(IMAGE, 'wait', 0.99), b.p(IMAGE, 'delay', 0.99), 1)})",
                mark(ok_img),
                f"{start:.0f}",
                mark(start <= limit),
                f"{r.cap_engaged_share:.0%}",
            ]
        )
    return table(
        [
            "policy (rate 0.12)",
            "images accepted / refused",
            "videos accepted / refused",
            "images P99 wait / delay",
            "no worse",
            f"latest video start (limit {limit:.0f} s)",
            "",
            "cap engaged",
        ],
        rows,
    )


def _curve_configs(chunk: float) -> dict[str, SimConfig]:
    return {
        "image card (one of four)": SimConfig(chunk_seconds=chunk),
        OURS: ours(chunk_seconds=chunk),
        OURS_YOD: ours_yod(chunk_seconds=chunk),
    }


def tradeoff_points() -> dict[tuple[str, float, float], Outcome]:
    points = {}
    for chunk in CHUNKS:
        for name, cfg in _curve_configs(chunk).items():
            for rate in RATES:
                points[name, chunk, rate] = Outcome.sim(name, cfg, rate)
    return points


def section_tradeoff(points: dict[tuple[str, float, float], Outcome]) -> str:
    rows = []
    for name in _curve_configs(1.0):
        for chunk in CHUNKS:
            row: list[object] = [name, f"{chunk:g}"]
            for rate in RATES:
                o = points[name, chunk, rate]
                row += [
                    pair(o.p(IMAGE, "wait", 0.99), o.p(IMAGE, "delay", 0.99), 1),
                    pair(o.p(VIDEO, "wait", 0.99), o.p(VIDEO, "delay", 0.99)),
                ]
            rows.append(row)
    header = ["policy", "chunk s"]
    for rate in RATES:
        ti, tv = targets(rate)
        header += [f"{rate}: images P99 w / d (≤ {ti:.2f})", f"{rate}: videos P99 w / d (≤ {tv:.0f})"]
    return table(header, rows)


def section_caps() -> str:
    variants = {
        "image card (one of four): gpu0 never runs video": SimConfig(),
        "all cards, cap 3 always": SimConfig(layout=mixed_layout(4, 0), long_cap=3),
        "all cards, cap 2 always": SimConfig(layout=mixed_layout(4, 0), long_cap=2),
        "all cards, no cap": SimConfig(layout=mixed_layout(4, 0)),
        f"{OURS}: all cards, cap 3 under overload": ours(),
        f"{OURS_YOD}: same, yield on demand": ours_yod(),
    }
    rows = []
    for name, cfg in variants.items():
        row: list[object] = [name]
        for rate in RATES:
            o = Outcome.sim(name, cfg, rate)
            row += [
                pair(o.p(IMAGE, "wait", 0.99), o.p(IMAGE, "delay", 0.99), 1),
                pair(o.p(VIDEO, "wait", 0.99), o.p(VIDEO, "delay", 0.99)),
            ]
        o = Outcome.sim(name, cfg, OVERLOAD_RATE)
        row += [
            pair(o.p(IMAGE, "wait", 0.99), o.p(IMAGE, "delay", 0.99), 1),
            f"{o.refused[IMAGE]} / {o.refused[VIDEO]}",
        ]
        rows.append(row)
    header = ["layout / cap (chunk 4 s)"]
    for rate in RATES:
        header += [f"{rate}: images P99 w / d", f"{rate}: videos P99 w / d"]
    header += ["0.12: images P99 w / d", "0.12: refused img / vid"]
    return table(header, rows)


# A kept boundary's synchronous checkpoint save on a real card: a Wan 480p state (25 MB) written with
# torch.save + fsync + rename on local disk (docs/BENCHMARKS.md, "Costs"). The service writes it at every
# boundary, kept or not, unless GENSERVER_CHECKPOINT_EVERY spaces the kept boundaries' saves out; the default
# rows count it as free (yield on demand's in_process_seconds=0).
WAN_STATE_SAVE_SECONDS = 0.04

# (label, checkpoint s, switch s, model cache GiB, kept boundary s): a card whose cache holds both models
# (40 GiB, the worker's default GENSERVER_MODEL_CACHE_BYTES) pays the switch only on its first load of each;
# the last figure is what yield on demand pays at a boundary where the card keeps its job.
COST_SCENARIOS: tuple[tuple[str, float, float, float, float], ...] = (
    ("no overhead (bound)", 0.0, 0.0, DEFAULT_MODEL_CACHE_GIB, 0.0),
    ("local checkpoints, both models resident", 0.1, DEFAULT_SWITCH_SECONDS, DEFAULT_MODEL_CACHE_GIB, 0.0),
    (
        "default (both models resident)",
        DEFAULT_CHECKPOINT_SECONDS,
        DEFAULT_SWITCH_SECONDS,
        DEFAULT_MODEL_CACHE_GIB,
        0.0,
    ),
    (
        "default, a Wan state saved at every kept boundary",
        DEFAULT_CHECKPOINT_SECONDS,
        DEFAULT_SWITCH_SECONDS,
        DEFAULT_MODEL_CACHE_GIB,
        WAN_STATE_SAVE_SECONDS,
    ),
    ("one model at a time", DEFAULT_CHECKPOINT_SECONDS, DEFAULT_SWITCH_SECONDS, 0.0, 0.0),
    ("one model at a time, weights from pinned host memory", DEFAULT_CHECKPOINT_SECONDS, 1.1, 0.0, 0.0),
    ("pessimistic: one model at a time", 0.5, 2.0, 0.0, WAN_STATE_SAVE_SECONDS),
)


def section_costs() -> str:
    rows = []
    seen: set[tuple[float, float, float]] = set()
    for label, ckpt, switch, cache_gib, kept in COST_SCENARIOS:
        costs = (ckpt, switch, cache_gib)
        repeat = costs in seen
        seen.add(costs)
        for name, make in OUR_POLICIES.items():
            if repeat and make is ours:
                continue  # re-publishing every chunk keeps no boundary: the row would repeat an earlier one
            row: list[object] = [label, f"{ckpt:g}", f"{switch:g}", f"{cache_gib:g}", f"{kept:g}", name]
            # in_process_seconds applies to yield on demand only (re-publishing keeps no boundary).
            config = make(checkpoint_seconds=ckpt, switch_seconds=switch, cache_gib=cache_gib, in_process_seconds=kept)
            for rate in RATES:
                ti, tv = targets(rate)
                o = Outcome.sim(name, config, rate)
                iw, idl = o.p(IMAGE, "wait", 0.99), o.p(IMAGE, "delay", 0.99)
                vw, vd = o.p(VIDEO, "wait", 0.99), o.p(VIDEO, "delay", 0.99)
                row += [pair(iw, idl, 1), pair(vw, vd), sum([iw <= ti, idl <= ti, vw <= tv, vd <= tv])]
            rows.append(row)
    header = ["costs", "checkpoint s", "switch s", "model cache GiB", "kept boundary s", "policy"]
    for rate in RATES:
        header += [f"{rate}: images P99 w / d", f"{rate}: videos P99 w / d", "targets met (of 4)"]
    return table(header, rows)


def section_seeds(n: int) -> str:
    policies: dict[str, Callable[[], SimConfig]] = {
        OURS: ours,
        OURS_YOD: ours_yod,
        f"{OURS}, no overhead (bound)": lambda: ours(checkpoint_seconds=0.0, switch_seconds=0.0),
        f"{OURS_YOD}, no overhead (bound)": lambda: ours_yod(checkpoint_seconds=0.0, switch_seconds=0.0),
        f"{OURS_YOD}, a Wan state saved at every kept boundary": lambda: ours_yod(
            in_process_seconds=WAN_STATE_SAVE_SECONDS
        ),
    }
    rows = []
    for name, make in policies.items():
        cfg = make()
        for rate in RATES:
            img_ratio: list[float] = []
            vid_ratio: list[tuple[float, float]] = []
            for seed in range(n):
                pools_img = pct(seed_waits("pools", rate=rate, seed=seed)[IMAGE], 0.99)
                fcfs_vid = pct(seed_waits("fcfs", rate=rate, seed=seed)[VIDEO], 0.99)
                o = Outcome.sim(name, cfg, rate, seed)
                img_ratio.append(max(o.p(IMAGE, "wait", 0.99), o.p(IMAGE, "delay", 0.99)) / pools_img)
                vid_ratio.append((o.p(VIDEO, "wait", 0.99) / fcfs_vid, o.p(VIDEO, "delay", 0.99) / fcfs_vid))
            rows.append(
                [
                    name,
                    f"{rate}",
                    f"{statistics.median(img_ratio):.2f} ({sum(r <= IMAGE_FACTOR for r in img_ratio)}/{n})",
                    f"{statistics.median(v[0] for v in vid_ratio):.2f} "
                    f"({sum(v[0] <= VIDEO_FACTOR for v in vid_ratio)}/{n})",
                    f"{statistics.median(v[1] for v in vid_ratio):.2f} "
                    f"({sum(v[1] <= VIDEO_FACTOR for v in vid_ratio)}/{n})",
                ]
            )
    for name, make in OUR_POLICIES.items():
        cfg = make()
        refused = worse = late = 0
        ratios = []
        for seed in range(n):
            a, b = Outcome.sim(name, cfg, 0.06, seed), Outcome.sim(name, cfg, OVERLOAD_RATE, seed)
            refused += b.refused[IMAGE] > 0
            ratio = max(
                b.p(IMAGE, "wait", 0.99) / a.p(IMAGE, "wait", 0.99),
                b.p(IMAGE, "delay", 0.99) / a.p(IMAGE, "delay", 0.99),
            )
            ratios.append(ratio)
            worse += ratio > 1
            late += bool(b.waits[VIDEO]) and max(b.waits[VIDEO]) > AdmissionLimits().long
        rows.append(
            [
                f"{name}: overload 0.12 vs 0.06",
                f"{OVERLOAD_RATE}",
                f"P99 ratio {statistics.median(ratios):.2f}; no worse in {n - worse}/{n}",
                f"no image refused in {n - refused}/{n}",
                f"videos start within limit in {n - late}/{n}",
            ]
        )
    return table(
        [
            "policy",
            "rate",
            "images P99 / pools' (met)",
            "videos wait P99 / FCFS' (met)",
            "videos delay P99 / FCFS' (met)",
        ],
        rows,
    )


# --------------------------------------------------------------------------- plots


def write_plots(
    directory: Path, sides: dict[float, dict[str, Outcome]], points: dict[tuple[str, float, float], Outcome]
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    styles = {
        "fcfs": ("tab:red", "-"),
        "sjf": ("tab:orange", "-"),
        "pools": ("tab:purple", "-"),
        OURS: ("tab:blue", "-"),
        OURS_YOD: ("tab:green", "-"),
    }
    for rate, outcomes in sides.items():
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, kind in zip(axes, KINDS):
            for name, o in outcomes.items():
                color, style = styles[name]
                for metric, ls in (("wait", style), ("delay", ":")):
                    if metric == "delay" and name not in OUR_POLICIES:
                        continue  # equal to the wait for the seed's non-preemptive policies
                    xs = sorted((o.waits if metric == "wait" else o.delays)[kind])
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    label = f"{name} ({metric})" if name in OUR_POLICIES else name
                    ax.step(xs, ys, where="post", color=color, linestyle=ls, label=label)
            ax.set_xscale("symlog", linthresh=1.0)
            ax.set_xlabel("seconds (wait: arrival → first step; delay: completion − arrival − service)")
            ax.set_ylabel("share of jobs")
            ax.set_title(f"{kind}s, rate {rate}/s ({offered_load(rate):.0%} load, 4 cards)")
            ax.axhline(0.99, color="grey", linewidth=0.5)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        path = directory / f"sched_cdf_rate{rate:.2f}.png".replace("0.", "0")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")

    colors = {"image card (one of four)": "tab:purple", OURS: "tab:blue", OURS_YOD: "tab:green"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, kind in zip(axes, KINDS):
        for name, color in colors.items():
            for rate, ls in zip(RATES, ("-", "--")):
                ys = [points[name, c, rate].p(kind, "delay", 0.99) for c in CHUNKS]
                ax.plot(CHUNKS, ys, marker="o", color=color, linestyle=ls, label=f"{name}, rate {rate}")
        for rate, ls in zip(RATES, ("-", "--")):
            bound = targets(rate)[0 if kind == IMAGE else 1]
            ax.axhline(bound, color="black", linestyle=ls, linewidth=0.8, label=f"target at {rate}")
        ax.axvline(DEFAULT_CHUNK_SECONDS, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([1.0, 2.4, 4.0, 6.0, 12.0, 24.0, 60.0])
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        if kind == VIDEO:
            ax.set_yticks([450, 500, 600, 700, 800, 1000, 1500, 2000])
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain if kind == IMAGE else NullFormatter())
        ax.set_xlabel("CHUNK_SECONDS (never shorter than one step: video steps are 2.4 s or 6 s)")
        ax.set_ylabel("P99 delay (s)")
        ax.set_title(f"{kind}s: P99 delay against chunk length, costs included")
        ax.grid(True, alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path = directory / "sched_tradeoff_chunk.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # The same points as a trade-off between the classes, with the seed's policies.
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, rate in zip(axes, RATES):
        ti, tv = targets(rate)
        ax.fill_between([1, tv], 0.1, ti, color="tab:green", alpha=0.08, label="both targets met")
        for name, color in colors.items():
            xs = [points[name, c, rate].p(VIDEO, "delay", 0.99) for c in CHUNKS]
            ys = [points[name, c, rate].p(IMAGE, "delay", 0.99) for c in CHUNKS]
            ax.plot(xs, ys, marker="o", color=color, label=f"{name} (chunk 1…60 s)")
            for c, x, y in zip(CHUNKS, xs, ys):
                if c in (1.0, DEFAULT_CHUNK_SECONDS, 12.0, 60.0):
                    ax.annotate(f"{c:g}s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
        for policy, color in (("fcfs", "tab:red"), ("sjf", "tab:orange"), ("pools", "black")):
            o = sides[rate][policy]
            ax.scatter(
                [o.p(VIDEO, "delay", 0.99)],
                [o.p(IMAGE, "delay", 0.99)],
                marker="s",
                s=50,
                color=color,
                label=f"seed {policy}",
                zorder=3,
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([300, 400, 500, 600, 800, 1000, 1500, 2000])
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        ax.set_xlim(300, 2500)
        ax.set_ylim(1, 800)
        ax.set_xlabel("videos P99 delay (s)")
        ax.set_ylabel("images P99 delay (s)")
        ax.set_title(f"rate {rate}/s ({offered_load(rate):.0%} load): images against videos")
        ax.grid(True, alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path = directory / "sched_tradeoff_classes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plots", type=Path, help="write the PNGs into this directory")
    parser.add_argument("--seeds", type=int, default=10, help="workloads for the robustness table (0: skip)")
    parser.add_argument("--groups", action="store_true", help="print only the card-group tables (8 cards)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out = sys.stdout.write
    if args.groups:
        out("### Card groups (8 cards)\n\n" + section_groups() + "\n")
        out(f"\n({time.perf_counter() - started:.1f} s)\n")
        return 0

    out("## Scheduling policy (simulator)\n\n")
    out(
        f"Costs modelled: checkpoint save + restore {DEFAULT_CHECKPOINT_SECONDS} s per chunk boundary, "
        f"model switch {DEFAULT_SWITCH_SECONDS} s when the card's {DEFAULT_MODEL_CACHE_GIB:g} GiB model cache "
        "does not hold the model (it holds both, so a card pays each model's first load only); "
        f"a started job keeps its card against another of equal priority (videos do not swap); "
        f"chunk {DEFAULT_CHUNK_SECONDS} s; "
        f"load {', '.join(f'{r}/s = {offered_load(r):.0%}' for r in (*RATES, OVERLOAD_RATE))} of 4 cards.\n\n"
    )
    out("### The seed's table (rate 0.06, wait before the first step)\n\n")
    out(section_seed_table() + "\n\n")

    sides: dict[float, dict[str, Outcome]] = {}
    for rate in RATES:
        text, sides[rate] = section_side_by_side(rate)
        out(f"### Side by side at rate {rate}/s ({offered_load(rate):.0%} load)\n\n{text}\n\n")
    out("### Targets (seed 0)\n\n" + section_targets(sides) + "\n\n")
    out("### Overload at rate 0.12/s\n\n" + section_overload(sides[0.06]) + "\n\n")
    points = tradeoff_points()
    out("### Trade-off: chunk length (P99 wait / delay, seconds)\n\n" + section_tradeoff(points) + "\n\n")
    out("### Trade-off: cards that run video (chunk 4 s)\n\n" + section_caps() + "\n\n")
    out("### Sensitivity to the checkpoint and model-switch costs (chunk 4 s)\n\n" + section_costs() + "\n\n")
    if args.seeds > 0:
        out(f"### Robustness: seeds 0..{args.seeds - 1} (median ratio, and how many seeds meet the target)\n\n")
        out(section_seeds(args.seeds) + "\n\n")
    out("### Card groups (8 cards)\n\n" + section_groups() + "\n\n")
    if args.plots:
        for path in write_plots(args.plots, sides, points):
            out(f"wrote {path}\n")
    out(f"\n({time.perf_counter() - started:.1f} s)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
