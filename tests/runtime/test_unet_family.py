"""The UNet family on the tiny random-weight checkpoint: exact resumption, images, errors.

No Django, no database, no downloads: the checkpoint is generated into a tmp dir.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image

from genserver.registry import ModelSpec
from workers.runtime.base import DenoiseState, GenerationRequest
from workers.runtime.tiny_models import TINY_MODELS, ensure_tiny_models, make_tiny_unet
from workers.runtime.unet import CheckpointMissingError, UNetFamily

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_request(**overrides) -> GenerationRequest:
    fields = dict(job_id="job-1", model="tiny-sd", prompt="a red cat on a sofa", negative_prompt="blurry",
                  width=64, height=64, num_frames=1, steps=6, guidance_scale=5.0, seed=1234, num_outputs=1)
    return GenerationRequest(**(fields | overrides))


def run_to_end(family: UNetFamily, state: DenoiseState) -> torch.Tensor:
    while not state.done:
        family.step(state)
    return state.latents


def generate(family: UNetFamily, request: GenerationRequest) -> torch.Tensor:
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    return run_to_end(family, family.prepare(request, embeddings))


# --- the tiny checkpoint ------------------------------------------------------

def test_tiny_checkpoint_layout_size_and_idempotence(data_dir: Path) -> None:
    models = data_dir / "models"
    path = models / "tiny-sd"
    for part in ("model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
                 "tokenizer/vocab.json", "tokenizer/merges.txt", "scheduler/scheduler_config.json"):
        assert (path / part).is_file(), part
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < 5_000_000
    assert ensure_tiny_models(models) == []  # already there: nothing rewritten
    assert sorted(p.name for p in models.iterdir()) == sorted(TINY_MODELS)  # no temp dirs left behind


def test_tiny_checkpoint_is_deterministic(data_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_unet(tmp_path / "again", seed=0)
    for part in ("unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                 "tokenizer/vocab.json"):
        assert (again / part).read_bytes() == (data_dir / "models/tiny-sd" / part).read_bytes(), part


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


# --- checkpoint / restore -----------------------------------------------------

CHILD = textwrap.dedent("""
    import dataclasses, sys
    from pathlib import Path
    import torch
    from genserver.registry import load_registry
    from workers.runtime.base import GenerationRequest
    from workers.runtime.unet import UNetFamily

    data_dir, saved, result = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    blob = torch.load(saved)
    spec = dataclasses.replace(load_registry().get("tiny-sd"), scheduler=blob["scheduler"])
    family = UNetFamily(spec, "cpu", data_dir)
    request = GenerationRequest(**blob["request"])
    state = family.restore(request, blob["embeddings"], blob["checkpoint"])
    while not state.done:
        family.step(state)
    torch.save({"latents": state.latents, "step": state.step}, result)
""")


@pytest.mark.parametrize("scheduler", ["euler", "euler_a"])  # euler_a draws noise: the generator matters
def test_resume_in_a_new_process_matches_straight_run(tiny_spec: ModelSpec, data_dir: Path,
                                                      tmp_path: Path, scheduler: str) -> None:
    family = UNetFamily(dataclasses.replace(tiny_spec, scheduler=scheduler), "cpu", data_dir)
    request = make_request(num_outputs=2, steps=6)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    straight = run_to_end(family, family.prepare(request, embeddings))

    state = family.prepare(request, embeddings)
    family.step(state)
    family.step(state)
    saved = tmp_path / "job.pt"
    torch.save({"request": dataclasses.asdict(request), "embeddings": embeddings, "scheduler": scheduler,
                "checkpoint": family.checkpoint(state)}, saved)

    result = tmp_path / "result.pt"
    env = os.environ | {"PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(data_dir), str(saved), str(result)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = torch.load(result)
    assert resumed["step"] == request.steps
    assert torch.allclose(resumed["latents"], straight, atol=1e-6, rtol=0)


def test_restore_at_every_step_matches_straight_run(family: UNetFamily) -> None:
    request = make_request(steps=5)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    straight = run_to_end(family, family.prepare(request, embeddings))
    for stop_at in range(request.steps + 1):
        state = family.prepare(request, embeddings)
        for _ in range(stop_at):
            family.step(state)
        restored = family.restore(request, embeddings, family.checkpoint(state))
        assert restored.step == stop_at
        assert torch.allclose(run_to_end(family, restored), straight, atol=1e-6, rtol=0), stop_at


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_checkpoints_stay_on_cpu_and_resume_exactly(tiny_spec: ModelSpec, data_dir: Path) -> None:
    family = UNetFamily(tiny_spec, "cuda", data_dir)
    request = make_request(num_outputs=2)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    assert all(t.device.type == "cpu" for t in embeddings.values())
    straight = run_to_end(family, family.prepare(request, embeddings))
    assert straight.device.type == "cuda"
    state = family.prepare(request, embeddings)
    family.step(state)
    data = family.checkpoint(state)
    assert all(v.device.type == "cpu" for v in data.values() if isinstance(v, torch.Tensor))
    resumed = run_to_end(family, family.restore(request, embeddings, data))
    assert torch.allclose(resumed, straight, atol=1e-6, rtol=0)
    assert len(family.decode(family.restore(request, embeddings, family.checkpoint(state)))) == 2


def test_checkpoint_holds_cpu_tensors_and_plain_values(family: UNetFamily) -> None:
    request = make_request()
    state = family.prepare(request, family.encode([(request.prompt, request.negative_prompt)])[0])
    family.step(state)
    data = family.checkpoint(state)
    assert data["step"] == 1 and data["scheduler_step_index"] == 1
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            assert value.device.type == "cpu", key
        else:
            json.dumps(value)  # plain
    # A copy: stepping on must not change what was saved.
    before = data["latents"].clone()
    family.step(state)
    assert torch.equal(data["latents"], before)


def test_restore_refuses_another_step_count(family: UNetFamily) -> None:
    request = make_request(steps=6)
    embeddings = family.encode([(request.prompt, request.negative_prompt)])[0]
    data = family.checkpoint(family.prepare(request, embeddings))
    with pytest.raises(ValueError, match="6 steps"):
        family.restore(make_request(steps=8), embeddings, data)


# --- seeds ----------------------------------------------------------------------

def test_same_seed_same_output_different_seed_different(family: UNetFamily) -> None:
    a = generate(family, make_request(seed=7))
    b = generate(family, make_request(seed=7))
    c = generate(family, make_request(seed=8))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_output_i_does_not_depend_on_num_outputs(family: UNetFamily) -> None:
    one = generate(family, make_request(seed=5, num_outputs=1))
    three = generate(family, make_request(seed=5, num_outputs=3))
    # Same initial noise; only the batch size of the UNet's matmuls differs.
    assert torch.allclose(one[0], three[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(three[0], three[1])


def test_matches_the_diffusers_pipeline(family: UNetFamily, data_dir: Path) -> None:
    from diffusers import StableDiffusionPipeline

    request = make_request(num_outputs=2)
    ours = generate(family, request)
    pipe = StableDiffusionPipeline.from_pretrained(data_dir / "models/tiny-sd", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(request.prompt, negative_prompt=request.negative_prompt, width=request.width,
                  height=request.height, num_inference_steps=request.steps,
                  guidance_scale=request.guidance_scale, num_images_per_prompt=request.num_outputs,
                  generator=torch.Generator("cpu").manual_seed(request.seed), output_type="latent").images
    assert torch.allclose(ours, theirs, atol=1e-5)


# --- images -------------------------------------------------------------------

def test_decode_returns_one_rgb_image_per_output(family: UNetFamily) -> None:
    request = make_request(width=96, height=64, num_outputs=3, steps=3)
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


def test_preview_does_not_use_the_vae(family: UNetFamily, monkeypatch: pytest.MonkeyPatch) -> None:
    request = make_request(width=96, height=64, num_outputs=2)
    state = family.prepare(request, family.encode([(request.prompt, request.negative_prompt)])[0])
    monkeypatch.setattr(family, "vae", _NoVAE())
    first = family.preview(state)  # before any step: from the noisy latents
    family.step(state)
    after = family.preview(state)  # from the step's x0 prediction
    for image in (first, after):
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        assert max(image.size) <= 64 and image.size[0] > image.size[1]


# --- loading ------------------------------------------------------------------

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


def test_memory_bytes_counts_the_weights(family: UNetFamily) -> None:
    params = sum(p.numel() for m in (family.unet, family.vae, family.text_encoder) for p in m.parameters())
    assert family.memory_bytes() >= params * 4 > 0
