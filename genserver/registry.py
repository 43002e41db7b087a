"""The model registry: which models the service offers, their limits, costs and weights.

Plain Python, read from a TOML file (`GENSERVER_REGISTRY`, default the bundled
`registry.toml`). Used by the API (validation, `GET /models/`), the cost model
(calibration points), and the worker runtime (family, backend, local path).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genserver.scheduling.cost import FAMILY_GEOMETRY

BACKENDS = ("simulated", "diffusers")
KINDS = ("image", "video")
DTYPES = ("bfloat16", "float16", "float32")
ENCODE_DEVICES = ("", "cpu")  # "": the worker's device
DEFAULT_REGISTRY_PATH = Path(__file__).with_name("registry.toml")


@dataclass(frozen=True)
class Limits:
    min_size: int = 64
    max_width: int = 1024
    max_height: int = 1024
    size_multiple: int = 16  # latent cell: VAE downsampling × patch
    max_frames: int = 1
    frames_step: int = 1  # num_frames must be 1 + a multiple of this (Wan's VAE: 4)
    max_steps: int = 100
    max_prompt_chars: int = 2000
    max_guidance: float = 30.0


@dataclass(frozen=True)
class Defaults:
    width: int = 512
    height: int = 512
    num_frames: int = 1
    steps: int = 20
    guidance_scale: float = 7.0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # unet | flux | wan
    kind: str  # image | video
    backend: str  # simulated | diffusers
    cost_points: dict[int, float]  # tokens → TFLOP per 1k tokens per forward pass
    path: str = ""  # local directory of a diffusers checkpoint (backend = diffusers)
    description: str = ""
    max_batch: int = 1  # the most outputs (num_outputs) one job may ask for, denoised together
    # The most outputs one denoise batch may hold across merged jobs of the same shape
    # (model, size, frames, steps, guidance); 1 turns merging off. A small model fills the
    # card only with several images at once; a large one is compute-bound at one, and a
    # merged batch would only make each member wait for the others' rows.
    max_merge: int = 1
    limits: Limits = field(default_factory=Limits)
    defaults: Defaults = field(default_factory=Defaults)
    scheduler: str = "euler"
    fault_at_step: int = 0  # simulated backend only: raise at this step every time (poison-job drills)
    segment_frames: int = 0  # video: longer requests run as segments of this many frames (0: never)
    # Precision and speed (docs/CONFIGURATION.md, "Precision and speed"). dtype "": bfloat16 on
    # CUDA, float32 on CPU. variant: the weight files' suffix (e.g. "fp16": *.fp16.safetensors).
    dtype: str = ""
    variant: str = ""
    compile: bool = False  # torch.compile the denoiser (per repeated block where diffusers can), warmed up
    attention: str = ""  # a diffusers attention backend (set_attention_backend), "" = the default
    encode_device: str = ""  # "cpu": text encoders on the CPU, for cards too small to keep them
    # The denoise worker encodes a new prompt itself, before the first step, instead of the encode worker: one
    # Celery hop and the encode worker's queue fewer on an embedding miss, for the text encoders' memory on every
    # card that denoises the model (workers/memory_plan.py counts them), prompts batched only within a merged batch.
    encode_on_card: bool = False

    def resolved_dtype(self, device: str) -> str:
        """The dtype name weights and latents run in on `device` ("cuda…" or "cpu")."""
        if self.dtype:
            return self.dtype
        return "bfloat16" if str(device).startswith("cuda") else "float32"

    def resolved_path(self, data_dir: Path) -> Path:
        return Path(self.path.replace("{data_dir}", str(data_dir))).expanduser()

    def public(self) -> dict[str, Any]:
        """What `GET /api/v1/models/` shows."""
        return {
            "name": self.name,
            "family": self.family,
            "kind": self.kind,
            "backend": self.backend,
            "description": self.description,
            "limits": self.limits.__dict__ | {"max_outputs": self.max_batch},  # num_outputs at most
            "defaults": self.defaults.__dict__,
            "segment_frames": self.segment_frames,
            "max_merge": self.max_merge,  # same-shape jobs' outputs one denoise batch may hold
        }


class RegistryError(ValueError):
    pass


def _spec_from(name: str, raw: dict[str, Any]) -> ModelSpec:
    where = f"registry entry [models.{name}]"
    family, kind, backend = raw.get("family"), raw.get("kind", "image"), raw.get("backend", "simulated")
    if family not in FAMILY_GEOMETRY:
        raise RegistryError(f"{where}: family must be one of {sorted(FAMILY_GEOMETRY)}, got {family!r}")
    if kind not in KINDS:
        raise RegistryError(f"{where}: kind must be one of {KINDS}, got {kind!r}")
    if backend not in BACKENDS:
        raise RegistryError(f"{where}: backend must be one of {BACKENDS}, got {backend!r}")
    points = {int(k): float(v) for k, v in (raw.get("cost_points") or {}).items()}
    if not points or any(v <= 0 for v in points.values()):
        raise RegistryError(f'{where}: cost_points needs at least one positive entry, e.g. {{"4096" = 2.9}}')
    if backend == "diffusers" and not raw.get("path"):
        raise RegistryError(f"{where}: a diffusers model needs `path`, the local checkpoint directory")
    try:
        limits = Limits(**raw.get("limits", {}))
        defaults = Defaults(**raw.get("defaults", {}))
    except TypeError as exc:
        raise RegistryError(f"{where}: {exc}") from None
    max_merge = raw.get("max_merge", 1)
    if not isinstance(max_merge, int) or isinstance(max_merge, bool) or max_merge < 1:
        raise RegistryError(f"{where}: max_merge must be an integer ≥ 1 (1 = no merging), got {max_merge!r}")
    max_batch = raw.get("max_batch", 1)
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
        raise RegistryError(f"{where}: max_batch must be an integer ≥ 1 (num_outputs at most), got {max_batch!r}")
    if kind == "image" and limits.max_frames != 1:
        raise RegistryError(f"{where}: an image model must have max_frames = 1")
    segment_frames = int(raw.get("segment_frames", 0))
    if segment_frames and (kind != "video" or segment_frames < 1 or (segment_frames - 1) % limits.frames_step):
        raise RegistryError(
            f"{where}: segment_frames must be 1 + a multiple of frames_step "
            f"({limits.frames_step}) on a video model, got {segment_frames}"
        )
    dtype, variant = str(raw.get("dtype", "")), str(raw.get("variant", ""))
    if dtype and dtype not in DTYPES:
        raise RegistryError(
            f"{where}: dtype must be one of {DTYPES} (or absent: bfloat16 on CUDA, float32 on CPU), got {dtype!r}"
        )
    compile_denoiser = raw.get("compile", False)
    if not isinstance(compile_denoiser, bool):
        raise RegistryError(f"{where}: compile must be true or false, got {compile_denoiser!r}")
    encode_on_card = raw.get("encode_on_card", False)
    if not isinstance(encode_on_card, bool):
        raise RegistryError(f"{where}: encode_on_card must be true or false, got {encode_on_card!r}")
    encode_device = str(raw.get("encode_device", ""))
    if encode_device not in ENCODE_DEVICES:
        raise RegistryError(
            f'{where}: encode_device must be "cpu" (or absent: the worker\'s device), got {encode_device!r}'
        )
    return ModelSpec(
        name=name,
        family=family,
        kind=kind,
        backend=backend,
        cost_points=points,
        path=str(raw.get("path", "")),
        description=str(raw.get("description", "")),
        max_batch=max_batch,
        max_merge=max_merge,
        limits=limits,
        defaults=defaults,
        scheduler=str(raw.get("scheduler", "euler")),
        fault_at_step=int(raw.get("fault_at_step", 0)),
        segment_frames=segment_frames,
        dtype=dtype,
        variant=variant,
        compile=compile_denoiser,
        attention=str(raw.get("attention", "")),
        encode_device=encode_device,
        encode_on_card=encode_on_card,
    )


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelSpec]

    def get(self, name: str) -> ModelSpec:
        try:
            return self.models[name]
        except KeyError:
            raise RegistryError(f"unknown model {name!r}; available: {sorted(self.models)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.models

    def names(self) -> list[str]:
        return sorted(self.models)

    def missing_checkpoints(self, data_dir: Path) -> list[str]:
        """One readable line per diffusers model whose local checkpoint directory is absent."""
        return [
            f"model {spec.name!r}: checkpoint directory {spec.resolved_path(data_dir)} does not exist "
            f"(run `python manage.py make_tiny_models` for the tiny-* models, or fix `path` in the registry)"
            for spec in self.models.values()
            if spec.backend == "diffusers" and not spec.resolved_path(data_dir).is_dir()
        ]


def load_registry(paths: str | Path | None = None) -> Registry:
    """Read one registry file, or several joined by os.pathsep (later files add or replace models)."""
    files = [Path(p) for p in str(paths).split(os.pathsep) if p] if paths else [DEFAULT_REGISTRY_PATH]
    models: dict[str, ModelSpec] = {}
    for path in files:
        if not path.exists():
            raise RegistryError(f"model registry {path} does not exist; set GENSERVER_REGISTRY to a TOML file")
        raw = tomllib.loads(path.read_text())
        models.update({name: _spec_from(name, entry) for name, entry in raw.get("models", {}).items()})
    if not models:
        raise RegistryError(f"model registry {files} defines no [models.NAME] entry")
    return Registry(models)
