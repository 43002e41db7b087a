"""What only the UNet family (SD 1.5 and SDXL) does, on the tiny random-weight checkpoints.

The contract every family keeps (resumption, seeds, reference pipeline, errors)
is tested in test_family_contract.py. No Django, no database, no downloads.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from genserver.registry import load_registry
from genserver.scheduling.cost import JobShape, estimate_job_seconds
from tests.runtime.conftest import make_request, run_to_end
from workers.runtime.base import Family
from workers.runtime.unet import UNetFamily

# --- the tiny checkpoints -------------------------------------------------------


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


def test_a_unet_1_checkpoint_still_restores(family: UNetFamily) -> None:
    """unet/1 (before the multistep history) differs only by keys Euler never had."""
    request = make_request(steps=4)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    straight = run_to_end(family, family.prepare(request, embeddings))
    state = family.prepare(request, embeddings)
    family.step(state)
    data = family.checkpoint(state) | {"format": "unet/1"}
    assert torch.allclose(run_to_end(family, family.restore(request, embeddings, data)), straight, atol=1e-6)


# --- loading and the registry ---------------------------------------------------


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
