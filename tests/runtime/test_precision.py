"""Precision per registry entry: dtype and variant parsing, weights loaded in the entry's dtype (fp32
modules kept, a float16 VAE upcast where its config says), and exact resume of a bf16 state in another
process."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from genserver.registry import RegistryError, load_registry
from workers.runtime import blob
from workers.runtime.components import build_stage, torch_dtype

from .conftest import REPO_ROOT, make_request

BF16_REGISTRY = textwrap.dedent("""
    [models.tiny-sd-bf16]
    family = "unet"
    backend = "diffusers"
    path = "{data_dir}/models/tiny-sd"
    dtype = "bfloat16"
    scheduler = "dpmpp_2m"
    cost_points = { 16 = 110.0 }

    [models.tiny-flux-bf16]
    family = "flux"
    backend = "diffusers"
    path = "{data_dir}/models/tiny-flux"
    dtype = "bfloat16"
    scheduler = "flow_dpmpp_2m"
    cost_points = { 528 = 4.9 }

    [models.tiny-wan-bf16]
    family = "wan"
    kind = "video"
    backend = "diffusers"
    path = "{data_dir}/models/tiny-wan"
    dtype = "bfloat16"
    scheduler = "unipc"
    cost_points = { 528 = 1.2 }
    limits = { max_width = 128, max_height = 128, max_frames = 33, frames_step = 4 }
""")


@pytest.fixture(scope="module")
def bf16_registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("registry") / "bf16.toml"
    path.write_text(BF16_REGISTRY)
    return path


@pytest.fixture(scope="module")
def models_root(data_dir: Path, wan_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("all-tiny")
    (root / "models").mkdir()
    for model in ("tiny-sd", "tiny-sdxl", "tiny-flux"):
        (root / "models" / model).symlink_to(data_dir / "models" / model)
    (root / "models" / "tiny-wan").symlink_to(wan_data_dir / "models" / "tiny-wan")
    return root


# --- the registry ----------------------------------------------------------------------


def test_dtype_defaults_to_bf16_on_cuda_and_fp32_on_cpu_and_the_tiny_models_stay_fp32() -> None:
    registry = load_registry()
    sim = registry.get("sdxl-sim")
    assert sim.dtype == "" and sim.resolved_dtype("cuda") == "bfloat16" and sim.resolved_dtype("cpu") == "float32"
    tiny = [s for s in registry.models.values() if s.backend == "diffusers"]
    assert tiny and all(s.resolved_dtype("cuda:0") == "float32" for s in tiny)
    assert all(not (s.compile or s.attention or s.encode_device or s.variant) for s in registry.models.values())


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('dtype = "fp16"', "dtype must be one of"),
        ("compile = 1", "compile must be true or false"),
        ('encode_device = "cuda:1"', "encode_device must be"),
    ],
)
def test_bad_precision_and_speed_settings_are_refused(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "r.toml"
    path.write_text(f'[models.m]\nfamily = "unet"\ncost_points = {{ 16 = 1.0 }}\n{line}\n')
    with pytest.raises(RegistryError, match=message):
        load_registry(path)


def test_precision_and_speed_settings_are_read(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text(
        '[models.m]\nfamily = "flux"\nbackend = "diffusers"\npath = "/x"\ncost_points = { 16 = 1.0 }\n'
        'dtype = "float16"\nvariant = "fp16"\ncompile = true\nattention = "flash"\n'
        'encode_device = "cpu"\n'
    )
    spec = load_registry(path).get("m")
    assert (spec.dtype, spec.variant, spec.compile, spec.attention, spec.encode_device) == (
        "float16",
        "fp16",
        True,
        "flash",
        "cpu",
    )
    assert spec.resolved_dtype("cpu") == "float16"


# --- loading in the entry's dtype ------------------------------------------------------


def test_weights_load_in_the_entry_dtype_keeping_the_fp32_modules(bf16_registry: Path, models_root: Path) -> None:
    registry = load_registry(bf16_registry)
    unet = build_stage(registry.get("tiny-sd-bf16"), "denoise", data_dir=models_root)["unet"]
    assert {p.dtype for p in unet.parameters()} == {torch.bfloat16}
    wan = build_stage(registry.get("tiny-wan-bf16"), "denoise", data_dir=models_root)["transformer"]
    kept = {name for name, p in wan.named_parameters() if p.dtype == torch.float32}
    assert kept and all(any(part in wan._keep_in_fp32_modules for part in name.split(".")) for name in kept)
    assert any(p.dtype == torch.bfloat16 for p in wan.parameters())


def test_a_float16_vae_that_says_force_upcast_loads_in_fp32(models_root: Path) -> None:
    """SDXL's VAE overflows in fp16 (NaN images); its config's force_upcast makes it load in fp32."""
    spec = dataclasses.replace(load_registry().get("tiny-sdxl"), dtype="float16")
    vae = build_stage(spec, "decode", data_dir=models_root)["vae"]
    assert vae.config.force_upcast and {p.dtype for p in vae.parameters()} == {torch.float32}
    unet = build_stage(spec, "denoise", data_dir=models_root)["unet"]
    assert {p.dtype for p in unet.parameters()} == {torch.float16}
    assert torch_dtype(spec, "cpu") == torch.float16


# --- exact resume of a bf16 state in another process -------------------------------------

CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from genserver.registry import load_registry
    from workers.runtime.base import GenerationRequest
    from workers.runtime.cache import FAMILY_ADAPTERS
    import importlib

    registry_path, data_dir, saved, result = sys.argv[1:5]
    cases, out = torch.load(saved, weights_only=True), {}
    for model, blob in cases.items():
        spec = load_registry(registry_path).get(model)
        module, name = FAMILY_ADAPTERS[spec.family].split(":")
        family = getattr(importlib.import_module(module), name)(spec, "cpu", Path(data_dir), ("denoise",))
        state = family.restore(GenerationRequest(**blob["request"]), blob["embeddings"], blob["checkpoint"])
        while not state.done:
            family.step(state)
        out[model] = state.latents
    torch.save(out, result)
""")

BF16_CASES = {"tiny-sd-bf16": 1, "tiny-flux-bf16": 1, "tiny-wan-bf16": 5}  # model → frames


def test_a_bf16_state_resumes_bit_exactly_in_another_process(
    bf16_registry: Path, models_root: Path, tmp_path: Path
) -> None:
    import importlib

    from workers.runtime.cache import FAMILY_ADAPTERS

    registry, cases, straight = load_registry(bf16_registry), {}, {}
    for model, frames in BF16_CASES.items():
        spec = registry.get(model)
        module, name = FAMILY_ADAPTERS[spec.family].split(":")
        family = getattr(importlib.import_module(module), name)(spec, "cpu", models_root)
        request = make_request(model, steps=5, num_frames=frames)
        embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
        state = family.prepare(request, embeddings)
        for _ in range(3):  # past the multistep solvers' warm-up: their history is in the checkpoint
            family.step(state)
        checkpoint = blob.loads(blob.dumps(family.checkpoint(state)))
        assert checkpoint["latents"].dtype == (torch.float32 if spec.family == "wan" else torch.bfloat16)
        while not state.done:
            family.step(state)
        straight[model] = state.latents
        cases[model] = {"request": dataclasses.asdict(request), "embeddings": embeddings, "checkpoint": checkpoint}
    saved, result = tmp_path / "cases.pt", tmp_path / "result.pt"
    torch.save(cases, saved)
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(bf16_registry), str(models_root), str(saved), str(result)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = torch.load(result, weights_only=True)
    for model in BF16_CASES:
        assert resumed[model].dtype == straight[model].dtype, model
        assert torch.equal(resumed[model], straight[model]), model
