"""The GPU benchmark: the four full-size models with random weights, stock diffusers against our stages.

    python -m bench.gpu_bench [--registry bench/full-size.toml] [--models a,b] [--out table.md]
    bench/gpu_check.sh                       # the same, one command, under a time limit

Per model of the registry (default bench/full-size.toml: SDXL base 1.0, FLUX.1-dev,
Wan2.1-T2V 1.3B and 14B in bfloat16), at its benchmark shape (BENCH_SHAPES):

    1. build   each stage's modules once, random weights on CUDA in the entry's dtype,
               through workers.runtime.components.build_stage (the code that loads a real
               checkpoint, with weights="random"); tokenizers are the download-free ones of
               the tiny checkpoints, written next to a copy of the config tree (token ids only)
    2. stock   the diffusers pipeline (StableDiffusionXLPipeline, FluxPipeline, WanPipeline)
               assembled from those modules, timed end to end, its steps timed by callback
    3. ours    the family adapter as a worker loads it, on the same modules (its build_stage
               calls get the prebuilt ones), run as the tasks do: stages.encode → denoise in
               chunks (stages.run_chunk, each saving a checkpoint; the next restores it with
               stages.load_state) → family.decode, timed end to end
    4. resume  the state restored from the middle checkpoint and run to the end again:
               bit-exact against the uninterrupted latents (yes/no)

and prints: step time (stock, ours, ours ÷ stock), end to end ours ÷ stock, checkpoint
save and restore at real size, preview cost ÷ step, decode time, peak memory per stage,
bit-exact resume. Targets (docs/BENCHMARKS.md): ours ÷ stock ≤ 1.03, save + restore ≤ 2 %
of a step, preview ≤ 1 % of a step. Without CUDA it exits 2 at once; `--device cpu
--tiny` runs the same code on the tiny checkpoints (what tests/bench runs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.gpu_smoke import NO_GPU_STATUS, StepTimer, preview_seconds, release, run_chunk_timed, size
from bench.runtime import PROMPT, encode_one, load_family, make_request, median, ms, quiet_loading, timed
from genserver.registry import ModelSpec, load_registry
from genserver.storage import LocalStorage
from workers.runtime import components, stages
from workers.runtime.base import Family, GenerationRequest

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REGISTRY = REPO_ROOT / "bench" / "full-size.toml"
CHUNKS = 4  # our denoise runs as this many chunks, each ending in a checkpoint
ROUNDS = 3  # stock and ours alternate this many times for a model whose stock call is short …
REPEAT_BELOW_SECONDS = 10.0  # … under this (the images: seconds more; the videos run once, as the 8 minutes need)
SEED = 1234
# name → (width, height, frames, steps): the brief's default shapes; Wan at fewer steps so the
# whole run (four models, stock and ours, plus a resume) stays within 8 minutes on one card.
BENCH_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "sdxl-base-1.0": (1024, 1024, 1, 30),
    "flux.1-dev": (1024, 1024, 1, 28),
    "wan2.1-t2v-1.3b": (832, 480, 81, 8),
    "wan2.1-t2v-14b": (832, 480, 81, 4),
}
# --tiny: the tiny checkpoints (weights from their files) at a tiny shape: (steps, (width, height, frames)).
TINY: dict[str, tuple[int, tuple[int, int, int]]] = {
    "tiny-sdxl": (4, (64, 64, 1)),
    "tiny-flux": (4, (64, 64, 1)),
    "tiny-wan": (4, (64, 64, 9)),
}
STOCK_PIPELINES = {"unet": "StableDiffusionXLPipeline", "flux": "FluxPipeline", "wan": "WanPipeline"}


# 1. build --------------------------------------------------------------------------------------


def config_tree_with_tokenizers(spec: ModelSpec, into: Path, data_dir: Path | None = None) -> ModelSpec:
    """The entry with an absolute path; where a tokenizer folder holds no tokenizer files (the
    config-only trees), a copy of its configs under `into` with the tiny checkpoints' download-free
    tokenizers written in (random weights need token ids only; the sequence lengths, 77 for CLIP
    and 512 for T5 / UMT5, are the real ones)."""
    source = components.checkpoint_dir(spec, data_dir).resolve()
    spec = dataclasses.replace(spec, path=str(source))
    bare = [
        name
        for name, cls in components.stage_components(spec, "encode").items()
        if components.is_tokenizer(cls) and not any((source / name).glob("*.json"))
    ]
    if not bare:
        return spec
    tree = into / spec.name
    shutil.copytree(
        source, tree, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.pth"), dirs_exist_ok=True
    )  # dirs_exist_ok: a model named twice in --models (a second sample) reuses its tree
    for name in bare:
        download_free_tokenizer(spec.family, name, tree / name).save_pretrained(tree / name)
    return dataclasses.replace(spec, path=str(tree))


def download_free_tokenizer(family: str, name: str, folder: Path) -> Any:
    from workers.runtime import tiny_models, tiny_wan
    from workers.runtime.tiny_t5 import tiny_t5_tokenizer

    if family == "wan":
        return tiny_t5_tokenizer(tiny_wan.WORDS)
    if family == "flux" and name == "tokenizer_2":
        return tiny_t5_tokenizer(tiny_models.T5_WORDS)
    # SDXL's second CLIP tokenizer pads with "!" (OpenCLIP's choice), the first with its end token.
    return tiny_models._tiny_tokenizer(folder, pad_token="!" if name == "tokenizer_2" else None)


def build_modules(spec: ModelSpec, device: str, weights: str) -> dict[str, dict[str, Any]]:
    """{stage: {component: module or tokenizer}}, each stage built once (seeded: repeatable)."""
    built = {}
    for index, stage in enumerate(components.STAGES):
        torch.manual_seed(SEED + index)
        built[stage] = components.build_stage(spec, stage, device=device, weights=weights)
    return built


@contextlib.contextmanager
def prebuilt(modules: dict[str, dict[str, Any]]) -> Iterator[None]:
    """While open, every build_stage call (the family adapters' loaders) returns the prebuilt modules:
    our stages run on the very modules the stock pipeline holds."""
    import importlib

    def build_stage(spec: ModelSpec, stage: str, **_: Any) -> dict[str, Any]:
        return modules[stage]

    patched = []
    for module_name in (
        "workers.runtime.components",
        "workers.runtime.unet",
        "workers.runtime.flux",
        "workers.runtime.wan",
    ):
        module = importlib.import_module(module_name)
        if hasattr(module, "build_stage"):
            patched.append((module, module.build_stage))
            module.build_stage = build_stage
    try:
        yield
    finally:
        for module, original in patched:
            module.build_stage = original


# 2. stock ------------------------------------------------------------------------------------


def stock_pipeline(spec: ModelSpec, modules: dict[str, dict[str, Any]], device: str) -> Any:
    import diffusers

    root = components.checkpoint_dir(spec)
    cls = getattr(diffusers, STOCK_PIPELINES[spec.family])
    scheduler_class = getattr(diffusers, components.read_config(root, "scheduler")["_class_name"])
    scheduler = scheduler_class.from_pretrained(root / "scheduler", local_files_only=True)
    parts = {name: module for stage in modules.values() for name, module in stage.items()}
    if spec.family == "unet":
        parts.setdefault("text_encoder_2", None)
        parts.setdefault("tokenizer_2", None)
    pipe = cls(scheduler=scheduler, **parts).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_stock(spec: ModelSpec, pipe: Any, request: GenerationRequest, device: str) -> tuple[float, list[float]]:
    """(end-to-end seconds, seconds of each step) of one stock pipeline call at the request's shape."""
    marks: list[float] = []

    def on_step_end(pipeline: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        marks.append(time.perf_counter())
        return kwargs

    call: dict[str, Any] = {
        "prompt": request.prompt,
        "height": request.height,
        "width": request.width,
        "num_inference_steps": request.steps,
        "guidance_scale": request.guidance_scale,
        "generator": torch.Generator("cpu").manual_seed(request.seed),
        "callback_on_step_end": on_step_end,
    }
    if spec.family != "flux":
        call["negative_prompt"] = request.negative_prompt
    if spec.family == "wan":
        call.update(num_frames=request.num_frames, output_type="np")
    (_, total) = timed(lambda: pipe(**call), device)
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return total, steps


# 3. ours, 4. resume --------------------------------------------------------------------------


@dataclass
class BenchResult:
    spec: ModelSpec
    request: GenerationRequest
    stock_total_s: float
    stock_step_s: float
    ours_total_s: float
    ours_step_s: float
    save_s: float
    restore_s: float
    preview_s: float
    decode_s: float
    peaks: dict[str, int | None]  # per stage, above what was resident when it began
    weights: dict[str, int]  # bytes of each stage's modules
    bit_exact: bool
    rounds: int = 1  # stock and ours each ran this many times, alternating (the figures are medians)

    def row(self) -> str:
        r = self
        cells = [
            r.spec.name,
            shape_text(r.request),
            str(r.request.steps),
            f"{ms(r.stock_step_s)} / {ms(r.ours_step_s)} ({r.ours_step_s / r.stock_step_s:.3f})",
            f"{r.stock_total_s:.2f} / {r.ours_total_s:.2f} ({r.ours_total_s / r.stock_total_s:.3f})",
            f"{ms(r.save_s)} / {ms(r.restore_s)} ({(r.save_s + r.restore_s) / r.ours_step_s:.2%})",
            f"{ms(r.preview_s)} ({r.preview_s / r.ours_step_s:.2%})",
            ms(r.decode_s),
            " / ".join(size(r.weights[s]) for s in components.STAGES),
            " / ".join(size(r.peaks[s]) for s in components.STAGES),
            "yes" if r.bit_exact else "NO",
            str(r.rounds),
        ]
        return "| " + " | ".join(cells) + " |"


TABLE_HEADER = (
    "| model | shape | steps | step ms stock / ours (÷) | end to end s stock / ours (÷) "
    "| checkpoint save / restore ms (÷ step) | preview ms (÷ step) | decode ms "
    "| weights encode / denoise / decode | peak above resident: encode / denoise / decode "
    "| bit-exact resume | rounds |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN included: random full-size weights may overflow, and NaN != NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().cpu().contiguous().view(as_int), b.detach().cpu().contiguous().view(as_int))


def shape_text(request: GenerationRequest) -> str:
    frames = f"×{request.num_frames}" if request.num_frames > 1 else ""
    return f"{request.width}×{request.height}{frames}"


@contextlib.contextmanager
def stage_peak(device: str, peaks: dict[str, int | None], stage: str) -> Iterator[None]:
    """peaks[stage]: the most memory allocated during the block above what was resident when it began
    (the stage's activations and transients; every stage's weights are already on the card)."""
    if not device.startswith("cuda"):
        peaks[stage] = None
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)
    yield
    torch.cuda.synchronize(device)
    peaks[stage] = torch.cuda.max_memory_allocated(device) - resident


@dataclass
class OursRun:
    """One run of our stages: encode → chunks (each saved; the next one's restore timed) → decode."""

    total_s: float
    step_seconds: list[float]
    saves: list[float]
    restores: list[float]
    decode_s: float
    peaks: dict[str, int | None]
    state: Any
    encoded_key: str
    middle_key: str


def run_ours(family: Family, storage: LocalStorage, request: GenerationRequest, device: str) -> OursRun:
    peaks: dict[str, int | None] = {}
    started = time.perf_counter()
    with stage_peak(device, peaks, "encode"):
        encoded = encode_one(family, storage, request)
    with stage_peak(device, peaks, "denoise"):
        state = stages.load_state(family, storage, request, encoded.key, "")
        timer = StepTimer(family)
        bounds = sorted({max(1, round(request.steps * (i + 1) / CHUNKS)) for i in range(CHUNKS)})
        saves, restores, middle = [], [], ""
        for bound in bounds:
            result, save_s = run_chunk_timed(timer, storage, state, bound)
            saves.append(save_s)
            if not middle and bound >= request.steps // 2:
                middle = result.checkpoint_key
            if bound < request.steps:
                # What the next chunk's task pays on another worker: restore from the checkpoint.
                # The run goes on in memory, so its end is the uninterrupted reference for the resume.
                restore = functools.partial(
                    stages.load_state, family, storage, request, encoded.key, result.checkpoint_key
                )
                _, restore_s = timed(restore, device)
                restores.append(restore_s)
    with stage_peak(device, peaks, "decode"):
        _, decode_s = timed(lambda: family.decode(state), device)
    total = time.perf_counter() - started
    return OursRun(total, timer.step_seconds, saves, restores, decode_s, peaks, state, encoded.key, middle)


def bench_model(
    spec: ModelSpec,
    request: GenerationRequest,
    device: str,
    weights: str,
    storage: LocalStorage,
    rounds: int = ROUNDS,
) -> BenchResult:
    """One model: build once; the stock pipeline and our stages on the same modules, alternating (up to
    `rounds` times while a stock call takes under REPEAT_BELOW_SECONDS); a resume check."""
    modules = build_modules(spec, device, weights)
    pipe = stock_pipeline(spec, modules, device)
    run_stock(spec, pipe, dataclasses.replace(request, steps=1), device)  # warm-up: kernels, allocator
    with prebuilt(modules):
        family = load_family(spec, device, REPO_ROOT / "var")
    shared = {name: m for stage in modules.values() for name, m in stage.items()}
    if any(family.components.get(name) is not module for name, module in shared.items()):
        raise RuntimeError(
            f"{spec.name}: the family adapter did not get the stock pipeline's modules "
            "(its loaders no longer go through components.build_stage?)"
        )
    stock_totals: list[float] = []
    stock_steps: list[float] = []
    runs: list[OursRun] = []
    # A short step (SDXL's ~70 ms at 1024²) is bound by the host launching kernels, and one run of each
    # moved its ratio from 0.82 to 1.56 across three machines: alternate, and report medians.
    for round_ in range(max(1, rounds)):
        total, steps = run_stock(spec, pipe, request, device)
        stock_totals.append(total)
        stock_steps.extend(steps)
        # A store of its own each round: every round encodes, as the stock call does.
        runs.append(run_ours(family, LocalStorage(storage.root / f"round-{round_}"), request, device))
        if total >= REPEAT_BELOW_SECONDS:
            break
    del pipe
    last = runs[-1]
    preview_s = preview_seconds(family, last.state)
    # 4. resume: from the middle checkpoint to the end again, against the uninterrupted latents.
    last_storage = LocalStorage(storage.root / f"round-{len(runs) - 1}")
    resumed = stages.load_state(family, last_storage, request, last.encoded_key, last.middle_key)
    stages.run_chunk(
        family,
        last_storage,
        resumed,
        until_step=request.steps,
        preview_every=0,
        should_stop=lambda step: "",
        on_preview=lambda key, step: None,
    )
    bit_exact = bitwise_equal(last.state.latents, resumed.latents)
    restores = [s for run in runs for s in run.restores]
    return BenchResult(
        spec,
        request,
        median(stock_totals),
        median(stock_steps),
        median([run.total_s for run in runs]),
        median([s for run in runs for s in run.step_seconds]),
        median([s for run in runs for s in run.saves]),
        median(restores) if restores else float("nan"),
        preview_s,
        median([run.decode_s for run in runs]),
        last.peaks,
        {stage: sum(components.component_bytes(m) for m in built.values()) for stage, built in modules.items()},
        bit_exact,
        len(runs),
    )


def bench_request(
    spec: ModelSpec, steps: int | None = None, shape: tuple[int, int, int] | None = None
) -> GenerationRequest:
    width, height, frames, default_steps = BENCH_SHAPES.get(
        spec.name, (spec.defaults.width, spec.defaults.height, spec.defaults.num_frames, spec.defaults.steps)
    )
    if shape:
        width, height, frames = shape
    return dataclasses.replace(
        make_request(
            spec,
            f"bench-{spec.name}",
            PROMPT,
            steps=steps or default_steps,
            width=width,
            height=height,
            num_frames=frames,
        ),
        seed=SEED,
    )


# The command line ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", default=str(DEFAULT_REGISTRY))
    parser.add_argument("--models", default="", help="comma-separated entries (default: every diffusers entry)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--weights",
        default="random",
        choices=("random", "checkpoint"),
        help="random (the config-only trees) or checkpoint (real or tiny weights)",
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoints at a tiny shape (CPU check)")
    parser.add_argument("--out", default=os.environ.get("OUT", ""), help="also write the table to this folder")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"bench.gpu_bench: no CUDA GPU is visible (torch {torch.__version__}); nothing run. "
            "Run bench/gpu_check.sh on a machine with a GPU.",
            file=sys.stderr,
        )
        return NO_GPU_STATUS
    quiet_loading()
    registry = load_registry(None if args.tiny else args.registry)
    names = [n for n in args.models.split(",") if n] or (
        list(TINY) if args.tiny else [n for n, s in registry.models.items() if s.backend == "diffusers"]
    )
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    weights = "tiny checkpoints'" if args.tiny else args.weights
    table = Table(Path(args.out) / "gpu_bench.md" if args.out else None)
    table.add(f"# bench.gpu_bench on {device}, torch {torch.__version__}, {weights} weights")
    table.add(TABLE_HEADER)
    failed = False
    with tempfile.TemporaryDirectory(prefix="genserver-gpu-bench-") as tmp:
        storage, data_dir = LocalStorage(Path(tmp) / "storage"), None
        if args.tiny:
            from workers.runtime.tiny_models import ensure_tiny_models

            data_dir = Path(tmp) / "data"
            ensure_tiny_models(data_dir / "models")
        for name in names:  # cheapest first (the registry's order), each row printed when it is done
            print(f"# {name}: building on {args.device} …", file=sys.stderr, flush=True)
            try:
                spec = config_tree_with_tokenizers(registry.get(name), Path(tmp), data_dir)
                request = bench_request(spec, *TINY[name]) if args.tiny else bench_request(spec)
                result = bench_model(spec, request, args.device, "checkpoint" if args.tiny else args.weights, storage)
                table.add(result.row())
            except Exception as exc:  # noqa: BLE001 (report every model, then fail)
                import traceback

                traceback.print_exc(file=sys.stderr)
                table.add(f"FAILED {name}: {type(exc).__name__}: {exc}")
                failed = True
            release(args.device)
    return 1 if failed else 0


class Table:
    """The result table, printed line by line (a run cut short by its time limit keeps what it
    finished) and mirrored to a file when one is given."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def add(self, line: str) -> None:
        print(line, flush=True)
        if self.path:
            with self.path.open("a") as file:
                file.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
