"""Pool layout: which worker process consumes which queues on which cards.

A layout is data (JSON/TOML or generated). The launcher starts one Celery
worker per entry; admission and the simulator read the same layout to know
the capacity that serves each duration class.
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .classes import CLASSES, LONG, MEDIUM, SHORT

ENCODE, DECODE, CONTROL = "encode", "decode", "control"
WEBHOOKS = "webhooks"  # webhook deliveries: HTTP only, never on a denoising card's worker
ALL_QUEUES: tuple[str, ...] = (ENCODE, SHORT, MEDIUM, LONG, DECODE, CONTROL, WEBHOOKS)

# Sequence parallelism's efficiency for a group of k cards serving one job (the seed's
# table: communication and imbalance cost 5 % at 2 cards, 12 % at 4, 20 % at 8).
GROUP_EFFICIENCY: dict[int, float] = {1: 1.0, 2: 0.95, 4: 0.88, 8: 0.80}


def group_speedup(k: int) -> float:
    """How many times faster a group of `k` cards runs one job than one card: k × efficiency.

    Only the group sizes of `GROUP_EFFICIENCY` are known; any other size is refused
    rather than guessed (sequence parallelism splits the sequence evenly, so groups
    are powers of two in practice).
    """
    if k not in GROUP_EFFICIENCY:
        raise ValueError(f"no efficiency known for a group of {k} cards; known sizes: {sorted(GROUP_EFFICIENCY)}")
    return k * GROUP_EFFICIENCY[k]


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process: its name, the cards it sees, the queues it consumes in order."""

    name: str
    queues: tuple[str, ...]
    devices: tuple[int, ...] = ()  # CUDA device ids; empty → CPU
    models: tuple[str, ...] = ()  # if set, the only models this worker loads

    def __post_init__(self) -> None:
        unknown = [q for q in self.queues if q not in ALL_QUEUES]
        if unknown:
            raise ValueError(f"worker {self.name!r}: unknown queues {unknown}; known: {list(ALL_QUEUES)}")
        if not self.queues:
            raise ValueError(f"worker {self.name!r} consumes no queue")

    @property
    def group_size(self) -> int:
        """The cards serving one job at a time: a worker with k devices is a group of k (CPU: 1)."""
        return max(1, len(self.devices))

    @property
    def denoises(self) -> bool:
        return any(q in CLASSES for q in self.queues)

    def consumed_queues(self) -> tuple[str, ...]:
        """The broker queues it reads. A worker dedicated to models reads their own class queues
        ("short.sdxl", ...), so one process serves one model and never loads another."""
        if not self.models:
            return self.queues
        return tuple(name for q in self.queues
                     for name in ([f"{q}.{m}" for m in self.models] if q in CLASSES else [q]))


@dataclass(frozen=True)
class PoolLayout:
    workers: tuple[WorkerSpec, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        names = [w.name for w in self.workers]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique, got {names}")
        served = {class_of(q) for w in self.workers for q in w.consumed_queues()}
        missing = [q for q in (ENCODE, *CLASSES, DECODE) if q not in served]
        if missing:
            raise ValueError(f"pool layout leaves queues without a worker: {missing}")

    def capacity(self, queue: str) -> int:
        """How many workers take work from `queue`."""
        return sum(1 for w in self.workers if queue in w.consumed_queues())

    def dedicated_models(self) -> set[str]:
        return {m for w in self.workers if w.denoises for m in w.models}

    def queue_for(self, duration_class: str, model: str) -> str:
        """Where a job's denoise chunks go: its model's own class queue if workers are dedicated to it."""
        return f"{duration_class}.{model}" if model in self.dedicated_models() else duration_class

    def all_queues(self) -> set[str]:
        return {q for w in self.workers for q in w.consumed_queues()}

    def queues_of(self, name: str) -> tuple[str, ...]:
        for w in self.workers:
            if w.name == name:
                return w.queues
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {"workers": [
            {"name": w.name, "queues": list(w.queues), "devices": list(w.devices), "models": list(w.models)}
            for w in self.workers
        ]}


def class_of(queue: str) -> str:
    """The duration class (or stage) a broker queue belongs to: "short.sdxl" → "short"."""
    return queue.split(".", 1)[0]


def default_layout(num_gpus: int, cpu_workers: int = 2, image_cards: int | None = None,
                   max_long_cards: int | None = None) -> PoolLayout:
    """The generated layout for a machine.

    With N cards: `image_cards` of them (default about a quarter, at least one)
    serve images only (short, medium); the rest serve video and also take images
    first (the priority bands put short chunks ahead of long ones on every card).
    `max_long_cards` caps the cards that run long work at once (the seed's
    "at most 2 cards on video"): cards beyond the cap serve images only. Text
    encode and VAE decode get their own processes, sharing the last card (CPU
    when there is none); the encode process also delivers webhooks. With no GPU, `cpu_workers` CPU processes play the
    cards with the same logic.
    """
    cards = num_gpus if num_gpus > 0 else max(1, cpu_workers)
    if image_cards is None:
        image_cards = max(1, round(cards / 4)) if cards > 1 else 0
    if max_long_cards is not None:
        if max_long_cards < 1:
            raise ValueError("max_long_cards must be at least 1: some card has to run long work")
        image_cards = max(image_cards, cards - max_long_cards)
    if not 0 <= image_cards < cards:
        raise ValueError(f"image_cards must be within 0..{cards - 1} for {cards} cards, got {image_cards}")
    workers: list[WorkerSpec] = []
    for i in range(cards):
        devices = (i,) if num_gpus > 0 else ()
        prefix = "gpu" if num_gpus > 0 else "cpu"
        queues = (SHORT, MEDIUM) if i < image_cards else (SHORT, MEDIUM, LONG)
        workers.append(WorkerSpec(name=f"{prefix}{i}", queues=queues, devices=devices))
    side = (num_gpus - 1,) if num_gpus > 0 else ()
    workers.append(WorkerSpec(name="encode", queues=(ENCODE, CONTROL, WEBHOOKS), devices=side))
    workers.append(WorkerSpec(name="decode", queues=(DECODE,), devices=side))
    return PoolLayout(tuple(workers))


def parse_layout(data: dict) -> PoolLayout:
    try:
        entries = data["workers"]
        return PoolLayout(tuple(
            WorkerSpec(name=str(e["name"]), queues=tuple(e["queues"]),
                       devices=tuple(int(d) for d in e.get("devices", ())),
                       models=tuple(e.get("models", ())))
            for e in entries
        ))
    except (KeyError, TypeError) as exc:
        raise ValueError(
            'pool layout must look like {"workers": [{"name": "gpu0", "queues": ["short"], "devices": [0]}]}: '
            f"{exc!r}") from None


def load_layout(spec: str | None, num_gpus: int, cpu_workers: int = 2, image_cards: int | None = None,
                max_long_cards: int | None = None) -> PoolLayout:
    """A layout from `spec` (inline JSON, or a .json/.toml file path), else the default."""
    if not spec:
        return default_layout(num_gpus, cpu_workers, image_cards, max_long_cards)
    text = spec.strip()
    if text.startswith("{"):
        return parse_layout(json.loads(text))
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"GENSERVER_POOLS names {spec!r}, which is neither JSON nor an existing file")
    if path.suffix == ".toml":
        return parse_layout(tomllib.loads(path.read_text()))
    return parse_layout(json.loads(path.read_text()))


def detect_gpus() -> int:
    """Cards visible to this machine, without importing torch (the launcher stays light)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() not in ("", "-1")])
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0
