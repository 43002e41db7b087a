"""The video family on the tiny random-weight Wan checkpoint: exact resumption, frames, MP4, errors.

No Django, no database, no downloads: the checkpoint is generated into a tmp dir.
"""
from __future__ import annotations

import dataclasses
import io
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from genserver.registry import ModelSpec
from genserver.scheduling.cost import JobShape, estimate_job_seconds
from tests.runtime.conftest import resume_in_child
from workers.runtime.base import DenoiseState, GenerationRequest
from workers.runtime.tiny_wan import make_tiny_wan
from workers.runtime.video import encode_mp4, poster, read_mp4
from workers.runtime.wan import SCHEDULERS, CheckpointMissingError, WanFamily


def make_request(**overrides) -> GenerationRequest:
    fields = dict(job_id="job-v", model="tiny-wan", prompt="a red cat walking on the sea", negative_prompt="blurry",
                  width=64, height=64, num_frames=9, steps=6, guidance_scale=5.0, seed=1234, num_outputs=1)
    return GenerationRequest(**(fields | overrides))


def run_to_end(family: WanFamily, state: DenoiseState) -> torch.Tensor:
    while not state.done:
        family.step(state)
    return state.latents


def embed(family: WanFamily, request: GenerationRequest) -> dict:
    return family.encode([(request.prompt, request.negative_prompt)])[0]


def generate(family: WanFamily, request: GenerationRequest) -> torch.Tensor:
    return run_to_end(family, family.prepare(request, embed(family, request)))


@pytest.fixture(scope="module")
def families(wan_family: WanFamily, wan_spec: ModelSpec, wan_data_dir: Path) -> dict[str, WanFamily]:
    """One loaded family per scheduler (the registry entry's default reused)."""
    out = {wan_spec.scheduler: wan_family}
    for name in SCHEDULERS:
        if name not in out:
            out[name] = WanFamily(dataclasses.replace(wan_spec, scheduler=name), "cpu", wan_data_dir)
    return out


# --- the tiny checkpoint ------------------------------------------------------

def test_tiny_checkpoint_layout_size_and_determinism(wan_data_dir: Path, tmp_path: Path) -> None:
    path = wan_data_dir / "models" / "tiny-wan"
    for part in ("model_index.json", "transformer/config.json", "vae/config.json", "text_encoder/config.json",
                 "tokenizer/tokenizer.json", "scheduler/scheduler_config.json"):
        assert (path / part).is_file(), part
    assert '"WanPipeline"' in (path / "model_index.json").read_text()
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < 8_000_000
    started = time.perf_counter()
    again = make_tiny_wan(tmp_path / "again", seed=0)
    assert time.perf_counter() - started < 60
    for part in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors", "tokenizer/tokenizer.json"):
        assert (again / part).read_bytes() == (path / part).read_bytes(), part


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
    for (w, h, f, n) in [(64, 64, 9, 1), (96, 64, 17, 2), (64, 128, 1, 3)]:
        state = wan_family.prepare(make_request(width=w, height=h, num_frames=f, num_outputs=n), emb)
        assert tuple(state.latents.shape) == (n, 16, 1 + (f - 1) // 4, h // 8, w // 8)
        assert state.step == 0
    with pytest.raises(ValueError, match="num_frames"):
        wan_family.prepare(make_request(num_frames=8), emb)
    with pytest.raises(ValueError, match="multiples of 16"):
        wan_family.prepare(make_request(width=72), emb)


# --- checkpoint / restore -----------------------------------------------------


@pytest.fixture(scope="module")
def resumed_in_child(families: dict[str, WanFamily], wan_data_dir: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per scheduler: the straight run's final latents and those of a run cut into three
    chunks, the last two in one separate Python process (one for all: starting it costs seconds).

    Chunk 1 (here) stops after one step, so a multistep solver's history is half full;
    chunk 2 (child) runs to step 3 and checkpoints again; chunk 3 finishes.
    """
    tmp = tmp_path_factory.mktemp("wan-resume")
    cases, straight = {}, {}
    for scheduler, family in families.items():
        # Two outputs (the batch must resume as one), non-square, several latent frames.
        request = make_request(num_outputs=2, steps=6, width=96, height=64)
        embeddings = embed(family, request)
        straight[scheduler] = run_to_end(family, family.prepare(request, embeddings))
        state = family.prepare(request, embeddings)
        family.step(state)
        cases[scheduler] = {"model": "tiny-wan", "scheduler": scheduler, "request": dataclasses.asdict(request),
                            "embeddings": embeddings, "checkpoint": family.checkpoint(state), "until": 3}
    resumed = resume_in_child(wan_data_dir, cases, tmp)
    return {name: {"straight": straight[name], "resumed": resumed[name]["latents"], "step": resumed[name]["step"]}
            for name in cases}


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_resume_in_a_new_process_matches_straight_run(resumed_in_child: dict[str, dict], scheduler: str) -> None:
    case = resumed_in_child[scheduler]
    assert case["step"] == 6
    assert torch.isfinite(case["straight"]).all()
    assert torch.allclose(case["resumed"], case["straight"], atol=1e-6, rtol=0)


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, np.ndarray):
        return np.array_equal(x, y)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(i, j) for i, j in zip(x, y))
    return x == y


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_restored_scheduler_equals_the_running_one(families: dict[str, WanFamily], scheduler: str) -> None:
    """Every scheduler attribute (history included, tensors exactly) except where each was told to begin."""
    family = families[scheduler]
    request = make_request(steps=6)
    embeddings = embed(family, request)
    state = family.prepare(request, embeddings)
    for _ in range(3):
        family.step(state)
    checkpoint = family.checkpoint(state)
    if scheduler != "flow_euler":  # the multistep solvers: past the warm-up, the history is full
        history = checkpoint["scheduler_history"]
        assert history["lower_order_nums"] == 2
        assert all(isinstance(t, torch.Tensor) for t in history["model_outputs"])
    restored = family.restore(request, embeddings, checkpoint)
    family.step(state)
    family.step(restored)  # both positioned by a step now
    a, b = state.scheduler, restored.scheduler
    differing = sorted(k for k in (vars(a).keys() | vars(b).keys()) - {"_begin_index"}
                       if not _same(getattr(a, k, None), getattr(b, k, None)))
    assert not differing, differing


@pytest.mark.parametrize("scheduler", ["unipc", "dpmpp_2m"])
def test_restore_at_every_step_matches_straight_run(families: dict[str, WanFamily], scheduler: str) -> None:
    family = families[scheduler]
    request = make_request(steps=5)
    embeddings = embed(family, request)
    straight = run_to_end(family, family.prepare(request, embeddings))
    for stop_at in range(request.steps + 1):
        state = family.prepare(request, embeddings)
        for _ in range(stop_at):
            family.step(state)
        restored = family.restore(request, embeddings, family.checkpoint(state))
        assert restored.step == stop_at
        assert torch.equal(run_to_end(family, restored), straight), stop_at


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


def test_checkpoint_holds_cpu_tensors_and_plain_values(families: dict[str, WanFamily]) -> None:
    family = families["unipc"]
    request = make_request()
    state = family.prepare(request, embed(family, request))
    family.step(state)
    family.step(state)
    data = family.checkpoint(state)
    assert data["format"] == "wan/1" and data["step"] == 2 and data["scheduler_step_index"] == 2
    assert data["scheduler_class"] == "UniPCMultistepScheduler"
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # no pickled objects

    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from tensors(v)
        elif isinstance(value, list):
            for v in value:
                yield from tensors(v)

    assert all(t.device.type == "cpu" for t in tensors(loaded))
    # Copies: stepping on must not change what was saved.
    before = [t.clone() for t in tensors(data)]
    family.step(state)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors(data)))


def test_restore_refuses_another_step_count_or_scheduler(families: dict[str, WanFamily]) -> None:
    request = make_request(steps=6)
    embeddings = embed(families["unipc"], request)
    data = families["unipc"].checkpoint(families["unipc"].prepare(request, embeddings))
    with pytest.raises(ValueError, match="6 steps"):
        families["unipc"].restore(make_request(steps=8), embeddings, data)
    with pytest.raises(ValueError, match="UniPCMultistepScheduler"):
        families["dpmpp_2m"].restore(request, embeddings, data)
    with pytest.raises(ValueError, match="wan/1"):
        families["unipc"].restore(request, embeddings, {"format": "unet/1"})


# --- seeds, guidance and the reference pipeline -----------------------------------

def test_same_seed_same_output_different_seed_different(wan_family: WanFamily) -> None:
    a = generate(wan_family, make_request(seed=7, steps=3))
    b = generate(wan_family, make_request(seed=7, steps=3))
    c = generate(wan_family, make_request(seed=8, steps=3))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_output_i_does_not_depend_on_num_outputs(wan_family: WanFamily) -> None:
    one = generate(wan_family, make_request(seed=5, num_outputs=1, steps=3))
    three = generate(wan_family, make_request(seed=5, num_outputs=3, steps=3))
    assert torch.allclose(one[0], three[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(three[0], three[1])


def test_guidance_one_skips_the_negative_pass(wan_family: WanFamily) -> None:
    request = make_request(guidance_scale=1.0, steps=2)
    state = wan_family.prepare(request, embed(wan_family, request))
    wan_family.step(state)
    assert state.extra["encoder_hidden_states"].shape[0] == 1  # no [uncond, cond] batch
    assert not torch.allclose(generate(wan_family, request), generate(wan_family, make_request(steps=2)))


@pytest.mark.parametrize("scheduler", ["unipc", "flow_euler"])
def test_matches_the_diffusers_wan_pipeline(families: dict[str, WanFamily], scheduler: str) -> None:
    from diffusers import WanPipeline

    family = families[scheduler]
    request = make_request(num_outputs=2)
    ours = generate(family, request)
    # WanPipeline.from_pretrained needs `accelerate` for this transformer (see wan._load_model);
    # the modules are the ones loaded from the checkpoint, the loop and latent prep are diffusers'.
    pipe = WanPipeline(tokenizer=family.tokenizer, text_encoder=family.text_encoder, vae=family.vae,
                       transformer=family.transformer, scheduler=family._new_scheduler(request.steps, 0))
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(request.prompt, negative_prompt=request.negative_prompt, width=request.width,
                  height=request.height, num_frames=request.num_frames, num_inference_steps=request.steps,
                  guidance_scale=request.guidance_scale, num_videos_per_prompt=request.num_outputs,
                  generator=torch.Generator("cpu").manual_seed(request.seed), output_type="latent").frames
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_loads_as_a_plain_wan_pipeline(wan_data_dir: Path) -> None:
    pytest.importorskip("accelerate", reason="diffusers loads WanTransformer3DModel only with accelerate")
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(wan_data_dir / "models" / "tiny-wan", local_files_only=True)
    assert type(pipe.transformer).__name__ == "WanTransformer3DModel"


# --- frames, preview, MP4 ---------------------------------------------------------

def test_decode_returns_num_frames_rgb_frames_per_output(wan_family: WanFamily) -> None:
    request = make_request(width=96, height=64, num_frames=5, num_outputs=2, steps=2)
    state = wan_family.prepare(request, embed(wan_family, request))
    run_to_end(wan_family, state)
    videos = wan_family.decode(state)
    assert len(videos) == 2
    for frames in videos:
        assert len(frames) == 5
        for frame in frames:
            assert isinstance(frame, Image.Image) and frame.mode == "RGB" and frame.size == (96, 64)
    single = make_request(num_frames=1, steps=1)
    state = wan_family.prepare(single, embed(wan_family, single))
    assert [len(v) for v in wan_family.decode(state)] == [1]


class _NoVAE:
    def __getattr__(self, name: str):
        raise AssertionError(f"preview touched the VAE ({name})")


def test_preview_does_not_use_the_vae(wan_family: WanFamily, monkeypatch: pytest.MonkeyPatch) -> None:
    request = make_request(width=96, height=64, num_outputs=2)
    state = wan_family.prepare(request, embed(wan_family, request))
    monkeypatch.setattr(wan_family, "vae", _NoVAE())
    first = wan_family.preview(state)  # before any step: from the noisy latents
    wan_family.step(state)
    after = wan_family.preview(state)  # from the step's x0 estimate
    for image in (first, after):
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        assert max(image.size) <= 64 and image.size[0] > image.size[1]


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

def test_missing_checkpoint_names_path_and_command(wan_spec: ModelSpec, tmp_path: Path) -> None:
    with pytest.raises(CheckpointMissingError) as info:
        WanFamily(wan_spec, "cpu", tmp_path / "nowhere")
    message = str(info.value)
    assert str(tmp_path / "nowhere" / "models" / "tiny-wan") in message
    assert "python manage.py make_tiny_models" in message
    assert isinstance(info.value, FileNotFoundError)


def test_incomplete_checkpoint_names_the_missing_part(wan_spec: ModelSpec, tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny-wan" / "transformer").mkdir(parents=True)
    with pytest.raises(CheckpointMissingError, match="lacks vae/"):
        WanFamily(wan_spec, "cpu", tmp_path)


def test_unknown_scheduler_fails_before_loading(wan_spec: ModelSpec, wan_data_dir: Path) -> None:
    with pytest.raises(ValueError, match="unipc"):
        WanFamily(dataclasses.replace(wan_spec, scheduler="euler"), "cpu", wan_data_dir)


def test_memory_bytes_counts_the_weights(wan_family: WanFamily) -> None:
    modules = (wan_family.transformer, wan_family.vae, wan_family.text_encoder)
    params = sum(p.numel() for m in modules for p in m.parameters())
    assert wan_family.memory_bytes() >= params * 4 > 0


def test_registry_entry_is_a_small_video_model(wan_spec: ModelSpec) -> None:
    assert (wan_spec.family, wan_spec.kind, wan_spec.backend, wan_spec.scheduler) == \
        ("wan", "video", "diffusers", "unipc")
    limits, defaults = wan_spec.limits, wan_spec.defaults
    assert limits.frames_step == 4 and (defaults.num_frames - 1) % 4 == 0
    assert defaults.num_frames <= limits.max_frames and defaults.width <= limits.max_width
    # Calibrated on a 2-core CPU: a default CFG step is a few milliseconds.
    shape = JobShape("wan", defaults.width, defaults.height, defaults.num_frames, 1, defaults.guidance_scale)
    assert 0.001 < estimate_job_seconds(shape, wan_spec.cost_points) < 0.02


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_checkpoints_stay_on_cpu_and_resume_exactly(wan_spec: ModelSpec, wan_data_dir: Path) -> None:
    family = WanFamily(wan_spec, "cuda", wan_data_dir)
    request = make_request(num_outputs=2)
    embeddings = embed(family, request)
    assert all(t.device.type == "cpu" for t in embeddings.values())
    straight = run_to_end(family, family.prepare(request, embeddings))
    assert straight.device.type == "cuda"
    state = family.prepare(request, embeddings)
    for _ in range(3):
        family.step(state)
    data = family.checkpoint(state)
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    data = torch.load(buffer, weights_only=True, map_location="cpu")
    resumed = run_to_end(family, family.restore(request, embeddings, data))
    assert torch.allclose(resumed, straight, atol=1e-6, rtol=0)
    videos = family.decode(family.restore(request, embeddings, family.checkpoint(state)))
    assert [len(v) for v in videos] == [request.num_frames] * 2
