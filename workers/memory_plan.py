"""The memory plan: what each card of the launcher's layout holds resident, and whether it fits.

    python -m workers.memory_plan --registry bench/full-size.toml --card-gib 80 [--gpus N]

For every card of the layout the launcher would start (GENSERVER_POOLS, else
the generated layout for `--gpus` cards, default the launcher's count) it
prints the stage workers sharing the card and every component they can hold
resident, with its bytes: parameters and buffers × their dtype, from a build
of the model on the `meta` device through the same adapter code that loads a
real checkpoint (workers/runtime/components.py: config only, no memory, cached
per process). A worker holds its stage's components only (encode: text
encoders; denoise: the UNet or transformer, and the text encoders of a model
with `encode_on_card`; decode: the VAE), of every model it serves (its
`models`, else every diffusers entry of the registry; a simulated entry holds
nothing). Its model cache keeps them under GENSERVER_MODEL_CACHE_BYTES
(least recently used out first), so the worst case between jobs is the largest
set of its entries within that budget (or its largest single entry).

Activation headroom is an estimate from a job's shape (memory_estimates.py,
`activation_bytes`), printed per model for its default shape and its largest
(the registry's limits and max_batch; a video at most one segment). Two checks
per card at the default shapes, each failure a line naming the card and the
component:

1. each model alone: its components on the card's workers + their activations;
2. the card at its worst: every worker's cache full + every worker's largest
   activations at once (the stage workers on one card run concurrently).

A card that fits at the default shapes but not at the largest gets a WARNING
(such a job would fail with CUDA out-of-memory; the worker lives on). Exit
status 1 when a check fails; the launcher refuses such a layout with the same
message (`check_layout`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from genserver import config
from genserver.registry import ModelSpec, Registry, load_registry
from genserver.scheduling.classes import CLASSES
from genserver.scheduling.pools import DECODE, ENCODE, PoolLayout, WorkerSpec

from .memory_estimates import GIB, Component, Shape, activation_bytes, default_shape, largest_shape, stage_components

__all__ = [
    "GIB",
    "Component",
    "Shape",
    "CardPlan",
    "activation_bytes",
    "check_layout",
    "main",
    "plan_cards",
    "problems_of",
    "stage_components",
    "worst_cache",
]

STAGE_NAMES = ("encode", "denoise", "decode")


@dataclass
class CardPlan:
    label: str  # "card 0"
    capacity: int  # bytes
    workers: list[tuple[WorkerSpec, tuple[str, ...], tuple[str, ...]]]  # (worker, stages, models)
    resident: list[Component] = field(default_factory=list)  # the worst case between jobs
    in_turn: list[Component] = field(default_factory=list)  # loadable, but not beside the worst case
    activations: dict[str, int] = field(default_factory=dict)  # worker → its largest job's activations
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def resident_bytes(self) -> int:
        return sum(c.bytes for c in self.resident)

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + sum(self.activations.values())


# 1. The plan per card ------------------------------------------------------------------------


def worker_stages(worker: WorkerSpec) -> tuple[str, ...]:
    """The stages a worker runs, from the queues it consumes."""
    stages = []
    if ENCODE in worker.queues:
        stages.append("encode")
    if any(q in CLASSES for q in worker.queues):
        stages.append("denoise")
    if DECODE in worker.queues:
        stages.append("decode")
    return tuple(stages)


def served_models(worker: WorkerSpec, registry: Registry) -> tuple[str, ...]:
    """The models whose weights this worker may load: its dedicated ones, else every diffusers entry."""
    names = worker.models or tuple(registry.names())
    return tuple(n for n in names if n in registry and registry.get(n).backend == "diffusers")


def held_stages(stages: tuple[str, ...], spec: ModelSpec) -> tuple[str, ...]:
    """The stages whose components a worker running `stages` holds for `spec`: a denoise worker of a model that
    encodes on its card (`encode_on_card`) holds its text encoders as well."""
    if "denoise" in stages and "encode" not in stages and spec.encode_on_card:
        return ("encode", *stages)
    return stages


def on_card(spec: ModelSpec, stage: str) -> bool:
    """Whether `stage` of `spec` runs on the worker's card (`encode_device = "cpu"` keeps it in host memory)."""
    return not (stage == "encode" and spec.encode_device == "cpu")


def worst_cache(entries: list[list[Component]], budget: int) -> list[Component]:
    """The largest set of cache entries (one model's stage components each) a cache of `budget` bytes
    can hold at once; a single entry above the budget is still loaded (the cache keeps at least one)."""
    if not entries:
        return []
    sizes = [sum(c.bytes for c in entry) for entry in entries]
    best: tuple[int, ...] = (max(range(len(entries)), key=lambda i: sizes[i]),)
    best_bytes = sizes[best[0]]
    if best_bytes <= budget and len(entries) <= 16:
        for k in range(2, len(entries) + 1):
            for chosen in itertools.combinations(range(len(entries)), k):
                total = sum(sizes[i] for i in chosen)
                if best_bytes < total <= budget:
                    best, best_bytes = chosen, total
    return [c for i in best for c in entries[i]]


def plan_cards(layout: PoolLayout, registry: Registry, card_bytes: int, cache_budget: int) -> list[CardPlan]:
    """One CardPlan per card of `layout` (workers without a card run on the CPU and are left out)."""
    cards: dict[int, CardPlan] = {}
    for worker in layout.workers:
        stages, models = worker_stages(worker), served_models(worker, registry)
        for device in worker.devices:
            card = cards.setdefault(device, CardPlan(f"card {device}", card_bytes, []))
            card.workers.append((worker, stages, models))
    for card in cards.values():
        _check_models_alone(card, registry)
        _check_card_worst_case(card, registry, cache_budget)
    return [cards[d] for d in sorted(cards)]


def _held(card: CardPlan, registry: Registry, model: str) -> list[tuple[str, Component]]:
    """(worker, component) for every component of `model` the card's workers keep on it."""
    return [
        (worker.name, c)
        for worker, stages, models in card.workers
        if model in models
        for stage in held_stages(stages, registry.get(model))
        if on_card(registry.get(model), stage)
        for c in stage_components(registry.get(model), stage)
    ]


def _headroom(card: CardPlan, registry: Registry, worker: WorkerSpec, shape_of: Any) -> tuple[int, str]:
    """A worker's largest job's activations over its models (and which model that is)."""
    _, stages, models = next(entry for entry in card.workers if entry[0] is worker)
    sizes = [
        (activation_bytes(registry.get(m), stage, shape_of(registry.get(m))), m)
        for m in models
        for stage in held_stages(stages, registry.get(m))
        if on_card(registry.get(m), stage)
    ]
    return max(sizes, default=(0, ""))


def _check_models_alone(card: CardPlan, registry: Registry) -> None:
    for model in sorted({m for _, _, models in card.workers for m in models}):
        spec, held = registry.get(model), _held(card, registry, model)
        headroom = sum(activation_bytes(spec, stage, default_shape(spec)) for stage in {c.stage for _, c in held})
        need = sum(c.bytes for _, c in held) + headroom
        if held and need > card.capacity:
            largest = max((c for _, c in held), key=lambda c: c.bytes)
            if largest.bytes > card.capacity:
                card.problems.append(
                    f"{card.label} ({gib(card.capacity)}): {model} does not fit: its {largest.name} alone is "
                    f"{gib(largest.bytes)} in {largest.dtype}. Use a card with more memory, or a smaller dtype."
                )
                continue
            parts = " + ".join(f"{c.name} {gib(c.bytes)} ({worker})" for worker, c in held)
            card.problems.append(
                f"{card.label} ({gib(card.capacity)}): {model} does not fit: its {largest.name} alone is "
                f"{gib(largest.bytes)} in {largest.dtype}; {parts} + {gib(headroom)} of activations = {gib(need)}. "
                f"{_remedies(spec, held)}"
            )


def _check_card_worst_case(card: CardPlan, registry: Registry, cache_budget: int) -> None:
    per_worker: list[tuple[str, int]] = []
    for worker, stages, models in card.workers:
        entries = [
            stage_components(registry.get(m), stage)
            for m in models
            for stage in held_stages(stages, registry.get(m))
            if on_card(registry.get(m), stage)
        ]
        held = worst_cache([e for e in entries if e], cache_budget)
        card.resident.extend(held)
        card.in_turn.extend(c for entry in entries for c in entry if c not in held)
        per_worker.append((worker.name, sum(c.bytes for c in held)))
        card.activations[worker.name] = _headroom(card, registry, worker, default_shape)[0]
    if card.total_bytes > card.capacity and card.resident:
        largest = max(card.resident, key=lambda c: c.bytes)
        caches = ", ".join(f"{name} {gib(size)}" for name, size in per_worker)
        card.problems.append(
            f"{card.label} ({gib(card.capacity)}): its workers' model caches can hold {gib(card.resident_bytes)} "
            f"together ({caches}; the largest component {largest.model} {largest.name} {gib(largest.bytes)}) "
            f"+ {gib(sum(card.activations.values()))} of activations = {gib(card.total_bytes)}. Set "
            f'encode_device = "cpu" on the models whose text encoders share this card, a smaller dtype, '
            f"a lower GENSERVER_MODEL_CACHE_BYTES (now {gib(cache_budget)} per worker), or more cards "
            f"(GENSERVER_POOLS: workers dedicated to models)."
        )
        return
    # A job at the registry's limits (largest size, batch, one video segment): a warning, not a refusal,
    # since the default shapes fit; such a job would fail with CUDA out-of-memory, the worker lives on.
    largest = {w.name: _headroom(card, registry, w, largest_shape) for w, _, _ in card.workers}
    total = card.resident_bytes + sum(size for size, _ in largest.values())
    if total > card.capacity:
        size, model = max(largest.values())
        card.warnings.append(
            f"{card.label}: a job at the registry's limits would need {gib(total)} (of {gib(card.capacity)}); "
            f"the largest is {model} at {largest_shape(registry.get(model))} ({gib(size)} of activations): "
            f"lower its limits or max_batch, or give it a card of its own."
        )


def _remedies(spec: ModelSpec, held: list[tuple[str, Component]]) -> str:
    options = []
    encoders = sum(c.bytes for _, c in held if c.stage == "encode")
    if encoders:
        options.append(f'encode_device = "cpu" on [models."{spec.name}"] (frees {gib(encoders)})')
    options.append(
        'a smaller dtype (dtype = "float16" / "bfloat16" where it is "float32")'
        if spec.resolved_dtype("cuda") == "float32"
        else "a smaller dtype"
    )
    options.append(
        f'or more cards (GENSERVER_POOLS: give "{spec.name}" workers of its own, its encode and decode on other cards)'
    )
    return "Set " + ", ".join(options) + "."


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_plan(cards: list[CardPlan], registry: Registry, cache_budget: int) -> str:
    lines = [
        f"# memory plan: {len(cards)} card(s); model cache budget {gib(cache_budget)} per worker; "
        f"bytes = parameters and buffers × dtype (meta-device builds)"
    ]
    for card in cards:
        lines.append(
            f"\n{card.label}: {gib(card.capacity)}; workers "
            + ", ".join(f"{w.name} [{'+'.join(stages) or '-'}]" for w, stages, _ in card.workers)
        )
        for component in [*card.resident, *card.in_turn]:
            held = "" if component in card.resident else "  (in turn: the cache swaps it for others)"
            lines.append(
                f"  {component.model:<20} {component.stage:<8} {component.name:<16} "
                f"{component.dtype:<16} {component.params / 1e9:7.3f} B params  {gib(component.bytes):>10}"
                f"{held}"
            )
        for worker, size in card.activations.items():
            lines.append(f"  activations {worker}: {gib(size)} (its largest job at a default shape)")
        verdict = "fits" if not card.problems else "DOES NOT FIT"
        lines.append(f"  total {gib(card.total_bytes)} of {gib(card.capacity)} at the default shapes: {verdict}")
        lines.extend(f"  WARNING {warning}" for warning in card.warnings)
    lines.append("\n# activation headroom per job shape (workers.memory_plan.activation_bytes)")
    names = sorted({m for card in cards for _, _, models in card.workers for m in models})
    for name in names:
        spec = registry.get(name)
        for label, shape in (("default", default_shape(spec)), ("largest", largest_shape(spec))):
            parts = ", ".join(f"{stage} {gib(activation_bytes(spec, stage, shape))}" for stage in STAGE_NAMES)
            lines.append(f"  {name:<20} {label:<8} {str(shape):<32} {parts}")
    return "\n".join(lines)


def problems_of(cards: list[CardPlan]) -> list[str]:
    return [p for card in cards for p in card.problems]


# 2. The launcher's layout, the launcher's check, the command line ----------------------------


def launcher_layout(gpus: int | None = None) -> tuple[PoolLayout, int]:
    """The layout the launcher would start (GENSERVER_POOLS, else generated) and its card count;
    `gpus` overrides the count (GENSERVER_NUM_GPUS, else the cards detected)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")
    from django.conf import settings

    from genserver.scheduling.pools import detect_gpus, load_layout

    if gpus is None:
        gpus = int(settings.NUM_GPUS) if settings.NUM_GPUS not in (None, "") else detect_gpus()
    layout = load_layout(
        settings.POOLS, gpus, settings.CPU_WORKERS, settings.IMAGE_CARDS, settings.MAX_LONG_CARDS, settings.GROUP_CARDS
    )
    return layout, gpus


def detected_card_bytes() -> int | None:
    """The smallest visible card's memory: GENSERVER_CARD_GIB, else nvidia-smi (no torch import), else None."""
    configured = config.card_gib()
    if configured is not None:
        return int(configured * GIB)
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        sizes = [int(line.strip()) * 1024**2 for line in out.stdout.splitlines() if line.strip().isdigit()]
    except (OSError, subprocess.SubprocessError):
        return None
    return min(sizes) if sizes else None


def check_layout(
    layout: PoolLayout, registry: Registry, card_bytes: int, cache_budget: int, data_dir: Any
) -> list[str]:
    """The plan's failures for the diffusers entries whose checkpoint directory exists (what a
    worker could load); [] when the layout fits. The launcher refuses to start on any."""
    present = {
        name: spec
        for name, spec in registry.models.items()
        if spec.backend == "diffusers" and spec.resolved_path(data_dir).is_dir()
    }
    if not present or not any(w.devices for w in layout.workers):
        return []
    return problems_of(plan_cards(layout, Registry(present), card_bytes, cache_budget))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers.memory_plan", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--registry", default=None, help="registry TOML (default: GENSERVER_REGISTRY, else the bundled one)"
    )
    parser.add_argument("--card-gib", type=float, required=True, help="memory of one card, in GiB (e.g. 80)")
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="cards in the generated layout (default: GENSERVER_NUM_GPUS, else detected; with none, 1)",
    )
    parser.add_argument(
        "--cache-gib",
        type=float,
        default=None,
        help="model cache budget per worker in GiB (default: GENSERVER_MODEL_CACHE_BYTES)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    layout, gpus = launcher_layout(args.gpus)
    note = ""
    if gpus == 0:
        layout, gpus = launcher_layout(1)
        note = (
            "# no card visible and GENSERVER_NUM_GPUS unset: planning the launcher's layout for 1 card "
            "(pass --gpus N)\n"
        )
    from django.conf import settings

    registry = load_registry(args.registry or settings.REGISTRY_PATH)
    budget = int(args.cache_gib * GIB) if args.cache_gib is not None else int(settings.MODEL_CACHE_BYTES)
    cards = plan_cards(layout, registry, int(args.card_gib * GIB), budget)
    print(note + format_plan(cards, registry, budget))
    problems = problems_of(cards)
    for problem in problems:
        print(f"\nDOES NOT FIT: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
