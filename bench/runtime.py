"""What the runtime's stages cost on the CPU with the tiny models, side by side.

    .venv/bin/python -m bench.runtime [--repeats 8] [--steps 10] [--threads 1] [--models tiny-sd,tiny-wan]

No Django, no database, no Celery: the registry is read with `load_registry()`,
the tiny checkpoints are written into a temporary directory
(`ensure_tiny_models`), storage is a `LocalStorage` there, and each model is
loaded through its family adapter on the CPU. Every model is loaded first; then
each round runs one job per model, the models interleaved (so a busy moment on
the shared machine hits them all alike). A job goes through the stages:

    encode      stages.encode of a fresh prompt (a miss: text encoders + put),
                then again (a hit: only a storage check)
    prepare     stages.load_state without a checkpoint
    steps       family.step, each timed; after each, family.preview (timed), and the
                preview as run_chunk publishes it (PNG + storage.put, timed)
    boundary    halfway and at the end, stages.run_chunk with no step left to run,
                which only saves the checkpoint (torch.save + atomic put); halfway,
                stages.load_state from that checkpoint (the restore a resumed chunk pays)
    decode      stages.decode (restore + VAE + PNG, or for video frames + MP4 +
                poster), and family.decode alone (the VAE's share)

A first round warms every model up and is discarded. The table gives medians:
per step over all steps of all rounds, otherwise per round (the checkpoint save
over both boundaries). The cost model's estimate of a step
(`estimate_job_seconds` with the registry's `cost_points`, at 450 effective
TFLOPS as the registry's calibration assumes) sits next to the measured step.

Torch runs with one thread by default (--threads): the development machine has
two shared cores, and the tiny models gain little from intra-op threads.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

from genserver.registry import ModelSpec, Registry, load_registry
from genserver.scheduling.cost import DEFAULT_EFFECTIVE_TFLOPS, JobShape, estimate_job_seconds
from genserver.storage import LocalStorage
from workers.runtime import stages
from workers.runtime.base import DenoiseState, Family, GenerationRequest
from workers.runtime.cache import FAMILY_ADAPTERS
from workers.runtime.tiny_models import ensure_tiny_models

T = TypeVar("T")

DEFAULT_REPEATS = 8
DEFAULT_STEPS = 10  # per job; × repeats = the steps behind each median
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
NEGATIVE = "blurry, low quality"


# Shared with bench.gpu_smoke -------------------------------------------------


def sync(device: str) -> None:
    """Wait for queued GPU work, so a wall-clock reading covers it (no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: str = "cpu") -> tuple[T, float]:
    """(fn(), seconds it took), the device's queued work included."""
    sync(device)
    started = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - started


def load_family(spec: ModelSpec, device: str, data_dir: Path) -> Family:
    """The registry entry's diffusers adapter (as ModelCache loads it), on `device`."""
    if spec.backend != "diffusers":
        raise ValueError(f"model {spec.name!r} is {spec.backend}, not a diffusers entry")
    module_name, class_name = FAMILY_ADAPTERS[spec.family].split(":")
    adapter = getattr(importlib.import_module(module_name), class_name)
    return adapter(spec, device, data_dir)


FAMILY_ORDER = ("unet", "flux", "wan")


def tiny_model_names(registry: Registry) -> list[str]:
    """The registry's diffusers entries on the tiny checkpoints: images first, then video."""
    names = [name for name, spec in registry.models.items() if spec.backend == "diffusers" and name.startswith("tiny-")]
    rank = {family: index for index, family in enumerate(FAMILY_ORDER)}
    return sorted(names, key=lambda n: (rank.get(registry.models[n].family, len(rank)), n))


def quiet_loading() -> None:
    """No per-component progress bars from transformers / diffusers while weights load."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()


def make_request(
    spec: ModelSpec,
    job_id: str,
    prompt: str,
    *,
    steps: int | None = None,
    width: int | None = None,
    height: int | None = None,
    num_frames: int | None = None,
) -> GenerationRequest:
    """A one-output job at the entry's defaults, unless told otherwise."""
    d = spec.defaults
    return GenerationRequest(
        job_id=job_id,
        model=spec.name,
        prompt=prompt,
        negative_prompt=NEGATIVE,
        width=width or d.width,
        height=height or d.height,
        num_frames=(num_frames or d.num_frames) if spec.kind == "video" else 1,
        steps=steps or d.steps,
        guidance_scale=d.guidance_scale,
        seed=1234,
        num_outputs=1,
    )


def job_shape(spec: ModelSpec, request: GenerationRequest) -> JobShape:
    return JobShape(
        spec.family,
        request.width,
        request.height,
        request.num_frames,
        request.steps,
        request.guidance_scale,
        request.num_outputs,
    )


def estimated_step_seconds(
    spec: ModelSpec, request: GenerationRequest, effective_tflops: float = DEFAULT_EFFECTIVE_TFLOPS
) -> float:
    """The cost model's seconds per step for this request (what admission and chunking use)."""
    return estimate_job_seconds(job_shape(spec, request), spec.cost_points, effective_tflops) / request.steps


def shape_label(spec: ModelSpec, request: GenerationRequest) -> str:
    """'64×64 (16 tok × 2)': pixels (× frames), and the cost model's tokens × passes per step."""
    shape = job_shape(spec, request)
    size = f"{request.width}×{request.height}"
    if spec.kind == "video":
        size += f"×{request.num_frames}"
    return f"{size} ({shape.tokens()} tok × {shape.cfg_passes()})"


def encode_one(family: Family, storage: LocalStorage, request: GenerationRequest) -> stages.EncodeResult:
    """stages.encode for one request (the stage takes a batch of requests)."""
    (result,) = stages.encode(family, storage, [request])
    return result


def never_stop(step: int) -> str:
    return ""


def ignore_preview(key: str, step: int) -> None:
    return None


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# The CPU benchmark -----------------------------------------------------------


@dataclass
class Samples:
    """Seconds per measurement, over the counted rounds."""

    step: list[float] = field(default_factory=list)
    preview: list[float] = field(default_factory=list)
    preview_published: list[float] = field(default_factory=list)
    encode_miss: list[float] = field(default_factory=list)
    encode_hit: list[float] = field(default_factory=list)
    save: list[float] = field(default_factory=list)
    restore: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    vae: list[float] = field(default_factory=list)
    checkpoint_bytes: list[int] = field(default_factory=list)


@dataclass
class ModelBench:
    spec: ModelSpec
    family: Family
    load_seconds: float
    samples: Samples = field(default_factory=Samples)


def publish_preview(family: Family, storage: LocalStorage, state: DenoiseState) -> None:
    """What run_chunk does every `preview_every` steps: preview → PNG → storage."""
    buf = io.BytesIO()
    family.preview(state).save(buf, format="PNG")
    storage.put(f"previews/{state.request.job_id}/preview.png", buf.getvalue())


def save_checkpoint(bench: ModelBench, storage: LocalStorage, state: DenoiseState, keep: bool) -> str:
    """A chunk boundary's save through run_chunk (no step left to run, so it only saves)."""
    result, seconds = timed(
        lambda: stages.run_chunk(
            bench.family,
            storage,
            state,
            until_step=state.step,
            preview_every=0,
            should_stop=never_stop,
            on_preview=ignore_preview,
        )
    )
    if keep:
        bench.samples.save.append(seconds)
        bench.samples.checkpoint_bytes.append(storage.path(result.checkpoint_key).stat().st_size)
    return result.checkpoint_key


def run_round(bench: ModelBench, storage: LocalStorage, steps: int, round_index: int, keep: bool) -> None:
    """One job of `steps` steps through the stages, every part timed; `keep` records the times."""
    family, s = bench.family, bench.samples
    request = make_request(
        bench.spec, f"bench-{bench.spec.name}-{round_index}", f"{PROMPT}, take {round_index}", steps=steps
    )
    miss, miss_s = timed(lambda: encode_one(family, storage, request))
    hit, hit_s = timed(lambda: encode_one(family, storage, request))
    if miss.cache_hit or not hit.cache_hit:
        raise RuntimeError(
            f"{bench.spec.name}: expected an encode miss then a hit, got {miss.cache_hit} then {hit.cache_hit}"
        )
    state = stages.load_state(family, storage, request, miss.key, "")
    step_s: list[float] = []
    preview_s: list[float] = []
    published_s: list[float] = []
    restore_s = 0.0
    for _ in range(steps):
        step_s.append(timed(partial(family.step, state))[1])
        preview_s.append(timed(partial(family.preview, state))[1])
        published_s.append(timed(partial(publish_preview, family, storage, state))[1])
        if state.step == steps // 2:
            key = save_checkpoint(bench, storage, state, keep)
            state, restore_s = timed(partial(stages.load_state, family, storage, request, miss.key, key))
    final_key = save_checkpoint(bench, storage, state, keep)
    _, decode_s = timed(lambda: stages.decode(family, storage, request, checkpoint_ref=final_key))
    _, vae_s = timed(lambda: family.decode(state))
    for prefix in ("checkpoints", "previews", "outputs"):
        storage.delete_prefix(f"{prefix}/{request.job_id}")
    if keep:
        s.step += step_s
        s.preview += preview_s
        s.preview_published += published_s
        s.encode_miss.append(miss_s)
        s.encode_hit.append(hit_s)
        s.restore.append(restore_s)
        s.decode.append(decode_s)
        s.vae.append(vae_s)


def ms(seconds: float) -> str:
    value = seconds * 1000
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def table_row(bench: ModelBench, steps: int) -> str:
    spec, s = bench.spec, bench.samples
    request = make_request(spec, "shape", PROMPT, steps=steps)
    step, estimate = median(s.step), estimated_step_seconds(spec, request)
    preview, published, decode = median(s.preview), median(s.preview_published), median(s.decode)
    cells = [
        spec.name,
        f"{spec.family} / {spec.scheduler}",
        shape_label(spec, request),
        ms(step),
        ms(estimate),
        f"{step / estimate:.2f}",
        f"{ms(preview)} ({preview / step:.2f})",
        f"{ms(published)} ({published / step:.2f})",
        f"{ms(median(s.encode_miss))} / {ms(median(s.encode_hit))}",
        f"{ms(median(s.save))} / {ms(median(s.restore))} ({median(s.checkpoint_bytes) / 1024:.0f} KB)",
        f"{ms(decode)} ({ms(median(s.vae))})",
        f"{decode / step:.1f}",
        f"{bench.load_seconds:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


TABLE_HEADER = (
    "| model | family / scheduler | shape (tokens × passes) | step ms | cost model ms | measured ÷ model "
    "| preview ms (÷ step) | preview + PNG + put ms (÷ step) | encode miss / hit ms "
    "| checkpoint save / restore ms (size) | decode ms (VAE alone) | decode ÷ step | load s |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def machine_note(threads: int) -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{threads} thread{'s' if threads != 1 else ''}, Python {platform.python_version()}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.runtime", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"counted rounds (one job per model each) after a warm-up round (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"denoising steps per job (default {DEFAULT_STEPS})"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument(
        "--models", default="", help="comma-separated registry names (default: every tiny-* diffusers entry)"
    )
    parser.add_argument("--registry", default=None, help="registry TOML (default: the bundled one)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 2:
        parser.error("--repeats must be ≥ 1 and --steps ≥ 2 (a checkpoint goes in the middle)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_loading()
    registry = load_registry(args.registry)
    names = [n.strip() for n in args.models.split(",") if n.strip()] or tiny_model_names(registry)
    specs = [registry.get(name) for name in names]
    with tempfile.TemporaryDirectory(prefix="genserver-bench-runtime-") as tmp:
        data_dir = Path(tmp)
        ensure_tiny_models(data_dir / "models")
        storage = LocalStorage(data_dir / "storage")
        benches = []
        for spec in specs:
            family, seconds = timed(partial(load_family, spec, "cpu", data_dir))
            benches.append(ModelBench(spec, family, seconds))
        started = time.perf_counter()
        for round_index in range(args.repeats + 1):  # round 0 warms up and is discarded
            for bench in benches:
                run_round(bench, storage, args.steps, round_index, keep=round_index > 0)
        elapsed = time.perf_counter() - started
    print(f"# bench.runtime: {machine_note(args.threads)}")
    print(
        f"# {args.repeats} rounds × {args.steps} steps per model after a warm-up round, "
        f"models interleaved; {elapsed:.0f} s of measuring. Medians."
    )
    print(TABLE_HEADER)
    for bench in benches:
        print(table_row(bench, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
