"""Throughput with and without merging same-shape jobs, on the tiny models on the CPU.

    .venv/bin/python -m bench.merging [--jobs 8] [--steps 8] [--rounds 3] [--threads 1]

No Django, no Celery: each model is loaded through its family adapter (the
tiny checkpoints are generated into a temporary directory). For each model
and batch size k, a round denoises the same `--jobs` jobs (different seeds and
prompts, one output each) twice, side by side:

    alone    one job after another, `family.step` (what max_merge = 1 does)
    merged   k jobs at a time, `family.step_many` (one model call per step)

and the table gives jobs per second of each (median over rounds), their
ratio, the largest difference between a job's merged and lone latents, and
what the cost model predicts for that merge (`cost.merge_speedup`, from the
registry's cost points, which the simulated backend sleeps by). Encoding and
decoding are left out: merging changes only the denoise stage.

The simulated models have no weights; their rows give the cost model's
prediction only (sdxl-turbo-sim: a few-step 512² model that leaves an H100
idle; sdxl-sim: a compute-bound one, where merging saves nothing).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from genserver.registry import load_registry
from genserver.scheduling.cost import JobShape, merge_speedup
from workers.runtime.base import DenoiseState, Family, GenerationRequest
from workers.runtime.cache import FAMILY_ADAPTERS
from workers.runtime.tiny_models import ensure_tiny_models

CASES = [  # (model, width, height, frames, batch sizes)
    ("tiny-sd", 64, 64, 1, (2, 4, 8)),
    ("tiny-sd", 128, 128, 1, (2, 4, 8)),
    ("tiny-flux", 64, 64, 1, (2, 4)),
    ("tiny-wan", 64, 64, 9, (2, 4)),
]
SIMULATED = [("sdxl-turbo-sim", 512, 512, 4, 0.0, (2, 4, 8)), ("sdxl-sim", 1024, 1024, 30, 5.0, (2, 4))]


def requests(model: str, width: int, height: int, frames: int, jobs: int, steps: int) -> list[GenerationRequest]:
    spec = load_registry().get(model)
    return [
        GenerationRequest(
            job_id=f"j{i}",
            model=model,
            prompt=f"prompt number {i % 3}",
            negative_prompt="",
            width=width,
            height=height,
            num_frames=frames,
            steps=steps,
            guidance_scale=spec.defaults.guidance_scale,
            seed=i,
        )
        for i in range(jobs)
    ]


def prepared(family: Family, batch: list[GenerationRequest], embeddings: dict[str, dict]) -> list[DenoiseState]:
    return [family.prepare(r, embeddings[r.prompt]) for r in batch]


def run_alone(family: Family, reqs: list[GenerationRequest], embeddings: dict) -> tuple[float, list[torch.Tensor]]:
    started, out = time.perf_counter(), []
    for state in prepared(family, reqs, embeddings):
        while not state.done:
            family.step(state)
        out.append(state.latents)
    return time.perf_counter() - started, out


def run_merged(
    family: Family, reqs: list[GenerationRequest], embeddings: dict, k: int
) -> tuple[float, list[torch.Tensor]]:
    started, out = time.perf_counter(), []
    for i in range(0, len(reqs), k):
        states = prepared(family, reqs[i : i + k], embeddings)
        while not states[0].done:
            family.step_many(states)
        out.extend(s.latents for s in states)
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    registry = load_registry()
    data_dir = Path(tempfile.mkdtemp(prefix="bench-merging-"))
    ensure_tiny_models(data_dir / "models")
    print(
        f"# bench.merging --jobs {args.jobs} --steps {args.steps} --rounds {args.rounds} "
        f"--threads {args.threads} (torch {torch.__version__}, CPU)"
    )
    print(
        "| model | shape | k | alone jobs/s | merged jobs/s | merged ÷ alone | cost model predicts | max latent diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    families: dict[str, Family] = {}
    for model, width, height, frames, sizes in CASES:
        spec = registry.get(model)
        if model not in families:
            module_name, class_name = FAMILY_ADAPTERS[spec.family].split(":")
            families[model] = getattr(importlib.import_module(module_name), class_name)(spec, "cpu", data_dir)
        family = families[model]
        reqs = requests(model, width, height, frames, args.jobs, args.steps)
        embeddings = {
            p: e
            for p, e in zip(
                sorted({r.prompt for r in reqs}), family.encode([(p, "") for p in sorted({r.prompt for r in reqs})])
            )
        }
        run_alone(family, reqs[:2], embeddings)  # warm-up
        shape = JobShape(spec.family, width, height, frames, args.steps, reqs[0].guidance_scale)
        for k in sizes:
            alone_s, merged_s, diff = [], [], 0.0
            for _ in range(args.rounds):  # side by side in each round: a busy moment hits both
                seconds, lone = run_alone(family, reqs, embeddings)
                alone_s.append(seconds)
                seconds, merged = run_merged(family, reqs, embeddings, k)
                merged_s.append(seconds)
                diff = max([diff, *(float((a - b).abs().max()) for a, b in zip(lone, merged))])
            alone_rate = args.jobs / statistics.median(alone_s)
            merged_rate = args.jobs / statistics.median(merged_s)
            size = f"{width}×{height}" + (f"×{frames}" if frames > 1 else "")
            print(
                f"| {model} | {size} | {k} | {alone_rate:.1f} | {merged_rate:.1f} | "
                f"{merged_rate / alone_rate:.2f}× | {merge_speedup(shape, k, spec.cost_points):.2f}× | {diff:.1e} |"
            )
    for model, width, height, steps, guidance, sizes in SIMULATED:
        spec = registry.get(model)
        shape = JobShape(spec.family, width, height, 1, steps, guidance)
        for k in sizes:
            print(
                f"| {model} (simulated) | {width}×{height} | {k} | — | — | — | "
                f"{merge_speedup(shape, k, spec.cost_points):.2f}× | — |"
            )


if __name__ == "__main__":
    main()
