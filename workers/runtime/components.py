"""Which diffusers/transformers components each stage of each family holds, and how they are built.

A job runs in three stages, often in three worker processes (tasks/): encode,
denoise, decode. Each loads only what it uses, so one card running FLUX holds
one transformer, not three:

    encode    tokenizers + text encoders           prompts → embeddings
    denoise   the UNet or transformer              + the scheduler config and the small
                                                     latent→RGB preview tables (no weights)
    decode    the VAE                              latents → pixels

Every stage also reads the other components' config.json files (a few KB): the
denoiser needs the VAE's downsampling factor for the latent shape, the decoder
the scheduler config to restore a checkpoint. Those are configs, never weights.

`build_stage` is the one function that builds a stage's modules, three ways:

    weights="checkpoint"  from_pretrained(<path>/<name>) in the entry's dtype, local files only
    weights="random"      from_config(<name>/config.json), random init on `device` (GPU benchmarks)
    weights="meta"        from_config under torch.device("meta"): no memory, exact byte counts
                          (workers/memory_plan.py); tokenizers are skipped

A folder holding only model_index.json and <component>/config.json files (no
weights) builds with "meta" and "random".
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from genserver import config
from genserver.registry import ModelSpec

STAGES = ("encode", "denoise", "decode")
WEIGHTS = ("checkpoint", "random", "meta")

# family → stage → component folder → "library:Class". ONE table per family: the loaders,
# the memory plan and the tests all read it. Components named in OPTIONAL belong to the
# stage only when the checkpoint has them (SDXL's second CLIP; SD 1.5 has none).
FAMILY_COMPONENTS: dict[str, dict[str, dict[str, str]]] = {
    "unet": {
        "encode": {
            "tokenizer": "transformers:CLIPTokenizer",
            "text_encoder": "transformers:CLIPTextModel",
            "tokenizer_2": "transformers:CLIPTokenizer",
            "text_encoder_2": "transformers:CLIPTextModelWithProjection",
        },
        "denoise": {"unet": "diffusers:UNet2DConditionModel"},
        "decode": {"vae": "diffusers:AutoencoderKL"},
    },
    "flux": {
        "encode": {
            "tokenizer": "transformers:CLIPTokenizer",
            "text_encoder": "transformers:CLIPTextModel",
            # transformers 5's T5Tokenizer is the tokenizers-backed one (formerly T5TokenizerFast).
            "tokenizer_2": "transformers:T5Tokenizer",
            "text_encoder_2": "transformers:T5EncoderModel",
        },
        "denoise": {"transformer": "diffusers:FluxTransformer2DModel"},
        "decode": {"vae": "diffusers:AutoencoderKL"},
    },
    "wan": {
        "encode": {"tokenizer": "transformers:AutoTokenizer", "text_encoder": "transformers:UMT5EncoderModel"},
        "denoise": {"transformer": "diffusers:WanTransformer3DModel"},
        "decode": {"vae": "diffusers:AutoencoderKLWan"},
    },
}
OPTIONAL: dict[str, tuple[str, ...]] = {"unet": ("tokenizer_2", "text_encoder_2")}
# Config-only folders every stage reads (no weights): the scheduler's settings.
SCHEDULER_DIR = "scheduler"


def checkpoint_dir(spec: ModelSpec, data_dir: Path | str | None = None) -> Path:
    """The entry's checkpoint folder; "{data_dir}" is GENSERVER_DATA_DIR's value unless given."""
    if data_dir is None:
        data_dir = config.data_dir()
    return spec.resolved_path(Path(data_dir))


def torch_dtype(spec: ModelSpec, device: str) -> Any:
    """The torch dtype the entry's weights and latents run in on `device` (ModelSpec.resolved_dtype)."""
    import torch

    return getattr(torch, spec.resolved_dtype(device))


def _class(path: str) -> type:
    library, name = path.split(":")
    return getattr(importlib.import_module(library), name)


def stage_components(spec: ModelSpec, stage: str, *, data_dir: Path | str | None = None) -> dict[str, type]:
    """{component folder: class} that `stage` of this entry loads, e.g. {"unet": UNet2DConditionModel}."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")
    try:
        table = FAMILY_COMPONENTS[spec.family][stage]
    except KeyError:
        raise ValueError(
            f"model {spec.name!r}: family {spec.family!r} has no diffusers components "
            f"(known: {sorted(FAMILY_COMPONENTS)})"
        ) from None
    optional = OPTIONAL.get(spec.family, ())
    root = checkpoint_dir(spec, data_dir)
    return {name: _class(path) for name, path in table.items() if name not in optional or (root / name).is_dir()}


def read_config(root: Path, name: str) -> dict[str, Any]:
    """<root>/<name>/config.json (scheduler: scheduler_config.json) as a dict; no weights read."""
    folder = root / name
    for file in ("config.json", "scheduler_config.json"):
        if (folder / file).is_file():
            return json.loads((folder / file).read_text())
    raise FileNotFoundError(
        f"{folder} has no config.json: every component folder of a diffusers "
        f"checkpoint needs one (see docs/CONFIGURATION.md, `path`)"
    )


def is_tokenizer(cls: type) -> bool:
    return "Tokenizer" in cls.__name__


def _is_transformers(cls: type) -> bool:
    return cls.__module__.startswith("transformers")


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    """New floating tensors in `dtype` while a model is built from its config (no fp32 copy first)."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def fp32_names(module: Any, dtype: Any) -> tuple[str, ...]:
    """The submodule names the class keeps in float32 when loaded in `dtype`, as its from_pretrained
    does: diffusers' `_keep_in_fp32_modules` for any lower dtype (Wan's rope, time embedder, norms,
    modulation table); transformers' for float16 only, its `_strict` list for bf16 too (T5's `wo`)."""
    import torch

    if dtype == torch.float32:
        return ()
    keep = set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    if not _is_transformers(type(module)) or dtype == torch.float16:
        keep |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
    return tuple(keep)


def cast_like_from_pretrained(module: Any, dtype: Any) -> Any:
    """Every floating parameter and buffer in `dtype`, except those `fp32_names` keeps in float32."""
    import torch

    keep = fp32_names(module, dtype)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point():
            target = torch.float32 if any(part in keep for part in name.split(".")) else dtype
            if tensor.dtype != target:
                tensor.data = tensor.data.to(target)
    return module


def _component_dtype(spec: ModelSpec, name: str, root: Path, dtype: Any) -> Any:
    """The dtype component `name` loads in: the entry's, except a float16 VAE whose config says
    `force_upcast` (SDXL's VAE overflows to NaN in fp16; its pipeline upcasts to fp32 the same way)."""
    import torch

    if name == "vae" and dtype == torch.float16 and read_config(root, name).get("force_upcast", False):
        return torch.float32
    return dtype


def load_pretrained(cls: type, folder: Path, dtype: Any, variant: str = "") -> Any:
    """One component from its checkpoint folder, local files only, in `dtype` at load time."""
    from diffusers.utils import is_accelerate_available

    if is_tokenizer(cls):
        return cls.from_pretrained(folder, local_files_only=True)
    options: dict[str, Any] = {"local_files_only": True}
    if variant:
        options["variant"] = variant
    if _is_transformers(cls):
        # transformers loads without a full fp32 copy by itself; `dtype` is its torch_dtype.
        return cls.from_pretrained(folder, dtype=dtype, **options)
    # dtype at load time (not .to(dtype) later), so the modules a model keeps in fp32 stay so.
    return cls.from_pretrained(folder, torch_dtype=dtype, low_cpu_mem_usage=is_accelerate_available(), **options)


def _from_config(cls: type, folder: Path, dtype: Any, device: str) -> Any:
    import torch

    with torch.device(device), _default_dtype(dtype):
        if _is_transformers(cls):
            config = cls.config_class.from_pretrained(folder, local_files_only=True)
            model = cls(config)
        else:
            model = cls.from_config(cls.load_config(folder, local_files_only=True))
    return cast_like_from_pretrained(model, dtype)


def build_stage(
    spec: ModelSpec, stage: str, *, device: str = "cpu", weights: str = "checkpoint", data_dir: Path | str | None = None
) -> dict[str, Any]:
    """The modules (and tokenizers) `stage` of this entry holds, on `device`, in the entry's dtype.

    Modules come back in eval mode without gradients. See the module docstring for `weights`.
    """
    import torch

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    root = checkpoint_dir(spec, data_dir)
    classes = stage_components(spec, stage, data_dir=data_dir)
    # A weightless config tree may lack the tokenizers: only a real checkpoint must have them.
    missing = [
        name
        for name, cls in classes.items()
        if not (root / name).is_dir() and (weights == "checkpoint" or not is_tokenizer(cls))
    ]
    if missing:
        from .common import CheckpointMissingError, missing_checkpoint_message

        raise CheckpointMissingError(missing_checkpoint_message(spec, root, missing))
    dtype = torch_dtype(spec, "cuda" if device.startswith("cuda") else device)
    if device.startswith("cuda") and dtype == torch.float32:
        # fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa): ~8× the fp32 rate.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    built: dict[str, Any] = {}
    for name, cls in classes.items():
        folder = root / name
        if is_tokenizer(cls):
            # Tokenizers have no tensors: skipped on meta; loaded from the folder's files otherwise.
            if weights == "checkpoint" or (weights == "random" and folder.is_dir() and not _config_only(folder)):
                built[name] = load_pretrained(cls, folder, dtype, spec.variant)
            continue
        component_dtype = _component_dtype(spec, name, root, dtype)
        if weights == "checkpoint":
            module = load_pretrained(cls, folder, component_dtype, spec.variant).to(device)
        else:
            module = _from_config(cls, folder, component_dtype, "meta" if weights == "meta" else device)
        built[name] = module.eval().requires_grad_(False)
    return built


def _config_only(folder: Path) -> bool:
    """A tokenizer folder of a weightless config tree holds nothing but (at most) a config.json."""
    return {p.name for p in folder.iterdir()} <= {"config.json"}


def component_bytes(module: Any) -> int:
    """Exact resident bytes of a module: every parameter and buffer, numel × element size (each once)."""
    if not hasattr(module, "parameters"):
        return 0  # a tokenizer
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def bytes_by_dtype(components: dict[str, Any]) -> dict[str, dict[str, int]]:
    """{component: {dtype name: bytes}}: what the model cache reports (a Wan transformer in bf16
    keeps its norms and modulation in fp32, so one component can hold two dtypes)."""
    out: dict[str, dict[str, int]] = {}
    for name, module in components.items():
        if not hasattr(module, "parameters"):
            continue
        counts: dict[str, int] = {}
        for tensor in [*module.parameters(), *module.buffers()]:
            key = str(tensor.dtype).removeprefix("torch.")
            counts[key] = counts.get(key, 0) + tensor.numel() * tensor.element_size()
        out[name] = counts
    return out
