"""Pool layout: which worker process consumes which queues on which cards.

A layout is data (JSON/TOML or generated). The launcher starts one Celery
worker per entry; admission and the simulator read the same layout to know
the capacity that serves each duration class.
"""

from __future__ import annotations

import json
import os
import re
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


# A lane is a named route to the workers that declare it: a job submitted with `lane`
# goes to its class's lane queue ("long@interactive") when some worker of the layout
# serves it, else to the plain class queue. The seed's pooled layout: a group of cards
# on the "interactive" lane (users waiting for a video), single cards for the rest.
INTERACTIVE = "interactive"
LANE_SEP = "@"
_LANE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


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
    lane: str = ""  # if set, it consumes only its classes' lane queues ("long@interactive")

    def __post_init__(self) -> None:
        unknown = [q for q in self.queues if q not in ALL_QUEUES]
        if unknown:
            raise ValueError(f"worker {self.name!r}: unknown queues {unknown}; known: {list(ALL_QUEUES)}")
        if not self.queues:
            raise ValueError(f"worker {self.name!r} consumes no queue")
        if self.lane:
            if not _LANE_NAME.match(self.lane) or self.lane in ALL_QUEUES:
                raise ValueError(
                    f"worker {self.name!r}: lane {self.lane!r} must be a short lower-case name "
                    "(letters, digits, - and _) other than a queue's"
                )
            if self.models:
                raise ValueError(f"worker {self.name!r}: a worker has either a lane or models, not both")
        if self.denoises:
            group_speedup(self.group_size)  # refuse a card group with no known efficiency (3, 5, ... cards)

    @property
    def group_size(self) -> int:
        """The cards serving one job at a time: a worker with k devices is a group of k (CPU: 1)."""
        return max(1, len(self.devices))

    @property
    def speedup(self) -> float:
        """Card-equivalents of this worker: one job runs `group_speedup(group_size)` times faster."""
        return group_speedup(self.group_size)

    @property
    def denoises(self) -> bool:
        return any(q in CLASSES for q in self.queues)

    def consumed_queues(self) -> tuple[str, ...]:
        """The broker queues it reads. A worker dedicated to models reads their own class queues
        ("short.sdxl", ...), so one process serves one model and never loads another; a worker on a
        lane reads its classes' lane queues ("long@interactive") and no plain class queue."""
        if self.lane:
            return tuple(f"{q}{LANE_SEP}{self.lane}" if q in CLASSES else q for q in self.queues)
        if not self.models:
            return self.queues
        return tuple(name for q in self.queues for name in ([f"{q}.{m}" for m in self.models] if q in CLASSES else [q]))


@dataclass(frozen=True)
class PoolLayout:
    workers: tuple[WorkerSpec, ...] = field(default_factory=tuple)
    # False for the capacity that is alive now (genserver/jobs/selectors/capacity.py: live_capacity): a dead
    # node may leave a class without a card, which admission answers with 429, not a config error.
    complete: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        names = [w.name for w in self.workers]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names must be unique, got {names}")
        if not self.complete:
            return
        # A job without a lane (or of a lane no worker serves) goes to its class queue, so every
        # class needs a worker outside the lanes.
        served = {class_of(q) for w in self.workers for q in w.consumed_queues() if LANE_SEP not in q}
        missing = [q for q in (ENCODE, *CLASSES, DECODE) if q not in served]
        if missing:
            raise ValueError(f"pool layout leaves queues without a worker: {missing}")

    def capacity(self, queue: str) -> int:
        """How many workers take work from `queue`."""
        return sum(1 for w in self.workers if queue in w.consumed_queues())

    def card_equivalents(self, queue: str) -> float:
        """The single-card seconds per second the workers reading `queue` process: a group of k
        cards counts `group_speedup(k)`, a single card 1."""
        return sum(w.speedup for w in self.workers if queue in w.consumed_queues())

    def job_speedup(self, queue: str) -> float:
        """How many times faster than one card a job of `queue` runs: the slowest worker reading it
        (a group's k-fold speedup where only groups read it; 1 where a single card may take it)."""
        speeds = [w.speedup for w in self.workers if queue in w.consumed_queues()]
        return min(speeds) if speeds else 1.0

    def worker(self, name: str) -> WorkerSpec | None:
        return next((w for w in self.workers if w.name == name), None)

    def lanes(self) -> set[str]:
        return {w.lane for w in self.workers if w.lane and w.denoises}

    def dedicated_models(self) -> set[str]:
        return {m for w in self.workers if w.denoises for m in w.models}

    def queue_for(self, duration_class: str, model: str, lane: str = "") -> str:
        """Where a job's denoise chunks go: its lane's queue for its class if some worker serves it,
        else its model's own class queue if workers are dedicated to it, else the class queue."""
        if lane:
            lane_queue = f"{duration_class}{LANE_SEP}{lane}"
            if any(lane_queue in w.consumed_queues() for w in self.workers):
                return lane_queue
        return f"{duration_class}.{model}" if model in self.dedicated_models() else duration_class

    def all_queues(self) -> set[str]:
        return {q for w in self.workers for q in w.consumed_queues()}

    def queues_of(self, name: str) -> tuple[str, ...]:
        for w in self.workers:
            if w.name == name:
                return w.queues
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {
            "workers": [
                {
                    "name": w.name,
                    "queues": list(w.queues),
                    "devices": list(w.devices),
                    "models": list(w.models),
                    **({"lane": w.lane} if w.lane else {}),
                }
                for w in self.workers
            ]
        }


def worker_from_queues(name: str, consumed: list[str] | tuple[str, ...], devices: tuple[int, ...] = ()) -> WorkerSpec:
    """The pool entry a running worker stands for, rebuilt from the broker queues it reads and the
    cards it sees (its heartbeat): "short.sdxl" → models ("sdxl",), "long@interactive" → lane
    "interactive"; k devices → a group of k."""
    queues: list[str] = []
    models: list[str] = []
    lane = ""
    for queue in consumed:
        stage = class_of(queue)
        if stage not in ALL_QUEUES:
            continue  # a queue this version does not know (a newer node): not capacity we can use
        if stage not in queues:
            queues.append(stage)
        rest = queue[len(stage) :]
        if rest.startswith(".") and rest[1:] not in models:
            models.append(rest[1:])
        elif rest.startswith(LANE_SEP):
            lane = rest[1:]
    return WorkerSpec(
        name=name,
        queues=tuple(queues) or (CONTROL,),
        devices=tuple(devices),
        models=() if lane else tuple(models),
        lane=lane,
    )


def class_of(queue: str) -> str:
    """The duration class (or stage) a broker queue belongs to: "short.sdxl", "short@interactive" → "short"."""
    return re.split(r"[.@]", queue, maxsplit=1)[0]


def default_layout(
    num_gpus: int,
    cpu_workers: int = 2,
    image_cards: int | None = None,
    max_long_cards: int | None = None,
    group_cards: int = 0,
) -> PoolLayout:
    """The generated layout for a machine.

    With N cards, every card serves every class (short, medium, long) and takes
    images first: the priority bands put short chunks ahead of long ones on every
    card, and a running video yields at its next step boundary. This is the policy
    the simulator measured ("ours" in docs/BENCHMARKS.md): an image-only card keeps
    images' P99 a little lower but leaves video three cards at 84-112 % of their
    capacity (videos P99 2-3.3 x FCFS'); under overload the long cap
    (scheduling/overload.py) keeps one card off video instead. `image_cards` of
    them (default 0) serve images only (short, medium), for a fleet whose image
    latency must not depend on the cap. `max_long_cards` caps the cards that run
    long work at all times (the seed's "at most 2 cards on video"): cards beyond
    the cap serve images only. Text
    encode and VAE decode get their own processes, sharing the last card (CPU
    when there is none); the encode process also delivers webhooks. With no GPU, `cpu_workers` CPU processes play the
    cards with the same logic.

    `group_cards` = k > 0 (the seed's pooled layout): cards 0..k-1 form one group
    ("group0", a worker seeing all k cards, one job at a time `group_speedup(k)`
    times faster) on the `interactive` lane: it serves only jobs submitted with
    lane "interactive", of every class; the other N - k cards are laid out as
    above for everything else. On CPU the group is one more process, running its
    jobs on the CPU like the others (no speedup).
    """
    cards = num_gpus if num_gpus > 0 else max(1, cpu_workers)
    workers: list[WorkerSpec] = []
    first = 0
    if group_cards:
        if group_cards < 2 or group_cards not in GROUP_EFFICIENCY:
            raise ValueError(
                f"group_cards must be one of {sorted(k for k in GROUP_EFFICIENCY if k > 1)}, got {group_cards}"
            )
        if num_gpus > 0:
            if group_cards >= num_gpus:
                raise ValueError(
                    f"group_cards ({group_cards}) must leave at least one of the {num_gpus} "
                    "cards single: work without a lane runs there"
                )
            first, cards = group_cards, num_gpus - group_cards
        workers.append(
            WorkerSpec(
                name="group0",
                queues=(SHORT, MEDIUM, LONG),
                lane=INTERACTIVE,
                devices=tuple(range(group_cards)) if num_gpus > 0 else (),
            )
        )
    if image_cards is None:
        image_cards = 0
    if max_long_cards is not None:
        if max_long_cards < 1:
            raise ValueError("max_long_cards must be at least 1: some card has to run long work")
        image_cards = max(image_cards, cards - max_long_cards)
    if not 0 <= image_cards < cards:
        raise ValueError(f"image_cards must be within 0..{cards - 1} for {cards} cards, got {image_cards}")
    for i in range(cards):
        devices = (first + i,) if num_gpus > 0 else ()
        prefix = "gpu" if num_gpus > 0 else "cpu"
        queues = (SHORT, MEDIUM) if i < image_cards else (SHORT, MEDIUM, LONG)
        workers.append(WorkerSpec(name=f"{prefix}{first + i}", queues=queues, devices=devices))
    side = (num_gpus - 1,) if num_gpus > 0 else ()
    workers.append(WorkerSpec(name="encode", queues=(ENCODE, CONTROL, WEBHOOKS), devices=side))
    workers.append(WorkerSpec(name="decode", queues=(DECODE,), devices=side))
    return PoolLayout(tuple(workers))


def parse_layout(data: dict) -> PoolLayout:
    try:
        entries = data["workers"]
        return PoolLayout(
            tuple(
                WorkerSpec(
                    name=str(e["name"]),
                    queues=tuple(e["queues"]),
                    devices=tuple(int(d) for d in e.get("devices", ())),
                    models=tuple(e.get("models", ())),
                    lane=str(e.get("lane", "")),
                )
                for e in entries
            )
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(
            'pool layout must look like {"workers": [{"name": "gpu0", "queues": ["short"], "devices": [0]}]}: '
            f"{exc!r}"
        ) from None


def load_layout(
    spec: str | None,
    num_gpus: int,
    cpu_workers: int = 2,
    image_cards: int | None = None,
    max_long_cards: int | None = None,
    group_cards: int = 0,
) -> PoolLayout:
    """A layout from `spec` (inline JSON, or a .json/.toml file path), else the default."""
    if not spec:
        return default_layout(num_gpus, cpu_workers, image_cards, max_long_cards, group_cards)
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
