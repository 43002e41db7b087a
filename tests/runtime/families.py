"""What the family contract suite (test_family_contract.py) needs to know about each tiny checkpoint.

One `FamilyCase` per registry model whose checkpoint the suite exercises; a
new family is one more entry here (and its adapter in workers/runtime/cache.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from workers.runtime.base import Family, GenerationRequest
from workers.runtime.tiny_models import TINY_MODELS

COMMON_PARTS = ("model_index.json", "vae/config.json", "text_encoder/config.json", "scheduler/scheduler_config.json")


@dataclass(frozen=True)
class FamilyCase:
    model: str  # the registry entry (and tiny checkpoint folder) under test
    family: str
    pipeline: str  # model_index.json's class: the checkpoint loads as this diffusers pipeline
    parts: tuple[str, ...]  # files the tiny checkpoint holds besides COMMON_PARTS
    same_bytes: tuple[str, ...]  # files a second write with the same seed reproduces byte for byte
    max_bytes: int
    checkpoint_format: str
    incomplete: tuple[tuple[str, ...], str]  # (the only folders present, the message naming what lacks)
    unknown_scheduler: tuple[str, str]  # (a scheduler of another family, what the error offers)
    other_scheduler: tuple[str, str]  # (a scheduler of this family, the class its checkpoint names)
    weights: Callable[[Family], list[torch.nn.Module]]  # the modules whose parameters memory_bytes counts
    exact_resume: bool = True  # restore at any step gives bit-equal latents (else within 1e-6)

    def __str__(self) -> str:
        return self.model

    @property
    def writer(self) -> Callable[[Path, int], Path]:
        return TINY_MODELS[self.model]


def _unet_weights(family: Any) -> list[torch.nn.Module]:
    return [family.unet, family.vae, family.text_encoder] + ([family.text_encoder_2] if family.is_sdxl else [])


_UNET_BYTES = ("unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors", "tokenizer/vocab.json")
_UNET_PARTS = ("unet/config.json", "tokenizer/vocab.json", "tokenizer/merges.txt")
_TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"

SD = FamilyCase(
    model="tiny-sd",
    family="unet",
    pipeline="StableDiffusionPipeline",
    parts=_UNET_PARTS,
    same_bytes=_UNET_BYTES,
    max_bytes=5_000_000,
    checkpoint_format="unet/2",
    incomplete=(("unet",), "lacks vae/"),
    unknown_scheduler=("unipc", "dpmpp_2m"),
    other_scheduler=("dpmpp_2m", "EulerDiscreteScheduler"),
    weights=_unet_weights,
    exact_resume=False,
)
SDXL = FamilyCase(
    model="tiny-sdxl",
    family="unet",
    pipeline="StableDiffusionXLPipeline",
    parts=_UNET_PARTS + ("text_encoder_2/config.json", "tokenizer_2/vocab.json", "tokenizer_2/merges.txt"),
    same_bytes=_UNET_BYTES + ("text_encoder_2/model.safetensors", "tokenizer_2/tokenizer_config.json"),
    max_bytes=5_000_000,
    checkpoint_format="unet/2",
    incomplete=(("unet", "vae", "text_encoder", "tokenizer", "scheduler", "text_encoder_2"), "lacks tokenizer_2/"),
    unknown_scheduler=("unipc", "dpmpp_2m"),
    other_scheduler=("dpmpp_2m", "EulerDiscreteScheduler"),
    weights=_unet_weights,
    exact_resume=False,
)
FLUX = FamilyCase(
    model="tiny-flux",
    family="flux",
    pipeline="FluxPipeline",
    parts=(
        "transformer/config.json",
        "text_encoder_2/config.json",
        "tokenizer/vocab.json",
        "tokenizer_2/tokenizer.json",
    ),
    same_bytes=(
        _TRANSFORMER,
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
        "text_encoder_2/model.safetensors",
        "tokenizer_2/tokenizer.json",
    ),
    max_bytes=5_000_000,
    checkpoint_format="flux/1",
    incomplete=(("transformer",), "lacks vae/, text_encoder/"),
    unknown_scheduler=("dpmpp_2m", "flow_dpmpp_2m"),
    other_scheduler=("flow_dpmpp_2m", "FlowMatchEulerDiscreteScheduler"),
    weights=lambda f: [f.transformer, f.vae, f.text_encoder, f.text_encoder_2],
)
WAN = FamilyCase(
    model="tiny-wan",
    family="wan",
    pipeline="WanPipeline",
    parts=("transformer/config.json", "tokenizer/tokenizer.json"),
    same_bytes=(
        _TRANSFORMER,
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
        "tokenizer/tokenizer.json",
    ),
    max_bytes=8_000_000,
    checkpoint_format="wan/1",
    incomplete=(("transformer",), "lacks vae/"),
    unknown_scheduler=("euler", "unipc"),
    other_scheduler=("dpmpp_2m", "UniPCMultistepScheduler"),
    weights=lambda f: [f.transformer, f.vae, f.text_encoder],
)

CASES: dict[str, FamilyCase] = {case.model: case for case in (SD, SDXL, FLUX, WAN)}


def pictures(decoded: Any, request: GenerationRequest) -> list[Image.Image]:
    """One output of `Family.decode` as its frames: an image is one frame, a video `num_frames`."""
    frames = decoded if isinstance(decoded, list) else [decoded]
    assert len(frames) == (request.num_frames if isinstance(decoded, list) else 1)
    return frames


def tensors_in(value: Any):
    """Every tensor in a checkpoint (whose values may nest dicts and lists)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def leaves_in(value: Any):
    """Every value in a checkpoint that is not a tensor, a dict or a list."""
    if isinstance(value, dict):
        for item in value.values():
            yield from leaves_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from leaves_in(item)
    elif not isinstance(value, torch.Tensor):
        yield value
