"""The flow-matching transformer family (FLUX style) on the tiny random-weight checkpoint.

Exact resumption for both schedulers, packed latents, FluxPipeline parity, images, errors.
No Django, no database, no downloads: the checkpoint is generated into a tmp dir.
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

from genserver.registry import load_registry
from genserver.scheduling.cost import JobShape, estimate_job_seconds
from tests.runtime.conftest import RESUME_CASES, assert_same_scheduler_state, generate, make_request, run_to_end
from workers.runtime.base import Family
from workers.runtime.flux import (
    FLUX_SCHEDULERS,
    CheckpointMissingError,
    FluxFamily,
    calculate_shift,
    pack_latents,
    unpack_latents,
)
from workers.runtime.tiny_models import make_tiny_flux

FLUX_CASES = [case for case in RESUME_CASES if case[0] == "tiny-flux"]
SCHEDULERS = [scheduler for _, scheduler in FLUX_CASES]  # flow_euler, flow_dpmpp_2m


def flux_request(**overrides: Any):
    return make_request("tiny-flux", **({"guidance_scale": 3.5} | overrides))


@pytest.fixture(scope="module")
def flux(load_family: Callable[..., Family]) -> FluxFamily:
    return load_family("tiny-flux")


# --- the tiny checkpoint ------------------------------------------------------

def test_tiny_checkpoint_layout_size_and_determinism(data_dir: Path, tmp_path: Path) -> None:
    path = data_dir / "models" / "tiny-flux"
    for part in ("model_index.json", "transformer/config.json", "vae/config.json", "text_encoder/config.json",
                 "text_encoder_2/config.json", "tokenizer/vocab.json", "tokenizer_2/tokenizer.json",
                 "scheduler/scheduler_config.json"):
        assert (path / part).is_file(), part
    assert '"FluxPipeline"' in (path / "model_index.json").read_text()
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < 5_000_000
    again = make_tiny_flux(tmp_path / "again", seed=0)
    for part in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors", "text_encoder_2/model.safetensors",
                 "tokenizer_2/tokenizer.json"):
        assert (again / part).read_bytes() == (path / part).read_bytes(), part


def test_components_are_flux_shaped(flux: FluxFamily) -> None:
    assert flux.vae.config.latent_channels == 16 == flux.latent_channels
    assert flux.transformer.config.in_channels == 64  # 16 channels × 2×2 packing
    assert flux.transformer.config.guidance_embeds
    assert flux.vae.config.shift_factor and flux.vae_scale_factor == 8
    assert flux.max_sequence_length == 512
    assert type(flux.text_encoder_2).__name__ == "T5EncoderModel"


def test_tokenizers_take_any_prompt(flux: FluxFamily) -> None:
    prompts = ["", "a photo of the cat", "Ünïcödé 日本語 🐱\ttabs\nnewlines", "word " * 800]
    t5 = flux.tokenizer_2(prompts, padding="max_length", max_length=512, truncation=True).input_ids
    assert [len(row) for row in t5] == [512] * len(prompts)
    assert t5[1][:3] != t5[0][:3] and t5[1].count(flux.tokenizer_2.unk_token_id) == 0  # real pieces
    clip = flux.tokenizer(prompts, padding="max_length", max_length=77, truncation=True).input_ids
    assert [len(row) for row in clip] == [77] * len(prompts)


# --- encode -------------------------------------------------------------------

def test_encode_is_batched_on_cpu_and_ignores_negatives(flux: FluxFamily) -> None:
    out = flux.encode([("a cat", ""), ("a dog", "ugly"), ("a cat", "something else")])
    assert len(out) == 3
    for item in out:
        assert set(item) == {"prompt_embeds", "pooled_embeds"}
        assert item["prompt_embeds"].shape == (1, 512, 32) and item["pooled_embeds"].shape == (1, 32)
        assert all(t.device.type == "cpu" for t in item.values())
    # FLUX has no negative pass: the same prompt gives the same embeddings whatever the negative.
    assert torch.equal(out[0]["prompt_embeds"], out[2]["prompt_embeds"])
    assert not torch.equal(out[0]["prompt_embeds"], out[1]["prompt_embeds"])
    alone = flux.encode([("a dog", "")])[0]
    for key in alone:
        assert torch.allclose(alone[key], out[1][key], atol=1e-5), key


# --- geometry -------------------------------------------------------------------

def test_packing_round_trips_and_matches_the_pipeline() -> None:
    from diffusers import FluxPipeline

    latents = torch.randn(2, 16, 8, 12)
    packed = pack_latents(latents)
    assert packed.shape == (2, 4 * 6, 64)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 8, 12))
    assert torch.equal(unpack_latents(packed, 8, 12), latents)


def test_latents_are_packed_and_the_schedule_is_shifted(flux: FluxFamily) -> None:
    request = flux_request(width=96, height=64, num_outputs=2, steps=4)
    state = flux.prepare(request, flux.encode([(request.prompt, request.negative_prompt)])[0])
    assert state.latents.shape == (2, (64 // 16) * (96 // 16), 64)
    sigmas = state.scheduler.sigmas
    mu = calculate_shift(24)  # 24 image tokens: below FLUX's base length, so a mild shift
    base = torch.tensor(np.linspace(1.0, 1 / 4, 4), dtype=torch.float32)
    shifted = np.exp(mu) / (np.exp(mu) + (1 / base - 1))
    assert torch.allclose(sigmas[:-1], shifted, atol=1e-6) and sigmas[-1] == 0


def test_size_must_fit_the_packed_latent_grid(flux: FluxFamily) -> None:
    request = flux_request(width=72, height=64)
    with pytest.raises(ValueError, match="multiples of 16"):
        flux.prepare(request, flux.encode([(request.prompt, "")])[0])


# --- checkpoint / restore -----------------------------------------------------

@pytest.mark.parametrize("model,scheduler", FLUX_CASES)
def test_resume_in_a_new_process_matches_straight_run(resumed_in_child: dict[str, dict[str, Any]],
                                                      model: str, scheduler: str) -> None:
    """Chunked: 1 step here, checkpoint → file → a separate Python process restores,
    runs to step 3, checkpoints through bytes, restores and finishes (conftest)."""
    case = resumed_in_child[f"{model}/{scheduler}"]
    assert case["step"] == case["steps"]
    assert torch.allclose(case["resumed"], case["straight"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_restore_at_every_step_matches_straight_run(load_family: Callable[..., Family], scheduler: str) -> None:
    family = load_family("tiny-flux", scheduler)
    request = flux_request(steps=5, num_outputs=2)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    straight = run_to_end(family, family.prepare(request, embeddings))
    for stop_at in range(request.steps + 1):
        state = family.prepare(request, embeddings)
        for _ in range(stop_at):
            family.step(state)
        restored = family.restore(request, embeddings, family.checkpoint(state))
        assert restored.step == stop_at
        assert torch.equal(run_to_end(family, restored), straight), stop_at


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_restored_scheduler_is_the_running_one(load_family: Callable[..., Family], scheduler: str) -> None:
    """After one more step, a restored scheduler's whole state (shift included) equals the running one's."""
    family = load_family("tiny-flux", scheduler)
    request = flux_request(steps=5)
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


def test_dpm_history_is_checkpointed_and_matters(load_family: Callable[..., Family]) -> None:
    family = load_family("tiny-flux", "flow_dpmpp_2m")
    request = flux_request(steps=5)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    straight = run_to_end(family, family.prepare(request, embeddings))
    state = family.prepare(request, embeddings)
    family.step(state)
    data = family.checkpoint(state)
    # One step in: one slot of the order-2 history filled.
    assert data["scheduler_history"] == {"model_outputs_present": [False, True], "lower_order_nums": 1}
    blank = dict(data, scheduler_model_outputs=torch.zeros_like(data["scheduler_model_outputs"]))
    assert not torch.allclose(run_to_end(family, family.restore(request, embeddings, blank)), straight, atol=1e-4)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_checkpoint_holds_cpu_tensors_and_plain_values(load_family: Callable[..., Family], scheduler: str) -> None:
    family = load_family("tiny-flux", scheduler)
    request = flux_request()
    state = family.prepare(request, family.encode([(request.prompt, request.negative_prompt)])[0])
    family.step(state)
    family.step(state)
    data = family.checkpoint(state)
    assert data["format"] == "flux/1" and data["model"] == "tiny-flux"
    assert data["step"] == 2 and data["scheduler_step_index"] == 2
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            assert value.device.type == "cpu", key
        else:
            json.dumps(value)  # plain
    before = {k: v.clone() for k, v in data.items() if isinstance(v, torch.Tensor)}
    family.step(state)
    family.step(state)
    for key, value in before.items():
        assert torch.equal(data[key], value), key


def test_restore_refuses_another_shape_step_count_or_scheduler(flux: FluxFamily,
                                                               load_family: Callable[..., Family]) -> None:
    request = flux_request(steps=6)
    embeddings = flux.encode([(request.prompt, request.negative_prompt)])[0]
    data = flux.checkpoint(flux.prepare(request, embeddings))
    with pytest.raises(ValueError, match="6 steps"):
        flux.restore(flux_request(steps=8), embeddings, data)
    with pytest.raises(ValueError, match="do not fit"):
        flux.restore(flux_request(steps=6, width=128), embeddings, data)
    with pytest.raises(ValueError, match="FlowMatchEulerDiscreteScheduler"):
        load_family("tiny-flux", "flow_dpmpp_2m").restore(request, embeddings, data)
    with pytest.raises(ValueError, match="flux/1"):
        flux.restore(request, embeddings, data | {"format": "unet/2"})


# --- seeds and guidance -------------------------------------------------------------

def test_same_seed_same_output_different_seed_different(flux: FluxFamily) -> None:
    a = generate(flux, flux_request(seed=7, steps=3))
    b = generate(flux, flux_request(seed=7, steps=3))
    c = generate(flux, flux_request(seed=8, steps=3))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_guidance_is_an_embedding_not_a_second_pass(flux: FluxFamily, monkeypatch: pytest.MonkeyPatch) -> None:
    request = flux_request(steps=2, num_outputs=2)
    embeddings = flux.encode([(request.prompt, request.negative_prompt)])[0]
    batches, forward = [], flux.transformer.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        batches.append(kwargs["hidden_states"].shape[0])
        assert torch.equal(kwargs["guidance"], torch.full([2], 3.5))
        return forward(*args, **kwargs)

    monkeypatch.setattr(flux.transformer, "forward", counting)
    run_to_end(flux, flux.prepare(request, embeddings))
    assert batches == [2, 2]  # one pass per step, batch = outputs
    monkeypatch.undo()
    other = run_to_end(flux, flux.prepare(dataclasses.replace(request, guidance_scale=1.0), embeddings))
    assert not torch.allclose(other, run_to_end(flux, flux.prepare(request, embeddings)))


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_output_i_does_not_depend_on_num_outputs(load_family: Callable[..., Family], scheduler: str) -> None:
    family = load_family("tiny-flux", scheduler)
    request = flux_request(seed=5, steps=4)
    one = family.prepare(request, family.encode([(request.prompt, request.negative_prompt)])[0])
    two = family.prepare(dataclasses.replace(request, num_outputs=2), one.embeddings)
    run_to_end(family, one)
    run_to_end(family, two)
    assert torch.allclose(one.latents[0], two.latents[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(two.latents[0], two.latents[1])
    first, batched = np.asarray(family.decode(one)[0], np.int16), np.asarray(family.decode(two)[0], np.int16)
    assert np.abs(first - batched).max() <= 1


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_matches_the_diffusers_flux_pipeline(load_family: Callable[..., Family], data_dir: Path,
                                             scheduler: str) -> None:
    from diffusers import FluxPipeline

    family = load_family("tiny-flux", scheduler)
    request = flux_request(num_outputs=2, width=96, height=64)
    ours = generate(family, request)
    pipe = FluxPipeline.from_pretrained(data_dir / "models/tiny-flux", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    # The registry's scheduler, swapped in the usual diffusers way (flow_euler is the pipeline's own).
    pipe.scheduler = family.scheduler_class.from_config(pipe.scheduler.config, **family.scheduler_settings)
    theirs = pipe(request.prompt, width=request.width, height=request.height, num_inference_steps=request.steps,
                  guidance_scale=request.guidance_scale, num_images_per_prompt=request.num_outputs,
                  generator=torch.Generator("cpu").manual_seed(request.seed), output_type="latent").images
    assert torch.allclose(ours, theirs, atol=1e-5)


# --- images -------------------------------------------------------------------

def test_decode_returns_one_rgb_image_per_output(flux: FluxFamily) -> None:
    request = flux_request(width=96, height=64, num_outputs=3, steps=3)
    state = flux.prepare(request, flux.encode([(request.prompt, request.negative_prompt)])[0])
    run_to_end(flux, state)
    images = flux.decode(state)
    assert len(images) == 3
    for image in images:
        assert isinstance(image, Image.Image)
        assert image.mode == "RGB" and image.size == (96, 64)


class _NoVAE:
    def __getattr__(self, name: str):
        raise AssertionError(f"preview touched the VAE ({name})")


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_preview_does_not_use_the_vae(load_family: Callable[..., Family], monkeypatch: pytest.MonkeyPatch,
                                      scheduler: str) -> None:
    family = load_family("tiny-flux", scheduler)
    request = flux_request(width=96, height=64, num_outputs=2)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    state = family.prepare(request, embeddings)
    monkeypatch.setattr(family, "vae", _NoVAE())
    first = family.preview(state)  # before any step: the noise
    family.step(state)
    after = family.preview(state)  # the x0 estimate
    restored = family.preview(family.restore(request, embeddings, family.checkpoint(state)))
    for image in (first, after, restored):
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        assert max(image.size) <= 64 and image.size[0] > image.size[1]
        assert np.asarray(image).std() > 0


# --- loading and the registry ---------------------------------------------------

def test_missing_checkpoint_names_path_and_command(tmp_path: Path) -> None:
    with pytest.raises(CheckpointMissingError) as info:
        FluxFamily(load_registry().get("tiny-flux"), "cpu", tmp_path / "nowhere")
    message = str(info.value)
    assert str(tmp_path / "nowhere" / "models" / "tiny-flux") in message
    assert "python manage.py make_tiny_models" in message
    assert isinstance(info.value, FileNotFoundError)


def test_incomplete_checkpoint_names_the_missing_part(tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny-flux" / "transformer").mkdir(parents=True)
    with pytest.raises(CheckpointMissingError, match="lacks vae/, text_encoder/"):
        FluxFamily(load_registry().get("tiny-flux"), "cpu", tmp_path)


def test_unknown_scheduler_fails_before_loading(data_dir: Path) -> None:
    spec = dataclasses.replace(load_registry().get("tiny-flux"), scheduler="dpmpp_2m")
    with pytest.raises(ValueError, match="flow_dpmpp_2m"):
        FluxFamily(spec, "cpu", data_dir)


def test_memory_bytes_counts_the_weights(flux: FluxFamily) -> None:
    modules = (flux.transformer, flux.vae, flux.text_encoder, flux.text_encoder_2)
    params = sum(p.numel() for m in modules for p in m.parameters())
    assert flux.memory_bytes() >= params * 4 > 0


def test_registry_flux_entries() -> None:
    registry = load_registry()
    for name, scheduler in (("tiny-flux", "flow_euler"), ("tiny-flux-dpm", "flow_dpmpp_2m")):
        spec = registry.get(name)
        assert (spec.family, spec.kind, spec.backend, spec.scheduler) == ("flux", "image", "diffusers", scheduler)
        assert spec.path == "{data_dir}/models/tiny-flux" and scheduler in FLUX_SCHEDULERS
        assert spec.limits.max_width <= 256 and spec.limits.size_multiple == 16
        # Calibrated on a 2-core CPU: one pass (no CFG) over 512 text + 16 image tokens, some milliseconds.
        d = spec.defaults
        shape = JobShape("flux", d.width, d.height, d.num_frames, 1, d.guidance_scale)
        assert shape.cfg_passes() == 1 and shape.tokens() == 528
        assert 0.003 < estimate_job_seconds(shape, spec.cost_points) < 0.02, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_on_cuda_checkpoints_stay_on_cpu_and_resume_exactly(data_dir: Path, scheduler: str) -> None:
    spec = dataclasses.replace(load_registry().get("tiny-flux"), scheduler=scheduler)
    family = FluxFamily(spec, "cuda", data_dir)
    request = flux_request(num_outputs=2)
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
