"""A smoke run of the real runtime on a GPU with real local checkpoints: one job per model.

    python -m bench.gpu_smoke --registry my-registry.toml [--models a,b,c] [--data-dir DIR]
                              [--steps N] [--size WxH] [--frames F]
    python -m bench.gpu_smoke --tiny --device cpu     # the tiny checkpoints: exercises the script anywhere

Each listed diffusers entry of the registry is loaded on the device through its
family adapter (the same classes the workers use) and runs one job through the
stages, as the Celery tasks do:

    encode (stages.encode) → chunk 1 (stages.run_chunk to half the steps, which
    saves a checkpoint) → restore (stages.load_state from it) → chunk 2 (to the
    end, saves again) → decode (stages.decode: restore, VAE, PNG or MP4)

and prints, per model: load and encode seconds, the step times (median and
first: the first pays lazy initialisation and kernel selection), the cost of
`family.preview` after a step, the checkpoint save (a chunk's wall time minus
its steps) and restore, the decode time, and torch.cuda.max_memory_allocated
over the model's load and job. Every step is timed between two
torch.cuda.synchronize calls. A model that fails (missing checkpoint,
non-finite latents, an exception) is reported and the exit status is 1; with no
CUDA GPU visible the script stops at once with status 2.

The adapters run float32 (exact resumption first), so real-model figures are
float32 figures: more memory and slower steps than a bf16 deployment.

`--tiny` writes the tiny checkpoints into a temporary directory and uses the
bundled registry's tiny-* entries (unless --registry is given too); with
`--device cpu` the whole script runs without a GPU. No test imports this module.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.runtime import (
    PROMPT,
    encode_one,
    ignore_preview,
    load_family,
    make_request,
    median,
    ms,
    never_stop,
    quiet_loading,
    shape_label,
    timed,
    tiny_model_names,
)
from genserver import config
from genserver.registry import ModelSpec, Registry, load_registry
from genserver.storage import LocalStorage
from workers.runtime import stages
from workers.runtime.base import DenoiseState, Family, GenerationRequest
from workers.runtime.tiny_models import ensure_tiny_models

REPO_ROOT = Path(__file__).resolve().parents[1]
PREVIEW_SAMPLES = 5
NO_GPU_STATUS = 2


class StepTimer:
    """A family whose `step` is timed (device-synchronised); everything else is the family's.

    Handed to stages.run_chunk in place of the family, so the chunk runs exactly
    as in a worker while each step's seconds are recorded.
    """

    def __init__(self, family: Family) -> None:
        self._family = family
        self.step_seconds: list[float] = []

    def step(self, state: DenoiseState) -> None:
        _, seconds = timed(lambda: self._family.step(state), self._family.device)
        self.step_seconds.append(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._family, name)


@dataclass
class SmokeResult:
    spec: ModelSpec
    request: GenerationRequest
    device: str
    load_s: float
    encode_s: float
    steps_s: list[float]
    preview_s: float
    save_s: float
    restore_s: float
    decode_s: float
    outputs: int
    peak_bytes: int | None
    weights_bytes: int


def run_chunk_timed(
    timer: StepTimer, storage: LocalStorage, state: DenoiseState, until_step: int
) -> tuple[stages.ChunkResult, float]:
    """stages.run_chunk up to `until_step`; (result, seconds of the chunk not spent in steps: the save)."""
    before = len(timer.step_seconds)
    result, wall = timed(
        lambda: stages.run_chunk(
            timer,
            storage,
            state,
            until_step=until_step,
            preview_every=0,  # type: ignore[arg-type]
            should_stop=never_stop,
            on_preview=ignore_preview,
        ),
        timer.device,
    )
    if result.stopped or result.step != until_step:
        raise RuntimeError(f"chunk stopped at step {result.step} ({result.stopped or 'no reason'})")
    return result, wall - sum(timer.step_seconds[before:])


def preview_seconds(family: Family, state: DenoiseState) -> float:
    """Median seconds of family.preview on the state just after a step."""
    return median([timed(lambda: family.preview(state), family.device)[1] for _ in range(PREVIEW_SAMPLES)])


def check_finite(spec: ModelSpec, state: DenoiseState) -> None:
    if not torch.isfinite(state.latents).all():
        raise RuntimeError(f"{spec.name}: the final latents hold NaN or inf")


def smoke_one(
    spec: ModelSpec, device: str, data_dir: Path, storage: LocalStorage, overrides: dict[str, int | None]
) -> SmokeResult:
    """Load `spec` on `device` and run one job through the stages, timing each part."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    family, load_s = timed(lambda: load_family(spec, device, data_dir), device)
    request = make_request(spec, f"smoke-{spec.name}", PROMPT, **overrides)
    if request.steps < 2:
        raise ValueError(f"{spec.name}: a smoke job needs at least 2 steps (a checkpoint goes in the middle)")
    encoded, encode_s = timed(lambda: encode_one(family, storage, request), device)
    state = stages.load_state(family, storage, request, encoded.key, "")
    timer = StepTimer(family)
    first, save_1 = run_chunk_timed(timer, storage, state, request.steps // 2)
    preview_s = preview_seconds(family, state)
    state, restore_s = timed(
        lambda: stages.load_state(family, storage, request, encoded.key, first.checkpoint_key), device
    )
    last, save_2 = run_chunk_timed(timer, storage, state, request.steps)
    check_finite(spec, state)
    outputs, decode_s = timed(
        lambda: stages.decode(family, storage, request, checkpoint_ref=last.checkpoint_key),
        device,
    )
    if not outputs:
        raise RuntimeError(f"{spec.name}: decode produced no output")
    peak = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
    return SmokeResult(
        spec,
        request,
        device,
        load_s,
        encode_s,
        timer.step_seconds,
        preview_s,
        median([save_1, save_2]),
        restore_s,
        decode_s,
        len(outputs),
        peak,
        family.memory_bytes(),
    )


def release(device: str) -> None:
    """Drop the last model's tensors before the next one loads (peak memory is per model)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def size(value: int | None) -> str:
    """Bytes in GiB, or MiB below one GiB (the tiny models); n/a without a GPU."""
    if value is None:
        return "n/a"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


TABLE_HEADER = (
    "| model | family / scheduler | device | shape (tokens × passes) | steps | load s | encode ms "
    "| step ms median / first | preview ms (÷ step) | checkpoint save / restore ms | decode ms "
    "| peak GPU memory | weights |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(r: SmokeResult) -> str:
    step = median(r.steps_s)
    cells = [
        r.spec.name,
        f"{r.spec.family} / {r.spec.scheduler}",
        r.device,
        shape_label(r.spec, r.request),
        str(r.request.steps),
        f"{r.load_s:.2f}",
        ms(r.encode_s),
        f"{ms(step)} / {ms(r.steps_s[0])}",
        f"{ms(r.preview_s)} ({r.preview_s / step:.2f})",
        f"{ms(r.save_s)} / {ms(r.restore_s)}",
        ms(r.decode_s),
        size(r.peak_bytes),
        size(r.weights_bytes),
    ]
    return "| " + " | ".join(cells) + " |"


def parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in text.lower().replace("×", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size wants WIDTHxHEIGHT, e.g. 1024x1024; got {text!r}") from None
    return width, height


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--registry", default=None, help="registry TOML with the diffusers entries (default: the bundled one)"
    )
    parser.add_argument(
        "--models",
        default="",
        help="comma-separated entries (default: every diffusers entry; with --tiny, the tiny-* ones)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="use the tiny checkpoints, generated into a temporary directory"
    )
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="what {data_dir} in the registry's paths stands for (default $GENSERVER_DATA_DIR, else ./var)",
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per job (default: the entry's default)")
    parser.add_argument("--size", type=parse_size, default=None, help="WIDTHxHEIGHT (default: the entry's)")
    parser.add_argument("--frames", type=int, default=None, help="frames of a video job (default: the entry's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads with --device cpu (default 1)")
    return parser.parse_args(argv)


def require_device(device: str) -> str | None:
    """None if `device` is usable, else the message to exit with."""
    if not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return (
            f"bench.gpu_smoke: no CUDA GPU is visible (torch {torch.__version__}, built with CUDA "
            f"{torch.version.cuda or 'none'}). Run it on a machine with a GPU, or exercise the "
            f"script on the CPU with `--tiny --device cpu`."
        )
    return None


def select_models(registry: Registry, names: str, tiny: bool) -> list[ModelSpec]:
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    if not chosen:
        chosen = (
            tiny_model_names(registry) if tiny else [n for n, s in registry.models.items() if s.backend == "diffusers"]
        )
    specs = [registry.get(name) for name in chosen]
    simulated = [s.name for s in specs if s.backend != "diffusers"]
    if simulated:
        raise SystemExit(f"bench.gpu_smoke: {', '.join(simulated)}: not diffusers entries (nothing to load)")
    if not specs:
        raise SystemExit("bench.gpu_smoke: the registry has no diffusers entry; pass --registry")
    return specs


def run(args: argparse.Namespace, data_dir: Path, storage_dir: Path) -> int:
    registry = load_registry(args.registry)
    specs = select_models(registry, args.models, args.tiny)
    if args.tiny:
        ensure_tiny_models(data_dir / "models")
    storage = LocalStorage(storage_dir)
    width, height = args.size or (None, None)
    overrides = {"steps": args.steps, "width": width, "height": height, "num_frames": args.frames}
    results, failures = [], []
    for spec in specs:
        print(f"# {spec.name}: loading on {args.device} …", file=sys.stderr, flush=True)
        try:
            results.append(smoke_one(spec, args.device, data_dir, storage, overrides))
        except Exception as exc:  # noqa: BLE001 - a smoke run reports every model, then fails
            if not isinstance(exc, FileNotFoundError):  # a missing checkpoint's message says it all
                traceback.print_exc(file=sys.stderr)
            failures.append(f"{spec.name}: {type(exc).__name__}: {exc}")
        release(args.device)
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(
        f"# bench.gpu_smoke on {device_name}, torch {torch.__version__}; float32 adapters; "
        f"one job per model: encode → chunk → checkpoint/restore → chunk → decode"
    )
    print(TABLE_HEADER)
    for result in results:
        print(table_row(result))
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = require_device(args.device)
    if problem:
        print(problem, file=sys.stderr)
        return NO_GPU_STATUS
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    quiet_loading()
    with tempfile.TemporaryDirectory(prefix="genserver-gpu-smoke-") as tmp:
        data_dir = Path(tmp) if args.tiny else args.data_dir or config.data_dir()
        return run(args, data_dir.resolve(), Path(tmp) / "storage")


if __name__ == "__main__":
    sys.exit(main())
