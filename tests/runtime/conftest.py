"""Fixtures for the runtime tests: the tiny checkpoints and loaded models, once per session.

Also the one child process that resumes every family × scheduler from a
checkpoint file (`resumed_in_child`): starting Python + torch + diffusers costs
seconds, so all cases share one child instead of one each.

Torch runs single-threaded here (and in the child): the tiny models gain nothing
from intra-op threads, and on a busy 2-core machine (other test processes, the
Celery stack) OpenMP's spinning threads made the suite ~10× slower. Parent and
child use the same thread count, so float reductions split the same way.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from genserver.registry import ModelSpec, load_registry
from tests.support.tiny_models import copy_tiny_models
from workers.runtime.base import DenoiseState, Family, GenerationRequest
from workers.runtime.unet import UNetFamily

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCH_THREADS = 1
torch.set_num_threads(TORCH_THREADS)

# Every (registry model, scheduler) the runtime offers for the tiny checkpoints.
RESUME_CASES: list[tuple[str, str]] = [
    ("tiny-sd", "euler"),
    ("tiny-sd", "euler_a"),
    ("tiny-sd", "dpmpp_2m"),
    ("tiny-sdxl", "euler"),
    ("tiny-sdxl", "euler_a"),
    ("tiny-sdxl", "dpmpp_2m"),
    ("tiny-flux", "flow_euler"),
    ("tiny-flux", "flow_dpmpp_2m"),
    ("tiny-wan", "unipc"),
    ("tiny-wan", "dpmpp_2m"),
    ("tiny-wan", "flow_euler"),
]

# What a model's requests default to besides the common fields: FLUX's usual guidance, a video's frames.
MODEL_REQUEST_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny-flux": {"guidance_scale": 3.5},
    "tiny-wan": {"job_id": "job-v", "prompt": "a red cat walking on the sea", "num_frames": 9},
}


def make_request(model: str = "tiny-sd", **overrides: Any) -> GenerationRequest:
    fields = dict(
        job_id="job-1",
        model=model,
        prompt="a red cat on a sofa",
        negative_prompt="blurry",
        width=64,
        height=64,
        num_frames=1,
        steps=6,
        guidance_scale=5.0,
        seed=1234,
        num_outputs=1,
    )
    return GenerationRequest(**(fields | MODEL_REQUEST_DEFAULTS.get(model, {}) | overrides))


def embed(family: Family, request: GenerationRequest) -> dict[str, Any]:
    return family.encode([(request.prompt, request.negative_prompt)])[0]


def run_to_end(family: Family, state: DenoiseState) -> torch.Tensor:
    while not state.done:
        family.step(state)
    return state.latents


def generate(family: Family, request: GenerationRequest) -> torch.Tensor:
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    return run_to_end(family, family.prepare(request, embeddings))


def assert_same_scheduler_state(a: Any, b: Any) -> None:
    """Every attribute equal (tensors exactly), except where each was told to begin."""

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, np.ndarray):
            return np.array_equal(x, y)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(same(i, j) for i, j in zip(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x == y

    assert type(a) is type(b)
    keys = (vars(a).keys() | vars(b).keys()) - {"_begin_index"}
    differing = sorted(k for k in keys if not same(getattr(a, k, None), getattr(b, k, None)))
    assert not differing, differing


def family_class(family: str) -> type[Family]:
    """The adapter class the worker would load for a registry family (workers/runtime/cache.py)."""
    import importlib

    from workers.runtime.cache import FAMILY_ADAPTERS

    module, name = FAMILY_ADAPTERS[family].split(":")
    return getattr(importlib.import_module(module), name)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GENSERVER_DATA_DIR-like directory holding models/tiny-* (generated, never downloaded)."""
    root = tmp_path_factory.mktemp("data")
    copy_tiny_models(root / "models")
    return root


@pytest.fixture(scope="session")
def tiny_spec() -> ModelSpec:
    return load_registry().get("tiny-sd")


@pytest.fixture(scope="session")
def load_family(data_dir: Path) -> Callable[..., Family]:
    """load_family(model, scheduler=None): a loaded family, shared by all tests of the session."""
    registry = load_registry()
    loaded: dict[tuple[str, str | None], Family] = {}

    def load(model: str, scheduler: str | None = None) -> Family:
        key = (model, scheduler)
        if key not in loaded:
            spec = registry.get(model)
            if scheduler is not None:
                spec = dataclasses.replace(spec, scheduler=scheduler)
            loaded[key] = family_class(spec.family)(spec, "cpu", data_dir)
        return loaded[key]

    return load


@pytest.fixture(scope="session")
def family(load_family: Callable[..., Family]) -> UNetFamily:
    return load_family("tiny-sd")


# --- the video family (tests/runtime/test_wan_family.py) ---------------------------


@pytest.fixture(scope="session")
def wan_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory holding models/tiny-wan only (make_tiny_wan, never downloaded)."""
    from workers.runtime.tiny_wan import make_tiny_wan

    root = tmp_path_factory.mktemp("wan-data")
    make_tiny_wan(root / "models" / "tiny-wan", seed=0)
    return root


@pytest.fixture(scope="session")
def wan_spec() -> ModelSpec:
    return load_registry().get("tiny-wan")


@pytest.fixture(scope="session")
def wan_family(wan_spec: ModelSpec, wan_data_dir: Path) -> Family:
    from workers.runtime.wan import WanFamily

    return WanFamily(wan_spec, "cpu", wan_data_dir)


# --- resuming in another process --------------------------------------------------

CHILD = textwrap.dedent("""
    import dataclasses, importlib, io, sys
    from pathlib import Path
    import torch
    from genserver.registry import load_registry
    from workers.runtime.base import GenerationRequest
    from workers.runtime.cache import FAMILY_ADAPTERS

    data_dir, saved, result, threads = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(threads)  # as the parent: float reductions split the same way
    cases = torch.load(saved, weights_only=True)  # plain tensors and values only
    registry, out = load_registry(), {}
    for key, blob in cases.items():
        spec = dataclasses.replace(registry.get(blob["model"]), scheduler=blob["scheduler"])
        module, name = FAMILY_ADAPTERS[spec.family].split(":")
        family = getattr(importlib.import_module(module), name)(spec, "cpu", data_dir)
        request = GenerationRequest(**blob["request"])
        # Chunk 2: restore, run to `until`, checkpoint through bytes (as storage does) ...
        state = family.restore(request, blob["embeddings"], blob["checkpoint"])
        while state.step < blob["until"]:
            family.step(state)
        buffer = io.BytesIO()
        torch.save(family.checkpoint(state), buffer)
        buffer.seek(0)
        # ... chunk 3: restore that and finish.
        state = family.restore(request, blob["embeddings"], torch.load(buffer, weights_only=True))
        while not state.done:
            family.step(state)
        out[key] = {"latents": state.latents, "step": state.step}
    torch.save(out, result)
""")


def resume_in_child(data_dir: Path, cases: dict[str, dict[str, Any]], tmp: Path) -> dict[str, dict[str, Any]]:
    """Finish every case (its model, scheduler, request, embeddings, checkpoint and `until`) in ONE
    separate Python process: restore, run to `until`, checkpoint through bytes, restore, finish.
    Returns {key: {"latents", "step"}}."""
    saved, result = tmp / "jobs.pt", tmp / "result.pt"
    torch.save(cases, saved)
    threads = torch.get_num_threads()
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(data_dir), str(saved), str(result), str(threads)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(result, weights_only=True)


@pytest.fixture(scope="session")
def resumed_in_child(
    load_family: Callable[..., Family], data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """For every RESUME_CASES entry: the straight run's final latents and those of a
    run cut into three chunks, the last two in a separate Python process.

    Chunk 1 (here) stops after one step, so a multistep solver's history is half
    full; chunk 2 (child) runs to step 3 and checkpoints again; chunk 3 finishes.
    Returns {"model/scheduler": {"straight", "resumed", "step", "steps"}}.
    """
    tmp = tmp_path_factory.mktemp("resume")
    cases, straight = {}, {}
    for model, scheduler in RESUME_CASES:
        key = f"{model}/{scheduler}"
        family = load_family(model, scheduler)
        # Two outputs (the batch must resume as one) on a non-square image.
        request = make_request(model, num_outputs=2, steps=6, width=96, height=64)
        embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
        straight[key] = run_to_end(family, family.prepare(request, embeddings))
        state = family.prepare(request, embeddings)
        family.step(state)
        cases[key] = {
            "model": model,
            "scheduler": scheduler,
            "request": dataclasses.asdict(request),
            "embeddings": embeddings,
            "checkpoint": family.checkpoint(state),
            "until": 3,
        }
    resumed = resume_in_child(data_dir, cases, tmp)
    return {
        key: {
            "straight": straight[key],
            "resumed": resumed[key]["latents"],
            "step": resumed[key]["step"],
            "steps": cases[key]["request"]["steps"],
        }
        for key in cases
    }
