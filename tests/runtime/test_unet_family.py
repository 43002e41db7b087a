"""The UNet family (SD 1.5 and SDXL) on the tiny random-weight checkpoints: exact resumption, images, errors.

No Django, no database, no downloads: the checkpoints are generated into a tmp dir.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from genserver.registry import ModelSpec, load_registry
from genserver.scheduling.cost import JobShape, estimate_job_seconds
from tests.runtime.conftest import RESUME_CASES, assert_same_scheduler_state, generate, make_request, run_to_end
from workers.runtime.base import Family
from workers.runtime.tiny_models import TINY_MODELS, ensure_tiny_models, make_tiny_sdxl, make_tiny_unet
from workers.runtime.unet import UNET_SCHEDULERS, CheckpointMissingError, UNetFamily

UNET_CASES = [case for case in RESUME_CASES if not case[0].startswith("tiny-flux")]


# --- the tiny checkpoints -------------------------------------------------------

def test_tiny_checkpoint_layout_size_and_idempotence(data_dir: Path) -> None:
    models = data_dir / "models"
    common = ("model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
              "tokenizer/vocab.json", "tokenizer/merges.txt", "scheduler/scheduler_config.json")
    sdxl = ("text_encoder_2/config.json", "tokenizer_2/vocab.json", "tokenizer_2/merges.txt")
    for name, parts, pipeline in (("tiny-sd", common, "StableDiffusionPipeline"),
                                  ("tiny-sdxl", common + sdxl, "StableDiffusionXLPipeline")):
        path = models / name
        for part in parts:
            assert (path / part).is_file(), (name, part)
        assert f'"{pipeline}"' in (path / "model_index.json").read_text()
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        assert size < 5_000_000, name
    assert ensure_tiny_models(models) == []  # already there: nothing rewritten
    assert sorted(p.name for p in models.iterdir()) == sorted(TINY_MODELS)  # no temp dirs left behind


@pytest.mark.parametrize("name,writer", [("tiny-sd", make_tiny_unet), ("tiny-sdxl", make_tiny_sdxl)])
def test_tiny_checkpoint_is_deterministic(data_dir: Path, tmp_path: Path, name: str, writer: Callable) -> None:
    again = writer(tmp_path / "again", seed=0)
    parts = ["unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors", "tokenizer/vocab.json"]
    if name == "tiny-sdxl":
        parts += ["text_encoder_2/model.safetensors", "tokenizer_2/tokenizer_config.json"]
    for part in parts:
        assert (again / part).read_bytes() == (data_dir / "models" / name / part).read_bytes(), part


def test_tokenizer_takes_any_prompt(family: UNetFamily) -> None:
    prompts = ["", "a photo of the cat", "Ünïcödé 日本語 🐱\ttabs\nnewlines", "word " * 200]
    ids = family.tokenizer(prompts, padding="max_length", max_length=77, truncation=True).input_ids
    assert [len(row) for row in ids] == [77] * len(prompts)
    assert family.tokenizer.model_max_length == 77


# --- encode -------------------------------------------------------------------

def test_encode_is_batched_per_pair_on_cpu(family: UNetFamily) -> None:
    pairs = [("a cat", ""), ("a dog", "ugly"), ("a cat", "")]
    out = family.encode(pairs)
    assert len(out) == 3
    for item in out:
        assert set(item) == {"prompt_embeds", "negative_embeds"}
        for tensor in item.values():
            assert tensor.shape == (1, 77, 32) and tensor.device.type == "cpu"
    assert torch.equal(out[0]["prompt_embeds"], out[2]["prompt_embeds"])
    assert not torch.equal(out[0]["prompt_embeds"], out[1]["prompt_embeds"])
    # Batching must not change an embedding.
    alone = family.encode([("a dog", "ugly")])[0]
    assert torch.allclose(alone["negative_embeds"], out[1]["negative_embeds"], atol=1e-6)


def test_sdxl_encode_concatenates_both_encoders_and_pools(load_family: Callable[..., Family]) -> None:
    sdxl = load_family("tiny-sdxl")
    assert sdxl.is_sdxl and sdxl.tokenizer_2.pad_token == "!"
    out = sdxl.encode([("a cat", ""), ("a dog", "ugly")])
    for item in out:
        assert set(item) == {"prompt_embeds", "negative_embeds", "pooled_embeds", "negative_pooled_embeds"}
        # Two CLIPs of width 32 side by side; the second one's 32-wide projection.
        assert item["prompt_embeds"].shape == item["negative_embeds"].shape == (1, 77, 64)
        assert item["pooled_embeds"].shape == item["negative_pooled_embeds"].shape == (1, 32)
        assert all(t.device.type == "cpu" for t in item.values())
    # An empty negative prompt is zeros (force_zeros_for_empty_prompt), a real one is encoded.
    assert not out[0]["negative_embeds"].any() and not out[0]["negative_pooled_embeds"].any()
    assert out[1]["negative_embeds"].abs().sum() > 0 and out[1]["negative_pooled_embeds"].abs().sum() > 0
    alone = sdxl.encode([("a dog", "ugly")])[0]
    for key in alone:
        assert torch.allclose(alone[key], out[1][key], atol=1e-5), key


def test_sd15_stays_sd15(family: UNetFamily) -> None:
    assert not family.is_sdxl and family.text_encoder_2 is None
    assert family.unet.config.addition_embed_type is None


# --- checkpoint / restore -----------------------------------------------------

@pytest.mark.parametrize("model,scheduler", UNET_CASES)
def test_resume_in_a_new_process_matches_straight_run(resumed_in_child: dict[str, dict[str, Any]],
                                                      model: str, scheduler: str) -> None:
    """Chunked: 1 step here, checkpoint → file → a separate Python process restores,
    runs to step 3, checkpoints through bytes, restores and finishes (conftest)."""
    case = resumed_in_child[f"{model}/{scheduler}"]
    assert case["step"] == case["steps"]
    assert torch.allclose(case["resumed"], case["straight"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("model,scheduler", UNET_CASES)
def test_restore_at_every_step_matches_straight_run(load_family: Callable[..., Family], model: str,
                                                    scheduler: str) -> None:
    family = load_family(model, scheduler)
    request = make_request(model, steps=5)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    straight = run_to_end(family, family.prepare(request, embeddings))
    for stop_at in range(request.steps + 1):
        state = family.prepare(request, embeddings)
        for _ in range(stop_at):
            family.step(state)
        restored = family.restore(request, embeddings, family.checkpoint(state))
        assert restored.step == stop_at
        assert torch.allclose(run_to_end(family, restored), straight, atol=1e-6, rtol=0), stop_at


@pytest.mark.parametrize("scheduler", sorted(UNET_SCHEDULERS))
def test_restored_scheduler_is_the_running_one(load_family: Callable[..., Family], scheduler: str) -> None:
    """After one more step, a restored scheduler's whole state equals the one that never stopped."""
    family = load_family("tiny-sd", scheduler)
    request = make_request(steps=5, num_outputs=2)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    for stop_at in (1, 2, 3):
        state = family.prepare(request, embeddings)
        for _ in range(stop_at):
            family.step(state)
        restored = family.restore(request, embeddings, family.checkpoint(state))
        family.step(state)
        family.step(restored)
        assert torch.equal(restored.latents, state.latents)
        assert_same_scheduler_state(restored.scheduler, state.scheduler)
        assert torch.equal(restored.generator.get_state(), state.generator.get_state())


@pytest.mark.parametrize("model", ["tiny-sd", "tiny-sdxl"])
def test_dpm_history_is_checkpointed_and_matters(load_family: Callable[..., Family], model: str) -> None:
    family = load_family(model, "dpmpp_2m")
    request = make_request(model, steps=5)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    straight = run_to_end(family, family.prepare(request, embeddings))
    state = family.prepare(request, embeddings)
    family.step(state)
    family.step(state)
    data = family.checkpoint(state)
    assert data["scheduler_history"] == {"model_outputs_present": [True, True], "lower_order_nums": 2}
    assert data["scheduler_model_outputs"].shape == (2, *state.latents.shape)
    # Without the history (zeroed), the resumed result differs: the test above guards something.
    blank = dict(data, scheduler_model_outputs=torch.zeros_like(data["scheduler_model_outputs"]))
    assert not torch.allclose(run_to_end(family, family.restore(request, embeddings, blank)), straight, atol=1e-4)
    missing = {k: v for k, v in data.items() if not k.startswith("scheduler_history")}
    with pytest.raises(ValueError, match="history"):
        family.restore(request, embeddings, missing)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model,scheduler", [("tiny-sd", "euler"), ("tiny-sdxl", "dpmpp_2m")])
def test_on_cuda_checkpoints_stay_on_cpu_and_resume_exactly(data_dir: Path, model: str, scheduler: str) -> None:
    family = UNetFamily(dataclasses.replace(load_registry().get(model), scheduler=scheduler), "cuda", data_dir)
    request = make_request(model, num_outputs=2)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    assert all(t.device.type == "cpu" for t in embeddings.values())
    straight = run_to_end(family, family.prepare(request, embeddings))
    assert straight.device.type == "cuda"
    state = family.prepare(request, embeddings)
    family.step(state)
    family.step(state)
    data = family.checkpoint(state)
    assert all(v.device.type == "cpu" for v in data.values() if isinstance(v, torch.Tensor))
    resumed = run_to_end(family, family.restore(request, embeddings, data))
    assert torch.allclose(resumed, straight, atol=1e-6, rtol=0)
    assert len(family.decode(family.restore(request, embeddings, family.checkpoint(state)))) == 2


@pytest.mark.parametrize("model,scheduler", [("tiny-sd", "euler"), ("tiny-sd", "dpmpp_2m"),
                                             ("tiny-sdxl", "dpmpp_2m")])
def test_checkpoint_holds_cpu_tensors_and_plain_values(load_family: Callable[..., Family], model: str,
                                                       scheduler: str) -> None:
    family = load_family(model, scheduler)
    request = make_request(model)
    state = family.prepare(request, family.encode([(request.prompt, request.negative_prompt)])[0])
    family.step(state)
    data = family.checkpoint(state)
    assert data["format"] == "unet/2"
    assert data["step"] == 1 and data["scheduler_step_index"] == 1
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            assert value.device.type == "cpu", key
        else:
            json.dumps(value)  # plain
    # A copy: stepping on must not change what was saved.
    before = {k: v.clone() for k, v in data.items() if isinstance(v, torch.Tensor)}
    family.step(state)
    family.step(state)
    for key, value in before.items():
        assert torch.equal(data[key], value), key


def test_a_unet_1_checkpoint_still_restores(family: UNetFamily) -> None:
    """unet/1 (before the multistep history) differs only by keys Euler never had."""
    request = make_request(steps=4)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    straight = run_to_end(family, family.prepare(request, embeddings))
    state = family.prepare(request, embeddings)
    family.step(state)
    data = family.checkpoint(state) | {"format": "unet/1"}
    assert torch.allclose(run_to_end(family, family.restore(request, embeddings, data)), straight, atol=1e-6)


def test_restore_refuses_another_step_count_or_scheduler(family: UNetFamily,
                                                         load_family: Callable[..., Family]) -> None:
    request = make_request(steps=6)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    data = family.checkpoint(family.prepare(request, embeddings))
    with pytest.raises(ValueError, match="6 steps"):
        family.restore(make_request(steps=8), embeddings, data)
    with pytest.raises(ValueError, match="EulerDiscreteScheduler"):
        load_family("tiny-sd", "dpmpp_2m").restore(request, embeddings, data)


# --- seeds ----------------------------------------------------------------------

def test_same_seed_same_output_different_seed_different(family: UNetFamily) -> None:
    a = generate(family, make_request(seed=7))
    b = generate(family, make_request(seed=7))
    c = generate(family, make_request(seed=8))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("model,scheduler,outputs", [("tiny-sd", "euler", 3), ("tiny-sdxl", "euler", 2),
                                                     ("tiny-sdxl", "dpmpp_2m", 2)])
def test_output_i_does_not_depend_on_num_outputs(load_family: Callable[..., Family], model: str, scheduler: str,
                                                 outputs: int) -> None:
    family = load_family(model, scheduler)
    request = make_request(model, seed=5, steps=4)
    one = family.prepare(request, family.encode([(request.prompt, request.negative_prompt)])[0])
    many = family.prepare(dataclasses.replace(request, num_outputs=outputs), one.embeddings)
    run_to_end(family, one)
    run_to_end(family, many)
    # Same initial noise; only the batch size of the UNet's matmuls differs.
    assert torch.allclose(one.latents[0], many.latents[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(many.latents[0], many.latents[1])
    # And so the same picture (uint8 rounding aside).
    first, batched = np.asarray(family.decode(one)[0], np.int16), np.asarray(family.decode(many)[0], np.int16)
    assert np.abs(first - batched).max() <= 1


@pytest.fixture(scope="module")
def pipelines(data_dir: Path) -> Callable[[str], Any]:
    """The tiny checkpoints loaded as plain diffusers pipelines (each once)."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    loaded: dict[str, Any] = {}

    def get(model: str) -> Any:
        if model not in loaded:
            cls = StableDiffusionXLPipeline if model == "tiny-sdxl" else StableDiffusionPipeline
            loaded[model] = cls.from_pretrained(data_dir / "models" / model, local_files_only=True)
            loaded[model].set_progress_bar_config(disable=True)
        return loaded[model]

    return get


@pytest.mark.parametrize("model,scheduler,negative", [
    ("tiny-sd", "euler", "blurry"), ("tiny-sd", "dpmpp_2m", "blurry"),
    ("tiny-sdxl", "euler", "blurry"), ("tiny-sdxl", "dpmpp_2m", ""),
])
def test_matches_the_diffusers_pipeline(load_family: Callable[..., Family], pipelines: Callable[[str], Any],
                                        model: str, scheduler: str, negative: str) -> None:
    family = load_family(model, scheduler)
    request = make_request(model, num_outputs=2, negative_prompt=negative, width=96, height=64)
    ours = generate(family, request)
    pipe = pipelines(model)
    # The registry's scheduler = the pipeline's own, swapped the usual diffusers way.
    pipe.scheduler = family.scheduler_class.from_config(pipe.scheduler.config, **family.scheduler_settings)
    theirs = pipe(request.prompt, negative_prompt=negative or None, width=request.width,
                  height=request.height, num_inference_steps=request.steps,
                  guidance_scale=request.guidance_scale, num_images_per_prompt=request.num_outputs,
                  generator=torch.Generator("cpu").manual_seed(request.seed), output_type="latent").images
    # SD 1.5 matches exactly; SDXL's pipeline encodes prompt and negative in separate
    # batches (float noise of ~1e-6 relative in the embeddings).
    assert torch.allclose(ours, theirs, atol=1e-4 if model == "tiny-sdxl" else 1e-5)


# --- images -------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny-sd", "tiny-sdxl"])
def test_decode_returns_one_rgb_image_per_output(load_family: Callable[..., Family], model: str) -> None:
    family = load_family(model)
    request = make_request(model, width=96, height=64, num_outputs=3, steps=3)
    state = family.prepare(request, family.encode([(request.prompt, request.negative_prompt)])[0])
    run_to_end(family, state)
    images = family.decode(state)
    assert len(images) == 3
    for image in images:
        assert isinstance(image, Image.Image)
        assert image.mode == "RGB" and image.size == (96, 64)


class _NoVAE:
    def __getattr__(self, name: str):
        raise AssertionError(f"preview touched the VAE ({name})")


@pytest.mark.parametrize("model,scheduler", [("tiny-sd", "euler"), ("tiny-sd", "dpmpp_2m"),
                                             ("tiny-sdxl", "euler")])
def test_preview_does_not_use_the_vae(load_family: Callable[..., Family], monkeypatch: pytest.MonkeyPatch,
                                      model: str, scheduler: str) -> None:
    family = load_family(model, scheduler)
    request = make_request(model, width=96, height=64, num_outputs=2)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    state = family.prepare(request, embeddings)
    monkeypatch.setattr(family, "vae", _NoVAE())
    first = family.preview(state)  # before any step: from the noisy latents
    family.step(state)
    after = family.preview(state)  # from the step's x0 prediction
    restored = family.preview(family.restore(request, embeddings, family.checkpoint(state)))  # right after a restore
    for image in (first, after, restored):
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        assert max(image.size) <= 64 and image.size[0] > image.size[1]
        assert np.asarray(image).std() > 0  # a picture, not one flat colour


# --- loading and the registry ---------------------------------------------------

def test_missing_checkpoint_names_path_and_command(tiny_spec: ModelSpec, tmp_path: Path) -> None:
    with pytest.raises(CheckpointMissingError) as info:
        UNetFamily(tiny_spec, "cpu", tmp_path / "nowhere")
    message = str(info.value)
    assert str(tmp_path / "nowhere" / "models" / "tiny-sd") in message
    assert "python manage.py make_tiny_models" in message
    assert isinstance(info.value, FileNotFoundError)


def test_incomplete_checkpoint_names_the_missing_part(tiny_spec: ModelSpec, tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny-sd" / "unet").mkdir(parents=True)
    with pytest.raises(CheckpointMissingError, match="lacks vae/"):
        UNetFamily(tiny_spec, "cpu", tmp_path)


def test_half_an_sdxl_checkpoint_names_the_missing_part(tmp_path: Path) -> None:
    path = tmp_path / "models" / "tiny-sdxl"
    for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler", "text_encoder_2"):
        (path / part).mkdir(parents=True)
    with pytest.raises(CheckpointMissingError, match="lacks tokenizer_2/"):
        UNetFamily(load_registry().get("tiny-sdxl"), "cpu", tmp_path)


def test_unknown_scheduler_fails_before_loading(tiny_spec: ModelSpec, data_dir: Path) -> None:
    with pytest.raises(ValueError, match="dpmpp_2m"):
        UNetFamily(dataclasses.replace(tiny_spec, scheduler="unipc"), "cpu", data_dir)


@pytest.mark.parametrize("model", ["tiny-sd", "tiny-sdxl"])
def test_memory_bytes_counts_the_weights(load_family: Callable[..., Family], model: str) -> None:
    family = load_family(model)
    modules = [family.unet, family.vae, family.text_encoder] + ([family.text_encoder_2] if family.is_sdxl else [])
    params = sum(p.numel() for m in modules for p in m.parameters())
    assert family.memory_bytes() >= params * 4 > 0


def test_registry_unet_entries() -> None:
    registry = load_registry()
    expected = {"tiny-sd": "euler", "tiny-sd-dpm": "dpmpp_2m", "tiny-sdxl": "euler", "tiny-sdxl-dpm": "dpmpp_2m"}
    for name, scheduler in expected.items():
        spec = registry.get(name)
        assert (spec.family, spec.backend, spec.scheduler) == ("unet", "diffusers", scheduler), name
        assert spec.path.startswith("{data_dir}/models/tiny-sd"), name
        assert spec.limits.max_width <= 256 and spec.limits.size_multiple == 16, name
        # Calibrated on a 2-core CPU: a default CFG step is some milliseconds.
        d = spec.defaults
        shape = JobShape("unet", d.width, d.height, d.num_frames, 1, d.guidance_scale)
        assert 0.004 < estimate_job_seconds(shape, spec.cost_points) < 0.02, name
