"""Each stage loads only its own components (components.py), and three one-stage workers make the same
image as one worker holding the whole model.

The proof that a stage never touches another stage's weights: each one-stage family is built from a copy
of the checkpoint whose other stages' weight files are deleted (only their config.json files stay).
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
from pathlib import Path

import pytest
import torch

from genserver.registry import load_registry
from workers.runtime import blob
from workers.runtime.base import Family
from workers.runtime.cache import FAMILY_ADAPTERS, ModelCache
from workers.runtime.common import CheckpointMissingError
from workers.runtime.components import (
    STAGES,
    build_stage,
    bytes_by_dtype,
    component_bytes,
    read_config,
    stage_components,
)

from .conftest import make_request

# What each stage of each tiny checkpoint loads: the table this suite pins.
EXPECTED: dict[str, dict[str, set[str]]] = {
    "tiny-sd": {"encode": {"tokenizer", "text_encoder"}, "denoise": {"unet"}, "decode": {"vae"}},
    "tiny-sdxl": {
        "encode": {"tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"},
        "denoise": {"unet"},
        "decode": {"vae"},
    },
    "tiny-flux": {
        "encode": {"tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"},
        "denoise": {"transformer"},
        "decode": {"vae"},
    },
    "tiny-wan": {"encode": {"tokenizer", "text_encoder"}, "denoise": {"transformer"}, "decode": {"vae"}},
}
WEIGHT_SUFFIXES = (".safetensors", ".bin")


@pytest.fixture(scope="module")
def models_root(data_dir: Path, wan_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data dir holding all four tiny checkpoints (the wan one is made by its own fixture)."""
    root = tmp_path_factory.mktemp("all-tiny")
    (root / "models").mkdir()
    for model in ("tiny-sd", "tiny-sdxl", "tiny-flux"):
        (root / "models" / model).symlink_to(data_dir / "models" / model)
    (root / "models" / "tiny-wan").symlink_to(wan_data_dir / "models" / "tiny-wan")
    return root


def family_of(model: str) -> type[Family]:
    module, name = FAMILY_ADAPTERS[load_registry().get(model).family].split(":")
    return getattr(importlib.import_module(module), name)


def stripped_copy(source: Path, target: Path, keep: set[str]) -> Path:
    """The checkpoint with every weight file deleted outside the `keep` component folders."""
    shutil.copytree(source, target)
    for file in target.rglob("*"):
        if file.suffix in WEIGHT_SUFFIXES and file.relative_to(target).parts[0] not in keep:
            file.unlink()
    return target


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_each_stage_lists_and_loads_only_its_components(model: str, models_root: Path) -> None:
    spec = load_registry().get(model)
    for stage in STAGES:
        classes = stage_components(spec, stage, data_dir=models_root)
        assert set(classes) == EXPECTED[model][stage], stage
        built = build_stage(spec, stage, data_dir=models_root)
        assert set(built) == EXPECTED[model][stage]
        # (AutoTokenizer builds the checkpoint's own tokenizer class.)
        assert all(isinstance(built[name], cls) for name, cls in classes.items() if not cls.__name__.startswith("Auto"))
        modules = {n: m for n, m in built.items() if isinstance(m, torch.nn.Module)}
        assert modules and all(not m.training for m in modules.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_meta_and_random_builds_count_the_bytes_a_checkpoint_load_holds(
    model: str, dtype: str, models_root: Path
) -> None:
    """The memory plan's numbers (meta device) are exactly what the loaded checkpoint holds, dtype by dtype
    (a bf16 Wan transformer keeps its norms and modulation in fp32, as from_pretrained keeps them)."""
    spec = dataclasses.replace(load_registry().get(model), dtype=dtype)
    for stage in STAGES:
        loaded = bytes_by_dtype(build_stage(spec, stage, data_dir=models_root))
        assert bytes_by_dtype(build_stage(spec, stage, weights="meta", data_dir=models_root)) == loaded
        assert bytes_by_dtype(build_stage(spec, stage, weights="random", data_dir=models_root)) == loaded
    denoiser = build_stage(spec, "denoise", weights="meta", data_dir=models_root)
    (module,) = denoiser.values()
    params = sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers())
    expected_floor = params * (4 if dtype == "float32" else 2)
    assert component_bytes(module) >= expected_floor and all(p.device.type == "meta" for p in module.parameters())


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_one_stage_workers_never_touch_the_other_stages_weights(model: str, models_root: Path, tmp_path: Path) -> None:
    """Encode, denoise and decode in three one-stage families, each built from a checkpoint stripped of
    the other stages' weights, give the very pixels of one family holding everything."""
    spec = load_registry().get(model)
    source = spec.resolved_path(models_root)
    cls = family_of(model)
    request = make_request(model, steps=3, num_frames=5 if spec.kind == "video" else 1)

    def one_stage(stage: str) -> Family:
        keep = EXPECTED[model][stage]
        data = tmp_path / stage
        stripped_copy(source, spec.resolved_path(data), keep)
        family = cls(spec, "cpu", data, (stage,))
        assert set(family.components) == keep
        return family

    encoder, denoiser, decoder = one_stage("encode"), one_stage("denoise"), one_stage("decode")
    assert denoiser.memory_bytes() == sum(component_bytes(m) for m in denoiser.components.values())
    embeddings = blob.loads(blob.dumps(encoder.encode([(request.prompt, request.negative_prompt)])[0]))
    state = denoiser.prepare(request, embeddings)
    while not state.done:
        denoiser.step(state)
    denoiser.preview(state)
    saved = blob.loads(blob.dumps(denoiser.checkpoint(state)))
    ours = decoder.decode(decoder.restore(request, embeddings, saved))

    whole = cls(spec, "cpu", models_root)
    state = whole.prepare(request, whole.encode([(request.prompt, request.negative_prompt)])[0])
    while not state.done:
        whole.step(state)
    theirs = whole.decode(state)
    flat = (lambda out: [f for o in out for f in o]) if spec.kind == "video" else (lambda out: out)
    assert [img.tobytes() for img in flat(ours)] == [img.tobytes() for img in flat(theirs)]


@pytest.mark.parametrize("model", ["tiny-sd", "tiny-wan"])
def test_a_stage_asked_for_what_another_stage_holds_says_so(model: str, models_root: Path) -> None:
    spec = load_registry().get(model)
    denoiser = family_of(model)(spec, "cpu", models_root, ("denoise",))
    request = make_request(model, steps=2, num_frames=5 if spec.kind == "video" else 1)
    with pytest.raises(RuntimeError, match="not loaded in this worker, which holds the denoise stage"):
        denoiser.encode([("a cat", "")])
    state = denoiser.prepare(request, denoiser.blank_embeddings())
    with pytest.raises(RuntimeError, match="vae is not loaded"):
        denoiser.decode(state)


def config_only_copy(source: Path, target: Path) -> Path:
    """model_index.json + <component>/config.json (no weights, no tokenizers): the memory plan's folders."""
    target.mkdir(parents=True)
    shutil.copy(source / "model_index.json", target / "model_index.json")
    for config in [*source.glob("*/config.json"), *source.glob("*/scheduler_config.json")]:
        if "tokenizer" not in config.parent.name:
            (target / config.parent.name).mkdir(exist_ok=True)
            shutil.copy(config, target / config.parent.name / config.name)
    return target


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_a_config_only_folder_builds_on_meta_and_with_random_weights(
    model: str, models_root: Path, tmp_path: Path
) -> None:
    spec = load_registry().get(model)
    config_only_copy(spec.resolved_path(models_root), spec.resolved_path(tmp_path))
    cls = family_of(model)
    for stage in STAGES:
        meta = build_stage(spec, stage, weights="meta", data_dir=tmp_path)
        assert set(meta) == {n for n in EXPECTED[model][stage] if "tokenizer" not in n}
        assert all(p.device.type == "meta" for m in meta.values() for p in m.parameters())
    with pytest.raises(CheckpointMissingError, match="tokenizer/"):
        build_stage(spec, "encode", data_dir=tmp_path)  # a real load needs the tokenizers
    on_meta = cls(spec, "cpu", tmp_path, weights="meta")
    assert on_meta.memory_bytes() == cls(spec, "cpu", models_root).memory_bytes()
    # Random weights run: a denoise step on blank embeddings, a decode of the result.
    random = cls(spec, "cpu", tmp_path, weights="random")
    request = make_request(model, steps=2, num_frames=5 if spec.kind == "video" else 1)
    state = random.prepare(request, random.blank_embeddings())
    while not state.done:
        random.step(state)
    assert torch.isfinite(state.latents).all()
    assert len(random.decode(state)) == 1


def test_the_model_cache_holds_models_per_stage_and_counts_their_bytes(models_root: Path) -> None:
    spec = load_registry().get("tiny-flux")
    cache = ModelCache(10**12, models_root, time_scale=0.0, effective_tflops=450.0)
    denoiser = cache.get(spec, "denoise")
    assert set(denoiser.components) == {"transformer"} and cache.get(spec, "denoise") is denoiser
    decoder = cache.get(spec, "decode")
    assert set(decoder.components) == {"vae"}
    memory = cache.memory()
    assert set(memory) == {"tiny-flux/denoise", "tiny-flux/decode"}
    assert memory["tiny-flux/denoise"] == {"transformer": {"float32": component_bytes(denoiser.transformer)}}
    assert cache.used_bytes() == denoiser.memory_bytes() + decoder.memory_bytes()
    assert cache.loaded() == ["tiny-flux"]
    with pytest.raises(ValueError, match="unknown stage"):
        cache.get(spec, "vae")


def test_the_model_cache_evicts_per_stage(models_root: Path) -> None:
    registry = load_registry()
    sd, flux = registry.get("tiny-sd"), registry.get("tiny-flux")
    probe = ModelCache(10**12, models_root, time_scale=0.0, effective_tflops=450.0)
    budget = probe.get(sd, "denoise").memory_bytes() + 1
    cache = ModelCache(budget, models_root, time_scale=0.0, effective_tflops=450.0)
    cache.get(sd, "denoise")
    cache.get(flux, "decode")  # over budget: the least recently used (sd's UNet) goes
    assert list(cache.memory()) == ["tiny-flux/decode"]


def test_unknown_family_or_stage_is_refused() -> None:
    spec = load_registry().get("tiny-sd")
    with pytest.raises(ValueError, match="stages are"):
        stage_components(spec, "vae")
    with pytest.raises(ValueError, match="weights must be one of"):
        build_stage(spec, "denoise", weights="zeros")
    with pytest.raises(ValueError, match="no diffusers components"):
        stage_components(dataclasses.replace(spec, family="dit"), "denoise")


def test_read_config_names_the_folder(tmp_path: Path) -> None:
    (tmp_path / "unet").mkdir()
    with pytest.raises(FileNotFoundError, match="unet has no config.json"):
        read_config(tmp_path, "unet")
