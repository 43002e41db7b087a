"""What only the flow-matching transformer family (FLUX style) does, on the tiny random-weight checkpoint.

Packed latents, the shifted schedule, guidance as an embedding. The contract every
family keeps (resumption, seeds, FluxPipeline parity, errors) is tested in
test_family_contract.py. No Django, no database, no downloads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from genserver.registry import load_registry
from genserver.scheduling.cost import JobShape, estimate_job_seconds
from tests.runtime.conftest import make_request, run_to_end
from workers.runtime.base import Family
from workers.runtime.flux import FLUX_SCHEDULERS, FluxFamily, calculate_shift, pack_latents, unpack_latents


def flux_request(**overrides: Any):
    return make_request("tiny-flux", **({"guidance_scale": 3.5} | overrides))


@pytest.fixture(scope="module")
def flux(load_family: Callable[..., Family]) -> FluxFamily:
    return load_family("tiny-flux")


# --- the tiny checkpoint ------------------------------------------------------


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


def test_restore_refuses_another_shape_step_count_or_scheduler(
    flux: FluxFamily, load_family: Callable[..., Family]
) -> None:
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


# --- loading and the registry ---------------------------------------------------


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
