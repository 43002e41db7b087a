"""What only the video family does, on the tiny random-weight Wan checkpoint: geometry, history, MP4.

The contract every family keeps (resumption, seeds, reference pipeline, errors)
is tested in test_family_contract.py. No Django, no database, no downloads.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image

from genserver.registry import ModelSpec
from genserver.scheduling.cost import JobShape, estimate_job_seconds
from tests.runtime.conftest import embed, generate, make_request as request_for, run_to_end
from workers.runtime.base import Family, GenerationRequest
from workers.runtime.video import encode_mp4, poster, read_mp4
from workers.runtime.wan import SCHEDULERS, WanFamily


def make_request(**overrides) -> GenerationRequest:
    return request_for("tiny-wan", **overrides)


@pytest.fixture(scope="module")
def families(load_family: Callable[..., Family]) -> dict[str, WanFamily]:
    """One loaded family per scheduler."""
    return {name: load_family("tiny-wan", name) for name in SCHEDULERS}


# --- the tiny checkpoint ------------------------------------------------------


def test_tokenizer_takes_any_prompt(wan_family: WanFamily) -> None:
    prompts = ["", "a photo of the cat", "Ünïcödé 日本語 🐱\ttabs\nnewlines", "word " * 800]
    ids = wan_family.tokenizer(prompts, padding="max_length", max_length=512, truncation=True).input_ids
    assert [len(row) for row in ids] == [512] * len(prompts)
    assert all(0 <= i < wan_family.text_encoder.config.vocab_size for row in ids for i in row)


# --- encode -------------------------------------------------------------------


def test_encode_is_batched_trimmed_and_on_cpu(wan_family: WanFamily) -> None:
    pairs = [("a cat", ""), ("a dog running in the sky", "ugly"), ("a cat", "")]
    out = wan_family.encode(pairs)
    assert len(out) == 3
    for item in out:
        assert set(item) == {"prompt_embeds", "negative_embeds"}
        for tensor in item.values():
            assert tensor.ndim == 3 and tensor.shape[0] == 1 and tensor.shape[2] == 32
            assert 1 <= tensor.shape[1] <= 512 and tensor.device.type == "cpu"
    assert out[1]["prompt_embeds"].shape[1] > out[0]["prompt_embeds"].shape[1]  # trimmed to the real tokens
    assert torch.equal(out[0]["prompt_embeds"], out[2]["prompt_embeds"])
    # Batching (and the padding it brings) must not change an embedding.
    alone = wan_family.encode([("a dog running in the sky", "ugly")])[0]
    assert torch.allclose(alone["prompt_embeds"], out[1]["prompt_embeds"], atol=1e-6)
    assert torch.allclose(alone["negative_embeds"], out[1]["negative_embeds"], atol=1e-6)


# --- prepare ------------------------------------------------------------------


def test_latents_have_wan_geometry(wan_family: WanFamily) -> None:
    emb = embed(wan_family, make_request())
    for w, h, f, n in [(64, 64, 9, 1), (96, 64, 17, 2), (64, 128, 1, 3)]:
        state = wan_family.prepare(make_request(width=w, height=h, num_frames=f, num_outputs=n), emb)
        assert tuple(state.latents.shape) == (n, 16, 1 + (f - 1) // 4, h // 8, w // 8)
        assert state.step == 0
    with pytest.raises(ValueError, match="num_frames"):
        wan_family.prepare(make_request(num_frames=8), emb)
    with pytest.raises(ValueError, match="multiples of 16"):
        wan_family.prepare(make_request(width=72), emb)


# --- checkpoint / restore -----------------------------------------------------


@pytest.mark.parametrize("scheduler", [s for s in SCHEDULERS if s != "flow_euler"])
def test_multistep_history_is_full_after_the_warm_up(families: dict[str, WanFamily], scheduler: str) -> None:
    family = families[scheduler]
    request = make_request(steps=6)
    state = family.prepare(request, embed(family, request))
    for _ in range(3):
        family.step(state)
    history = family.checkpoint(state)["scheduler_history"]
    assert history["lower_order_nums"] == 2
    assert all(isinstance(t, torch.Tensor) for t in history["model_outputs"])


def test_without_the_history_resume_would_differ(families: dict[str, WanFamily]) -> None:
    """Guards the test above: the multistep history really matters for the result."""
    family = families["unipc"]
    request = make_request(steps=5)
    embeddings = embed(family, request)
    straight = run_to_end(family, family.prepare(request, embeddings))
    state = family.prepare(request, embeddings)
    family.step(state)
    family.step(state)
    data = family.checkpoint(state)
    data["scheduler_history"] = {}
    assert not torch.allclose(run_to_end(family, family.restore(request, embeddings, data)), straight, atol=1e-6)


def test_restore_refuses_another_step_count_or_scheduler(families: dict[str, WanFamily]) -> None:
    request = make_request(steps=6)
    embeddings = embed(families["unipc"], request)
    data = families["unipc"].checkpoint(families["unipc"].prepare(request, embeddings))
    with pytest.raises(ValueError, match="6 steps"):
        families["unipc"].restore(make_request(steps=8), embeddings, data)
    with pytest.raises(ValueError, match="UniPCMultistepScheduler"):
        families["dpmpp_2m"].restore(request, embeddings, data)
    assert data["scheduler_class"] == "UniPCMultistepScheduler"
    with pytest.raises(ValueError, match="wan/1"):
        families["unipc"].restore(request, embeddings, {"format": "unet/1"})


# --- seeds, guidance and the reference pipeline -----------------------------------


def test_guidance_one_skips_the_negative_pass(wan_family: WanFamily) -> None:
    request = make_request(guidance_scale=1.0, steps=2)
    state = wan_family.prepare(request, embed(wan_family, request))
    wan_family.step(state)
    assert state.extra["encoder_hidden_states"].shape[0] == 1  # no [uncond, cond] batch
    assert not torch.allclose(generate(wan_family, request), generate(wan_family, make_request(steps=2)))


def test_loads_as_a_plain_wan_pipeline(wan_data_dir: Path) -> None:
    pytest.importorskip("accelerate", reason="diffusers loads WanTransformer3DModel only with accelerate")
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(wan_data_dir / "models" / "tiny-wan", local_files_only=True)
    assert type(pipe.transformer).__name__ == "WanTransformer3DModel"


# --- frames, preview, MP4 ---------------------------------------------------------


def test_a_one_frame_video_decodes_to_one_frame(wan_family: WanFamily) -> None:
    single = make_request(num_frames=1, steps=1)
    state = wan_family.prepare(single, embed(wan_family, single))
    assert [len(v) for v in wan_family.decode(state)] == [1]


def test_mp4_round_trip_of_decoded_frames(wan_family: WanFamily) -> None:
    request = make_request(num_frames=9, steps=2)
    state = wan_family.prepare(request, embed(wan_family, request))
    run_to_end(wan_family, state)
    (frames,) = wan_family.decode(state)
    data = encode_mp4(frames, fps=16)
    assert data[4:8] == b"ftyp" and data.find(b"moov") < data.find(b"mdat")  # faststart: index first
    back = read_mp4(data)
    assert len(back) == 9 and all(f.size == (64, 64) for f in back)
    assert encode_mp4(frames, fps=16) == data  # deterministic bytes
    still = poster(frames)
    assert still.size == (64, 64) and still.mode == "RGB"


def test_mp4_pads_odd_sizes_and_checks_input() -> None:
    import av

    frames = [Image.new("RGB", (65, 33), (i * 40, 100, 200)) for i in range(3)]
    data = encode_mp4(frames, fps=8)
    back = read_mp4(data)
    assert len(back) == 3 and back[0].size == (66, 34)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
        assert stream.average_rate == 8
    with pytest.raises(ValueError):
        encode_mp4([])
    with pytest.raises(ValueError, match="same size"):
        encode_mp4([Image.new("RGB", (64, 64)), Image.new("RGB", (32, 32))])


# --- loading and the registry ---------------------------------------------------


def test_registry_entry_is_a_small_video_model(wan_spec: ModelSpec) -> None:
    assert (wan_spec.family, wan_spec.kind, wan_spec.backend, wan_spec.scheduler) == (
        "wan",
        "video",
        "diffusers",
        "unipc",
    )
    limits, defaults = wan_spec.limits, wan_spec.defaults
    assert limits.frames_step == 4 and (defaults.num_frames - 1) % 4 == 0
    assert defaults.num_frames <= limits.max_frames and defaults.width <= limits.max_width
    # Calibrated on a 2-core CPU: a default CFG step is a few milliseconds.
    shape = JobShape("wan", defaults.width, defaults.height, defaults.num_frames, 1, defaults.guidance_scale)
    assert 0.001 < estimate_job_seconds(shape, wan_spec.cost_points) < 0.02
