"""The contract every diffusion family keeps, run against each tiny checkpoint (as diffusers' PipelineTesterMixin).

Exact resumption from a checkpoint (here and in another process), a checkpoint
of plain CPU values, seeds, batch independence, the reference diffusers
pipeline, decoded pictures, VAE-free previews, and clear loading errors. The
cases are in tests/runtime/families.py; what only one family does is in
test_unet_family.py, test_flux_family.py and test_wan_family.py.
No Django, no database, no downloads: the checkpoints are generated into a tmp dir.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from genserver.registry import load_registry
from genserver.storage import LocalStorage
from tests.runtime.conftest import (
    RESUME_CASES,
    assert_same_scheduler_state,
    embed,
    family_class,
    generate,
    make_request,
    run_to_end,
)
from tests.runtime.families import CASES, COMMON_PARTS, FamilyCase, leaves_in, pictures, tensors_in
from tests.support.runtime import NoVAE
from workers.runtime import stages
from workers.runtime.base import Family, GenerationRequest
from workers.runtime.common import png_bytes
from workers.runtime.tiny_models import TINY_MODELS, ensure_tiny_models
from workers.runtime.video import poster

ALL = list(CASES.values())
BY_FAMILY = [CASES["tiny-sd"], CASES["tiny-flux"], CASES["tiny-wan"]]  # one checkpoint of each family
# Each family's schedulers, on one checkpoint of it.
SCHEDULER_CASES = [(model, scheduler) for model, scheduler in RESUME_CASES if model != "tiny-sdxl"]


# --- the tiny checkpoints -------------------------------------------------------


@pytest.mark.parametrize("case", ALL, ids=str)
def test_tiny_checkpoint_layout_size_and_determinism(data_dir: Path, tmp_path: Path, case: FamilyCase) -> None:
    path = data_dir / "models" / case.model
    for part in COMMON_PARTS + case.parts:
        assert (path / part).is_file(), part
    assert f'"{case.pipeline}"' in (path / "model_index.json").read_text()
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size < case.max_bytes
    again = case.writer(tmp_path / "again", 0)
    for part in case.same_bytes:
        assert (again / part).read_bytes() == (path / part).read_bytes(), part


def test_tiny_models_are_written_once_and_leave_nothing_behind(data_dir: Path) -> None:
    models = data_dir / "models"
    assert ensure_tiny_models(models) == []  # already there: nothing rewritten
    assert sorted(p.name for p in models.iterdir()) == sorted(TINY_MODELS)  # no temp dirs left behind


# --- encode -------------------------------------------------------------------


@pytest.mark.parametrize("case", BY_FAMILY, ids=str)
def test_encode_gives_one_cpu_embedding_per_pair_whatever_the_batch(
    load_family: Callable[..., Family], case: FamilyCase
) -> None:
    family = load_family(case.model)
    pairs = [("a cat", ""), ("a dog running in the sky", "ugly"), ("a cat", "")]
    out = family.encode(pairs)
    assert len(out) == 3
    for item in out:
        assert all(t.device.type == "cpu" and t.shape[0] == 1 for t in item.values())
    assert torch.equal(out[0]["prompt_embeds"], out[2]["prompt_embeds"])
    assert not torch.equal(out[0]["prompt_embeds"], out[1]["prompt_embeds"])
    # Batching (and the padding it brings) must not change an embedding.
    alone = family.encode([pairs[1]])[0]
    atol = 1e-5 if case.family == "flux" else 1e-6
    for key in alone:
        assert torch.allclose(alone[key], out[1][key], atol=atol), key


# --- checkpoint / restore -----------------------------------------------------


@pytest.mark.parametrize("model,scheduler", RESUME_CASES)
def test_resume_in_a_new_process_matches_straight_run(
    resumed_in_child: dict[str, dict[str, Any]], model: str, scheduler: str
) -> None:
    """Chunked: 1 step here, checkpoint → file → a separate Python process restores,
    runs to step 3, checkpoints through bytes, restores and finishes (conftest)."""
    case = resumed_in_child[f"{model}/{scheduler}"]
    assert case["step"] == case["steps"]
    assert torch.isfinite(case["straight"]).all()
    assert torch.allclose(case["resumed"], case["straight"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("model,scheduler", RESUME_CASES)
def test_restore_at_every_step_matches_straight_run(
    load_family: Callable[..., Family], model: str, scheduler: str
) -> None:
    family = load_family(model, scheduler)
    request = make_request(model, steps=5, num_outputs=2 if model == "tiny-flux" else 1)
    embeddings = embed(family, request)
    straight = run_to_end(family, family.prepare(request, embeddings))
    for stop_at in range(request.steps + 1):
        state = family.prepare(request, embeddings)
        for _ in range(stop_at):
            family.step(state)
        restored = family.restore(request, embeddings, family.checkpoint(state))
        assert restored.step == stop_at
        resumed = run_to_end(family, restored)
        if CASES[model].exact_resume:
            assert torch.equal(resumed, straight), stop_at
        else:
            assert torch.allclose(resumed, straight, atol=1e-6, rtol=0), stop_at


@pytest.mark.parametrize("model,scheduler", SCHEDULER_CASES)
def test_restored_scheduler_is_the_running_one(load_family: Callable[..., Family], model: str, scheduler: str) -> None:
    """After one more step, a restored scheduler's whole state (history and shift included, tensors
    exactly) and the generator's equal those of the run that never stopped."""
    family = load_family(model, scheduler)
    request = make_request(model, steps=5 if model != "tiny-wan" else 6, num_outputs=2 if model == "tiny-sd" else 1)
    embeddings = embed(family, request)
    for stop_at in (1, 2, 3):
        state = family.prepare(request, embeddings)
        for _ in range(stop_at):
            family.step(state)
        restored = family.restore(request, embeddings, family.checkpoint(state))
        family.step(state)
        family.step(restored)  # both positioned by a step now
        assert torch.equal(restored.latents, state.latents)
        assert_same_scheduler_state(restored.scheduler, state.scheduler)
        assert torch.equal(restored.generator.get_state(), state.generator.get_state())


@pytest.mark.parametrize(
    "model,scheduler",
    [
        ("tiny-sd", "euler"),
        ("tiny-sd", "dpmpp_2m"),
        ("tiny-sdxl", "dpmpp_2m"),
        ("tiny-flux", "flow_euler"),
        ("tiny-flux", "flow_dpmpp_2m"),
        ("tiny-wan", "unipc"),
    ],
)
def test_checkpoint_holds_cpu_tensors_and_plain_values(
    load_family: Callable[..., Family], model: str, scheduler: str
) -> None:
    family = load_family(model, scheduler)
    request = make_request(model)
    state = family.prepare(request, embed(family, request))
    family.step(state)
    family.step(state)
    data = family.checkpoint(state)
    assert data["format"] == CASES[model].checkpoint_format and data["model"] == model
    assert data["step"] == 2 and data["scheduler_step_index"] == 2
    assert all(t.device.type == "cpu" for t in tensors_in(data))
    for value in leaves_in(data):
        json.dumps(value)  # plain
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)  # no pickled objects
    # A copy: stepping on must not change what was saved.
    before = [t.clone() for t in tensors_in(data)]
    family.step(state)
    family.step(state)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors_in(data)))


@pytest.mark.parametrize("case", BY_FAMILY, ids=str)
def test_restore_refuses_another_step_count_or_scheduler(load_family: Callable[..., Family], case: FamilyCase) -> None:
    family = load_family(case.model)
    request = make_request(case.model, steps=6)
    embeddings = embed(family, request)
    data = family.checkpoint(family.prepare(request, embeddings))
    with pytest.raises(ValueError, match="6 steps"):
        family.restore(make_request(case.model, steps=8), embeddings, data)
    other, named = case.other_scheduler
    with pytest.raises(ValueError, match=named):
        load_family(case.model, other).restore(request, embeddings, data)


# --- seeds, batches and the reference pipeline -------------------------------------


@pytest.mark.parametrize("case", BY_FAMILY, ids=str)
def test_same_seed_same_output_different_seed_different(load_family: Callable[..., Family], case: FamilyCase) -> None:
    family = load_family(case.model)
    a = generate(family, make_request(case.model, seed=7, steps=3))
    b = generate(family, make_request(case.model, seed=7, steps=3))
    c = generate(family, make_request(case.model, seed=8, steps=3))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize(
    "model,scheduler,outputs",
    [
        ("tiny-sd", "euler", 3),
        ("tiny-sdxl", "euler", 2),
        ("tiny-sdxl", "dpmpp_2m", 2),
        ("tiny-flux", "flow_euler", 2),
        ("tiny-flux", "flow_dpmpp_2m", 2),
        ("tiny-wan", "unipc", 3),
    ],
)
def test_output_i_does_not_depend_on_num_outputs(
    load_family: Callable[..., Family], model: str, scheduler: str, outputs: int
) -> None:
    family = load_family(model, scheduler)
    request = make_request(model, seed=5, steps=4 if model != "tiny-wan" else 3)
    one = family.prepare(request, embed(family, request))
    many = family.prepare(dataclasses.replace(request, num_outputs=outputs), one.embeddings)
    run_to_end(family, one)
    run_to_end(family, many)
    # Same initial noise; only the batch size of the model's matmuls differs.
    assert torch.allclose(one.latents[0], many.latents[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(many.latents[0], many.latents[1])
    # And so the same picture (uint8 rounding aside).
    first = np.asarray(pictures(family.decode(one)[0], request)[0], np.int16)
    batched = np.asarray(pictures(family.decode(many)[0], request)[0], np.int16)
    assert np.abs(first - batched).max() <= 1


def _reference_latents(family: Any, request: GenerationRequest, data_dir: Path) -> torch.Tensor:
    """The same request through the diffusers pipeline of the family, with the registry's scheduler."""
    generator = torch.Generator("cpu").manual_seed(request.seed)
    common = dict(
        width=request.width,
        height=request.height,
        num_inference_steps=request.steps,
        guidance_scale=request.guidance_scale,
        generator=generator,
        output_type="latent",
    )
    if family.spec.family == "wan":
        from diffusers import WanPipeline

        # WanPipeline.from_pretrained needs `accelerate` for this transformer (see wan._load_model);
        # the modules are the ones loaded from the checkpoint, the loop and latent prep are diffusers'.
        pipe = WanPipeline(
            tokenizer=family.tokenizer,
            text_encoder=family.text_encoder,
            vae=family.vae,
            transformer=family.transformer,
            scheduler=family._new_scheduler(request.steps, 0),
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe(
            request.prompt,
            negative_prompt=request.negative_prompt,
            num_frames=request.num_frames,
            num_videos_per_prompt=request.num_outputs,
            **common,
        ).frames
    if family.spec.family == "flux":
        from diffusers import FluxPipeline as Pipeline
    elif family.spec.name.startswith("tiny-sdxl"):
        from diffusers import StableDiffusionXLPipeline as Pipeline
    else:
        from diffusers import StableDiffusionPipeline as Pipeline
    pipe = Pipeline.from_pretrained(data_dir / "models" / family.spec.name, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    # The registry's scheduler = the pipeline's own, swapped the usual diffusers way.
    pipe.scheduler = family.scheduler_class.from_config(pipe.scheduler.config, **family.scheduler_settings)
    negative = {} if family.spec.family == "flux" else {"negative_prompt": request.negative_prompt or None}
    return pipe(request.prompt, num_images_per_prompt=request.num_outputs, **negative, **common).images


@pytest.mark.parametrize(
    "model,scheduler,negative,atol",
    [
        # SD 1.5 matches exactly; SDXL's pipeline encodes prompt and negative in separate
        # batches (float noise of ~1e-6 relative in the embeddings).
        ("tiny-sd", "euler", "blurry", 1e-5),
        ("tiny-sd", "dpmpp_2m", "blurry", 1e-5),
        ("tiny-sdxl", "euler", "blurry", 1e-4),
        ("tiny-sdxl", "dpmpp_2m", "", 1e-4),
        ("tiny-flux", "flow_euler", "blurry", 1e-5),
        ("tiny-flux", "flow_dpmpp_2m", "blurry", 1e-5),
        ("tiny-wan", "unipc", "blurry", 1e-5),
        ("tiny-wan", "flow_euler", "blurry", 1e-5),
    ],
)
def test_matches_the_diffusers_pipeline(
    load_family: Callable[..., Family], data_dir: Path, model: str, scheduler: str, negative: str, atol: float
) -> None:
    family = load_family(model, scheduler)
    size = {} if model == "tiny-wan" else {"width": 96, "height": 64}
    request = make_request(model, num_outputs=2, negative_prompt=negative, **size)
    ours = generate(family, request)
    theirs = _reference_latents(family, request, data_dir)
    assert torch.allclose(ours, theirs, atol=atol)


# --- pictures -------------------------------------------------------------------


@pytest.mark.parametrize("case", ALL, ids=str)
def test_decode_returns_one_rgb_picture_per_output(load_family: Callable[..., Family], case: FamilyCase) -> None:
    family = load_family(case.model)
    video = case.family == "wan"
    request = make_request(
        case.model,
        width=96,
        height=64,
        num_outputs=2 if video else 3,
        steps=2 if video else 3,
        **({"num_frames": 5} if video else {}),
    )
    state = family.prepare(request, embed(family, request))
    run_to_end(family, state)
    decoded = family.decode(state)
    assert len(decoded) == request.num_outputs
    for output in decoded:
        for frame in pictures(output, request):
            assert isinstance(frame, Image.Image)
            assert frame.mode == "RGB" and frame.size == (96, 64)


@pytest.mark.parametrize("case", BY_FAMILY, ids=str)
def test_the_decode_stage_reads_the_checkpoint_alone(
    load_family: Callable[..., Family], case: FamilyCase, tmp_path: Path
) -> None:
    # The decode worker's stage: the job's last checkpoint in, its outputs stored. The prompt's embeddings
    # are stored nowhere, so a read of them would fail the decode: a VAE needs the latents only.
    family = load_family(case.model)
    video = case.family == "wan"
    request = make_request(case.model, width=96, height=64, steps=2, **({"num_frames": 5} if video else {}))
    state = family.prepare(request, embed(family, request))
    run_to_end(family, state)
    storage = LocalStorage(tmp_path)
    outputs = stages.decode(family, storage, request, checkpoint_ref=stages.save_checkpoint(family, storage, state))
    decoded = family.decode(state)[0]
    if video:
        assert [o["content_type"] for o in outputs] == ["video/mp4", "image/png"]
        assert storage.get(outputs[1]["key"]) == png_bytes(poster(decoded))
    else:
        assert [o["content_type"] for o in outputs] == ["image/png"]
        assert storage.get(outputs[0]["key"]) == png_bytes(decoded)
    with pytest.raises(stages.CheckpointUnreadable, match="no checkpoint to decode"):
        stages.decode(family, storage, request, checkpoint_ref="")


@pytest.mark.parametrize(
    "model,scheduler",
    [
        ("tiny-sd", "euler"),
        ("tiny-sd", "dpmpp_2m"),
        ("tiny-sdxl", "euler"),
        ("tiny-flux", "flow_euler"),
        ("tiny-flux", "flow_dpmpp_2m"),
        ("tiny-wan", "unipc"),
    ],
)
def test_preview_does_not_use_the_vae(
    load_family: Callable[..., Family], monkeypatch: pytest.MonkeyPatch, model: str, scheduler: str
) -> None:
    family = load_family(model, scheduler)
    request = make_request(model, width=96, height=64, num_outputs=2)
    embeddings = embed(family, request)
    state = family.prepare(request, embeddings)
    monkeypatch.setattr(family, "vae", NoVAE())
    first = family.preview(state)  # before any step: from the noisy latents
    family.step(state)
    after = family.preview(state)  # from the step's x0 estimate
    restored = family.preview(family.restore(request, embeddings, family.checkpoint(state)))  # right after a restore
    for image in (first, after, restored):
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        assert max(image.size) <= 64 and image.size[0] > image.size[1]
        assert np.asarray(image).std() > 0  # a picture, not one flat colour


# --- loading ----------------------------------------------------------------------


@pytest.mark.parametrize("case", ALL, ids=str)
def test_missing_checkpoint_names_path_and_command(tmp_path: Path, case: FamilyCase) -> None:
    cls = family_class(case.family)
    with pytest.raises(Exception) as info:
        cls(load_registry().get(case.model), "cpu", tmp_path / "nowhere")
    message = str(info.value)
    assert type(info.value).__name__ == "CheckpointMissingError" and isinstance(info.value, FileNotFoundError)
    assert str(tmp_path / "nowhere" / "models" / case.model) in message
    assert "python manage.py make_tiny_models" in message


@pytest.mark.parametrize("case", ALL, ids=str)
def test_incomplete_checkpoint_names_the_missing_part(tmp_path: Path, case: FamilyCase) -> None:
    present, missing = case.incomplete
    for part in present:
        (tmp_path / "models" / case.model / part).mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=missing) as info:
        family_class(case.family)(load_registry().get(case.model), "cpu", tmp_path)
    assert type(info.value).__name__ == "CheckpointMissingError"


@pytest.mark.parametrize("case", BY_FAMILY, ids=str)
def test_unknown_scheduler_fails_before_loading(data_dir: Path, case: FamilyCase) -> None:
    unknown, offered = case.unknown_scheduler
    spec = dataclasses.replace(load_registry().get(case.model), scheduler=unknown)
    with pytest.raises(ValueError, match=offered):
        family_class(case.family)(spec, "cpu", data_dir)


@pytest.mark.parametrize("case", ALL, ids=str)
def test_memory_bytes_counts_the_weights(load_family: Callable[..., Family], case: FamilyCase) -> None:
    family = load_family(case.model)
    params = sum(p.numel() for m in case.weights(family) for p in m.parameters())
    assert family.memory_bytes() >= params * 4 > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "model,scheduler",
    [
        ("tiny-sd", "euler"),
        ("tiny-sdxl", "dpmpp_2m"),
        ("tiny-flux", "flow_euler"),
        ("tiny-flux", "flow_dpmpp_2m"),
        ("tiny-wan", "unipc"),
    ],
)
def test_on_cuda_checkpoints_stay_on_cpu_and_resume_exactly(data_dir: Path, model: str, scheduler: str) -> None:
    spec = dataclasses.replace(load_registry().get(model), scheduler=scheduler)
    family = family_class(spec.family)(spec, "cuda", data_dir)
    request = make_request(model, num_outputs=2)
    embeddings = embed(family, request)
    assert all(t.device.type == "cpu" for t in embeddings.values())
    straight = run_to_end(family, family.prepare(request, embeddings))
    assert straight.device.type == "cuda"
    state = family.prepare(request, embeddings)
    for _ in range(3 if model == "tiny-wan" else 2):
        family.step(state)
    data = family.checkpoint(state)
    assert all(t.device.type == "cpu" for t in tensors_in(data))
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    data = torch.load(buffer, weights_only=True, map_location="cpu")
    resumed = run_to_end(family, family.restore(request, embeddings, data))
    assert torch.allclose(resumed, straight, atol=1e-6, rtol=0)
    decoded = family.decode(family.restore(request, embeddings, family.checkpoint(state)))
    assert len(decoded) == 2 and all(len(pictures(d, request)) >= 1 for d in decoded)
