"""Helpers every diffusers family shares: checkpoint folders, scheduler history, previews, pixels, bytes.

The families (unet.py, flux.py, wan.py) import from here, never from each other.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from genserver import config
from genserver.registry import ModelSpec

from .base import DenoiseState, GenerationRequest

PREVIEW_MAX_SIDE = 64


# --- checkpoint folders ---------------------------------------------------------


class CheckpointMissingError(FileNotFoundError):
    """The model's local checkpoint directory (or one of its components) is missing."""


def missing_checkpoint_message(spec: ModelSpec, path: Path, missing: list[str]) -> str:
    what = "does not exist" if not path.is_dir() else "lacks " + ", ".join(f"{c}/" for c in missing)
    return (
        f"model {spec.name!r}: checkpoint directory {path} {what}. "
        f"For the tiny test models run `python manage.py make_tiny_models`; otherwise "
        f"put a diffusers checkpoint there (or fix `path` in the registry)."
    )


def check_checkpoint_dir(spec: ModelSpec, path: Path, components: tuple[str, ...]) -> None:
    """Raise CheckpointMissingError naming the path, what lacks, and how to make the tiny models."""
    missing = [c for c in components if not (path / c).is_dir()]
    if missing:
        raise CheckpointMissingError(missing_checkpoint_message(spec, path, missing))


def scheduler_class(
    family: str, table: dict[str, tuple[str, dict[str, Any]]], name: str
) -> tuple[type, dict[str, Any]]:
    """The diffusers class and settings that the registry's `scheduler = name` stands for."""
    import diffusers

    try:
        class_name, settings = table[name]
    except KeyError:
        raise ValueError(f"{family} family: unknown scheduler {name!r}; known: {sorted(table)}") from None
    return getattr(diffusers, class_name), dict(settings)


# --- scheduler history ------------------------------------------------------------
# Multistep solvers (DPM-Solver++) keep a history besides their position: the last
# `solver_order` converted model outputs (x0 predictions) and how many lower-order
# warm-up steps they have taken. The position itself is `step_index`, restored
# through the public `set_begin_index`. Single-step schedulers (Euler, Euler a,
# flow-matching Euler) have no history; their dict is empty. Tensors keep the dtype
# they ran in: a bf16 state is saved and restored as bf16, so resuming is exact.


def scheduler_history(scheduler: Any) -> dict[str, Any]:
    """The multistep history as checkpoint entries: plain values + one stacked CPU tensor."""
    if not hasattr(scheduler, "model_outputs"):
        return {}
    outputs = list(scheduler.model_outputs)
    present = [o is not None for o in outputs]
    first = next((o for o in outputs if o is not None), None)
    stacked = (
        torch.stack([o if o is not None else torch.zeros_like(first) for o in outputs])
        if first is not None
        else torch.zeros(0)
    )
    return {
        # Plain values: which history slots are filled, the warm-up count.
        "scheduler_history": {"model_outputs_present": present, "lower_order_nums": int(scheduler.lower_order_nums)},
        # One tensor, [solver_order, *latent shape]; empty slots are zeros.
        "scheduler_model_outputs": host_copy(stacked),
    }


def restore_scheduler_history(scheduler: Any, data: dict[str, Any], device: str) -> None:
    """Put back what `scheduler_history` saved, on a scheduler fresh from set_timesteps."""
    history = data.get("scheduler_history")
    if not hasattr(scheduler, "model_outputs"):
        if history:
            raise ValueError(f"checkpoint has a multistep history, {type(scheduler).__name__} keeps none")
        return
    if history is None:
        raise ValueError(f"checkpoint lacks the multistep history that {type(scheduler).__name__} needs")
    present = history["model_outputs_present"]
    if len(present) != len(scheduler.model_outputs):
        raise ValueError(f"checkpoint's solver order {len(present)} != the scheduler's {len(scheduler.model_outputs)}")
    stacked = data["scheduler_model_outputs"]
    scheduler.model_outputs = [stacked[i].to(device) if filled else None for i, filled in enumerate(present)]
    scheduler.lower_order_nums = int(history["lower_order_nums"])


def scheduler_attributes(scheduler: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The named scheduler attributes as CPU tensor copies and plain values (a generic history)."""
    return {name: to_cpu(getattr(scheduler, name)) for name in names if hasattr(scheduler, name)}


def to_cpu(value: Any) -> Any:
    """Tensors → CPU copies (dtype kept), numpy scalars → Python numbers, lists stay lists."""
    if isinstance(value, torch.Tensor):
        return host_copy(value)
    if isinstance(value, (list, tuple)):
        return [to_cpu(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `tensor`, bit for bit. From a card, into page-locked memory (PyTorch's cached pinned
    blocks): a Wan checkpoint's five 8 MB tensors came over in 0.5 ms instead of 14 ms on an H200."""
    tensor = tensor.detach()
    if tensor.device.type != "cuda":
        return tensor.to("cpu", copy=True)
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    copy.copy_(tensor)  # synchronous: the state moves on right after
    return copy


def to_device(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    return value


# --- restoring a state ------------------------------------------------------------


def resumed_state(
    scheduler: Any,
    data: dict[str, Any],
    request: GenerationRequest,
    embeddings: dict[str, Any],
    device: str,
    dtype: torch.dtype,
) -> DenoiseState:
    """The tail of a restore: the scheduler's history, the RNG and the latents back in place. The
    latents in the model's `dtype` (what they ran in: a no-op for a checkpoint of this entry, a cast
    for one made before its dtype changed); the history and x0 estimate in the dtype they were saved
    in (a scheduler may keep them in fp32 for a bf16 model)."""
    if type(scheduler).__name__ != data["scheduler_class"]:
        raise ValueError(f"checkpoint used {data['scheduler_class']}, the model now uses {type(scheduler).__name__}")
    restore_scheduler_history(scheduler, data, device)
    generator = torch.Generator("cpu")
    generator.set_state(data["generator_state"])
    state = DenoiseState(
        request=request,
        step=int(data["step"]),
        latents=data["latents"].to(device, dtype),
        embeddings=embeddings,
        scheduler=scheduler,
        generator=generator,
    )
    restore_denoised(state, data, device)
    return state


def restore_denoised(state: DenoiseState, data: dict[str, Any], device: str) -> None:
    """The checkpoint's x0 estimate back in `state.extra` (older checkpoints have none: a multistep
    history's newest prediction stands in, as in `last_denoised`)."""
    denoised = data.get("denoised")
    if denoised is not None:
        state.extra["denoised"] = denoised.to(device)
    elif (fallback := last_denoised(state)) is not None:
        state.extra["denoised"] = fallback


def last_denoised(state: DenoiseState) -> torch.Tensor | None:
    """The latest x0 estimate: from the last step, or a restored multistep history's last prediction."""
    denoised = state.extra.get("denoised")
    outputs = getattr(state.scheduler, "model_outputs", None)
    if denoised is None and outputs and outputs[-1] is not None:
        denoised = outputs[-1]
    return denoised


# --- previews, pixels, PNG ----------------------------------------------------------


def latent_preview(latent: torch.Tensor, factors: torch.Tensor, bias: torch.Tensor | None = None) -> Image.Image:
    """A small RGB picture of one [C, h, w] latent by a linear C→3 projection, upscaled to ~64 px."""
    latent = latent.detach().to("cpu", torch.float32)
    rgb = torch.einsum("chw,cr->rhw", latent[: factors.shape[0]], factors)
    if bias is not None:
        rgb = rgb + bias[:, None, None]
    rgb = ((rgb + 1) / 2).clamp(0, 1)
    image = Image.fromarray((rgb.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
    h, w = latent.shape[-2:]
    scale = max(1, PREVIEW_MAX_SIDE // max(h, w))
    return image.resize((w * scale, h * scale), Image.NEAREST) if scale > 1 else image


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """A VAE's output in [-1, 1], channels first ([n, 3, H, W] or [n, 3, F, H, W]) → uint8 on the CPU,
    channels last, rounded as the diffusers image processor does."""
    # Denormalized in the VAE's dtype, then scaled in fp32 (VaeImageProcessor.postprocess's order).
    pixels = ((pixels / 2 + 0.5).clamp(0, 1).float() * 255).round().to(torch.uint8)
    return pixels.movedim(1, -1).cpu().numpy()


def pil_images(pixels: torch.Tensor) -> list[Image.Image]:
    """[n, 3, H, W] in [-1, 1] → n RGB images."""
    return [Image.fromarray(array) for array in to_uint8(pixels)]


def png_bytes(image: Image.Image) -> bytes:
    """The image as a PNG at GENSERVER_PNG_COMPRESS_LEVEL (genserver.config: what the level trades)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=config.png_compress_level())
    return buf.getvalue()
