"""What the model of the service is parameterised by (`SimConfig`), and the service's chosen policy."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..admission import AdmissionLimits
from ..chunking import DEFAULT_CHUNK_SECONDS
from ..classes import LONG, MEDIUM, SHORT, ClassThresholds
from ..fairness import CUT_AFTER_SECONDS
from ..overload import LongCapPolicy
from ..pools import CONTROL, DECODE, ENCODE, PoolLayout, WorkerSpec
from .workload import DEFAULT_MODELS, DEFAULT_STEPS

# Modelled costs (seconds of card time). A checkpoint of a Wan 480p job (latents
# 16×21×60×104 fp32 plus a two-entry multistep history, 25 MB) saved atomically and
# loaded back took 0.05 s on local disk (bench notes in docs/BENCHMARKS.md); with the
# task round trip and host↔device copies, 0.2 s is a conservative save + restore.
# Loading a model's denoiser onto a card costs ~0.2 s (SDXL UNet, 5 GB) to ~1.1 s (Wan 14B, 29 GB) from
# pinned host memory; 0.5 s is charged per load. A model already resident costs nothing to switch to: the
# denoise worker's model cache (workers/runtime/cache.py) keeps every model it has loaded while their weights
# fit its budget together, least recently used out first. docs/BENCHMARKS.md shows the sensitivity.
DEFAULT_CHECKPOINT_SECONDS = 0.2
DEFAULT_SWITCH_SECONDS = 0.5
# GENSERVER_MODEL_CACHE_BYTES's default (40 GiB a worker), and the denoisers' weights in bf16 from the memory
# plan (`python -m workers.memory_plan --registry bench/full-size.toml`: SDXL's UNet, Wan 2.1 14B's
# transformer): both fit, so a card lent to video and images switches between them for free.
DEFAULT_MODEL_CACHE_GIB = 40.0
DEFAULT_MODEL_GIB: Mapping[str, float] = {"sdxl": 4.78, "wan": 26.67}
# Our policy lends every card to video and caps long work at N−1 cards only under
# overload: while a new long job's expected wait exceeds this share of its limit
# (overload.LongCapPolicy, which lets go below a lower share).
OVERLOAD_ENGAGE_SHARE = LongCapPolicy().engage_share
# Admission's headwind (admission.Headwind) counts the better classes' work that arrived over this window:
# longer is steadier, shorter follows a burst sooner. The live service uses GENSERVER_HEADWIND_WINDOW.
HEADWIND_WINDOW_SECONDS = 900.0


def mixed_layout(num_gpus: int = 4, image_only: int = 0) -> PoolLayout:
    """Cards 0..image_only-1 take short+medium, the others short+medium+long; plus encode/decode.

    `mixed_layout(4, 0)` has the denoise workers of `default_layout(4)` (every card lent to video);
    `mixed_layout(4, 1)` those of `default_layout(4, image_cards=1)`, the image card (`SimConfig`'s default,
    the comparison the benchmarks keep).
    """
    if not 0 <= image_only <= num_gpus:
        raise ValueError(f"image_only must be within 0..{num_gpus}, got {image_only}")
    workers = [
        WorkerSpec(name=f"gpu{i}", devices=(i,), queues=(SHORT, MEDIUM) if i < image_only else (SHORT, MEDIUM, LONG))
        for i in range(num_gpus)
    ]
    workers.append(WorkerSpec(name="encode", queues=(ENCODE, CONTROL)))
    workers.append(WorkerSpec(name="decode", queues=(DECODE,)))
    return PoolLayout(tuple(workers))


@dataclass(frozen=True)
class SimConfig:
    """What the event-driven model of the service is parameterised by.

    layout: the pool layout (default: one image-only card of four, the comparison the
        benchmarks keep; the service's own is `service_policy_config`'s); only workers
        consuming a duration-class queue are denoise cards (encode/decode workers are ignored).
    chunk_seconds: CHUNK_SECONDS, the target GPU time of one chunk.
    checkpoint_seconds: save + restore at a chunk boundary; the save is charged
        at the end of a chunk that is not the last, the restore at the start of
        the next chunk.
    switch_seconds: charged before a chunk whose model is not resident on the card
        (a card's first chunk is free: warm start).
    cache_gib: the denoise worker's model cache budget (GENSERVER_MODEL_CACHE_BYTES): a card keeps
        the models it has run while their weights (`model_gib`) fit it together, least recently used
        out first and the latest always kept, as workers/runtime/cache.py does; 0: one model at a
        time, every change of model a switch (a card with no room for two).
    model_gib: the denoiser weights of each model, GiB (a model not listed counts as over any budget).
    long_cap: at most this many cards run long-class chunks at once (None: no
        cap); a card at the cap does not take from the long queue.
    long_cap_policy: engage the cap only while a new long job's expected wait
        (admission's estimate over the full layout) is above its engage share of
        the long limit, until it falls below its release share (None: the cap
        always holds). While engaged, admission sees the layout without `long` on
        the cards beyond the cap (overload.capped_layout): the capacity a long
        job can count on.
    yield_on_demand: the denoise task as the service runs it (tasks/denoise.py;
        False: re-publish after every chunk). At a chunk boundary the worker looks at the broker
        and re-publishes (yields) only if a message it would take before its
        own continuation is waiting (or the long cap asks it to stop); otherwise
        it runs the next chunk in-process with no restore and no model switch,
        paying `in_process_seconds` for the save kept for crash recovery (None:
        a synchronous save, half of `checkpoint_seconds`; 0: an asynchronous
        one). A yield costs a full save + restore. The order of work is that of
        re-publishing every chunk, less the swaps between started jobs of
        equal priority (classes.yields_to_equal_priority).
    fair_window: the per-user publish window (scheduling/fairness.py, GENSERVER_FAIR_WINDOW live):
        at most this many of a user's jobs published and not yet started per queue, the rest held
        and published (best priority, then oldest) as the user's jobs start; 0: off, first-come.
        The lightest user's new jobs go one priority step ahead (fairness.ahead_priority).
        The simulator has no encode hop: a release is published at the claim that frees the room.
    cut_chunks: a job published ahead (the lightest user's, fairness.ahead_priority) still waiting
        `cut_after` seconds after it was published cuts one busy card's chunk at its next step, a card
        whose job's continuation comes after its message (one card per message; the cut pays a save, the
        job's next chunk the restore), as the denoise task does (tasks/denoise.py).
    limits: admission limits (None: admit everything).
    headwind_window: admission stretches the work ahead by the headwind (the better classes' arrivals over
        this many seconds, and the boundary cost per second of work); None: it counts the work ahead only.
    steps: steps given to a request of each duration (seconds → steps).
    models: the model of each kind (a change of model on a card is a switch).
    """

    layout: PoolLayout = field(default_factory=lambda: mixed_layout(4, 1))
    chunk_seconds: float = DEFAULT_CHUNK_SECONDS
    checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS
    switch_seconds: float = DEFAULT_SWITCH_SECONDS
    cache_gib: float = DEFAULT_MODEL_CACHE_GIB
    model_gib: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MODEL_GIB))
    long_cap: int | None = None
    long_cap_policy: LongCapPolicy | None = None
    yield_on_demand: bool = False
    in_process_seconds: float | None = None
    fair_window: int = 0
    cut_chunks: bool = False
    cut_after: float = CUT_AFTER_SECONDS
    thresholds: ClassThresholds = field(default_factory=ClassThresholds)
    limits: AdmissionLimits | None = field(default_factory=AdmissionLimits)
    headwind_window: float | None = None
    steps: Mapping[float, int] = field(default_factory=lambda: dict(DEFAULT_STEPS))
    models: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_MODELS))

    def __post_init__(self) -> None:
        if self.chunk_seconds <= 0:
            raise ValueError(f"chunk_seconds must be positive, got {self.chunk_seconds}")
        if self.checkpoint_seconds < 0 or self.switch_seconds < 0:
            raise ValueError("checkpoint_seconds and switch_seconds must be >= 0")
        if self.cache_gib < 0:
            raise ValueError(f"cache_gib must be >= 0 (0: one model at a time), got {self.cache_gib}")
        if self.in_process_seconds is not None and not 0 <= self.in_process_seconds <= self.checkpoint_seconds:
            raise ValueError("in_process_seconds must be within 0..checkpoint_seconds")
        if self.fair_window < 0:
            raise ValueError(f"fair_window must be >= 0 (0: off), got {self.fair_window}")
        if self.long_cap is not None and self.long_cap < 0:
            raise ValueError(f"long_cap must be >= 0, got {self.long_cap}")

    def steps_for(self, seconds: float) -> int:
        if seconds in self.steps:
            return self.steps[seconds]
        return 50 if seconds >= self.thresholds.medium else 30


def service_policy_config(num_gpus: int = 4, *, yield_on_demand: bool = False, **overrides: Any) -> SimConfig:
    """The service's scheduling policy as deployed, with its chosen defaults
    (docs/BENCHMARKS.md, "Scheduling policy (simulator)").

    Every card consumes short, medium and long (the image card is lent to
    video), CHUNK_SECONDS = `chunking.DEFAULT_CHUNK_SECONDS`, and under overload
    (a new long job's expected wait above half the long admission limit) at
    most N−1 cards run long work; a job published ahead (the lightest user's) cuts one
    other user's chunk at its next step. `yield_on_demand=True` is the denoise
    task as deployed (tasks/denoise.py): a card keeps its job at a boundary
    unless better work waits, and the checkpoint is written behind the next
    chunk; False re-publishes every chunk, the design the service started from.
    """
    params: dict[str, Any] = dict(
        layout=mixed_layout(num_gpus, 0),
        chunk_seconds=DEFAULT_CHUNK_SECONDS,
        long_cap=max(1, num_gpus - 1),
        long_cap_policy=LongCapPolicy(),
        yield_on_demand=yield_on_demand,
        in_process_seconds=0.0 if yield_on_demand else None,
        headwind_window=HEADWIND_WINDOW_SECONDS,
        cut_chunks=True,
    )
    params.update(overrides)
    return SimConfig(**params)
