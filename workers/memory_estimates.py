"""What the memory plan counts: each stage's modules measured on the meta device, and the activation
memory a job of a given shape needs (an estimate from the shape; see `activation_bytes`).

Used by workers/memory_plan.py. The meta builds go through the runtime's
`components.build_stage` (config only, no memory) and are cached per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from genserver import config as service_config
from genserver.registry import ModelSpec

GIB = 1024**3
ACTIVATION_MARGIN = 1.25  # allocator fragmentation and the small tensors the estimate leaves out
# What the formulas below miss, measured: bench/gpu_bench.py's peak per stage above the resident weights
# (torch.cuda.max_memory_allocated) on one H200 at the bench's shapes (SDXL and FLUX 1024², Wan 832×480×81;
# docs/BENCHMARKS.md, "GPU benchmark", 2026-12-04) ÷ the formula with its margin, rounded up to 0.05.
# The formulas count one block's live tensors; the peaks also hold what sits around it: the VAE's
# upsampler inputs and, for Wan's causal decoder, the cached frames of every causal convolution; Wan's
# float32 residual arithmetic and FLUX's joint text + image stream; the encoders' outputs kept while the
# next encoder runs. Unlisted (family, stage) pairs: 1.0.
MEASURED_OVER_FORMULA: dict[tuple[str, str], float] = {
    ("unet", "encode"): 4.2,  # 19.5 MiB against 4.7
    ("unet", "denoise"): 1.1,  # 327.6 MiB against 306.2
    ("unet", "decode"): 1.3,  # 2.38 GiB against 1.88
    ("flux", "encode"): 2.65,  # 92.0 MiB against 35.0
    ("flux", "denoise"): 1.45,  # 478.1 MiB against 337.5
    ("flux", "decode"): 1.3,  # 2.38 GiB against 1.88
    ("wan", "encode"): 3.0,  # 208.5 MiB against 70.0
    ("wan", "denoise"): 1.25,  # 14B: 7.03 GiB against 5.78 (1.3B: 3.09 GiB against 3.20)
    ("wan", "decode"): 2.05,  # 4.39 GiB against 2.14
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Component:
    """One module a stage worker keeps on its card."""

    model: str
    stage: str
    name: str  # the diffusers folder: unet, transformer, text_encoder_2, vae, ...
    dtype: str
    params: int
    bytes: int


# Components, from the meta-device build ------------------------------------------------

_BUILT: dict[tuple[str, str, str, str], dict[str, Any]] = {}


def _modules(spec: ModelSpec, stage: str) -> dict[str, Any]:
    """`stage`'s torch modules of `spec`, built on the meta device (config only; cached per process)."""
    key = (spec.name, spec.path, spec.dtype, stage)
    if key not in _BUILT:
        import torch

        from workers.runtime.components import build_stage

        # device "cuda": the dtype a card runs (the entry's, else bfloat16); weights "meta": no memory.
        built = build_stage(spec, stage, device="cuda", weights="meta")
        _BUILT[key] = {name: m for name, m in built.items() if isinstance(m, torch.nn.Module)}
    return _BUILT[key]


def stage_components(spec: ModelSpec, stage: str) -> list[Component]:
    """The modules `stage` of `spec` holds, with their parameters and bytes (meta-device build)."""
    from workers.runtime.components import component_bytes

    return [
        Component(
            spec.name,
            stage,
            name,
            _dtype_name(module),
            sum(p.numel() for p in module.parameters()),
            component_bytes(module),
        )
        for name, module in _modules(spec, stage).items()
    ]


def _dtype_name(module: Any) -> str:
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})
    return "+".join(dtypes) or "-"


def _config(spec: ModelSpec, stage: str, name: str) -> dict[str, Any]:
    config = getattr(_modules(spec, stage).get(name), "config", None)
    if config is None:
        return {}
    return dict(config.to_dict() if hasattr(config, "to_dict") else config)


# Activation headroom, from the job's shape ------------------------------------------------


@dataclass(frozen=True)
class Shape:
    width: int
    height: int
    frames: int = 1
    outputs: int = 1

    def __str__(self) -> str:
        frames = f"×{self.frames} frames" if self.frames > 1 else ""
        return f"{self.width}×{self.height}{frames}, {self.outputs} output{'s' if self.outputs > 1 else ''}"


def largest_shape(spec: ModelSpec) -> Shape:
    """The largest job the registry lets through: its size limits, one segment of video, its max batch."""
    frames = 1
    if spec.kind == "video":
        frames = spec.segment_frames or spec.limits.max_frames
    return Shape(spec.limits.max_width, spec.limits.max_height, frames, max(1, spec.max_batch))


def default_shape(spec: ModelSpec) -> Shape:
    return Shape(spec.defaults.width, spec.defaults.height, spec.defaults.num_frames, 1)


def _elem(spec: ModelSpec) -> int:
    return DTYPE_BYTES[spec.resolved_dtype("cuda")]


def _block_live(width: int, ffn: int) -> int:
    """Elements live per token at a transformer block's peak: the residual, its norm, then either
    q, k, v and the attention output (6·width) or the FFN's hidden layer and its activation
    (2·width + 2·ffn), whichever is more. Attention itself is SDPA/flash: no tokens² matrix."""
    return max(6 * width, 2 * width + 2 * ffn)


def activation_bytes(spec: ModelSpec, stage: str, shape: Shape) -> int:
    """Estimated activation memory of one job of `shape` in `stage` (bytes, × ACTIVATION_MARGIN).

    encode   per text encoder (they run one after the other): sequence × rows × block peak
    denoise  transformer: tokens × rows × block peak; UNet: the skip connections it keeps for
             the up path + the largest level's block peak
    decode   the VAE's full-resolution feature maps: 3 live maps of its second-widest
             full-resolution channel count (the upsampler's output), per tile when tiled
             (GENSERVER_VAE_TILE_ABOVE_PIXELS), for the frames decoded at once (Wan: 4)
    rows: outputs × 2 with classifier-free guidance (both passes in one call), × 1 for FLUX.
    Then × MEASURED_OVER_FORMULA: what a card measured beyond the formula.
    """
    return int(_formula_bytes(spec, stage, shape) * MEASURED_OVER_FORMULA.get((spec.family, stage), 1.0))


def _formula_bytes(spec: ModelSpec, stage: str, shape: Shape) -> int:
    cfg_rows = 1 if spec.family == "flux" else 2
    rows = shape.outputs * (cfg_rows if stage != "decode" else 1)
    elem = _elem(spec)
    if stage == "encode":
        peak = 0
        for component in stage_components(spec, "encode"):
            config = _config(spec, "encode", component.name)
            width = config.get("d_model") or config.get("hidden_size", 0)
            ffn = config.get("d_ff") or config.get("intermediate_size", 0)
            sequence = 512 if "d_model" in config else config.get("max_position_embeddings", 77)
            peak = max(peak, sequence * rows * _block_live(width, ffn) * elem)
        return int(peak * ACTIVATION_MARGIN)
    if stage == "denoise":
        return int(_denoise_elements(spec, shape) * rows * elem * ACTIVATION_MARGIN)
    return int(_decode_elements(spec, shape) * shape.outputs * _decode_elem(spec) * ACTIVATION_MARGIN)


def _denoise_elements(spec: ModelSpec, shape: Shape) -> int:
    """Live elements per batch row at the denoiser's peak."""
    latent_h, latent_w = shape.height // 8, shape.width // 8
    if spec.family == "unet":
        config = _config(spec, "denoise", "unet")
        channels = list(config.get("block_out_channels", (320, 640, 1280)))
        kinds = list(config.get("down_block_types", ()))
        skips, peak = 0, 0
        for level, width in enumerate(channels):
            tokens = (latent_h >> level) * (latent_w >> level)
            skips += (config.get("layers_per_block", 2) + 1) * tokens * width
            attends = level < len(kinds) and "CrossAttn" in kinds[level]
            # GEGLU: the FFN's projection is 2 × 4·width wide, its gated output 4·width.
            peak = max(peak, tokens * (_block_live(width, 6 * width) if attends else 4 * width))
        return skips + peak
    config = _config(spec, "denoise", "transformer")
    width = config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)
    tokens = (latent_h // 2) * (latent_w // 2)
    if spec.family == "wan":
        tokens *= 1 + (shape.frames - 1) // 4
        ffn = config.get("ffn_dim", 4 * width)
    else:  # flux: the text tokens join the sequence
        tokens += 512
        ffn = 4 * width
    return tokens * _block_live(width, ffn)


def _decode_elem(spec: ModelSpec) -> int:
    config = _config(spec, "decode", "vae")
    # The pipelines upcast a `force_upcast` VAE only from float16 (its known NaN); bf16 decodes as is.
    return 4 if config.get("force_upcast") and spec.resolved_dtype("cuda") == "float16" else _elem(spec)


def _decode_elements(spec: ModelSpec, shape: Shape) -> int:
    config = _config(spec, "decode", "vae")
    tile_above = service_config.vae_tile_above_pixels()
    width, height = shape.width, shape.height
    if spec.family == "wan":
        channels = config.get("base_dim", 96) * list(config.get("dim_mult", (1, 2, 4, 4)))[1]
        frames = 4  # the causal decoder turns one latent frame into four at a time
    else:
        channels = sorted(config.get("block_out_channels", (128, 256, 512, 512)))[1]
        frames = 1
    if width * height > tile_above:
        # diffusers' tile: AutoencoderKL's sample_size, AutoencoderKLWan's 256 pixels
        sample = config.get("sample_size", 512) if spec.family != "wan" else 256
        tile = int(sample[0] if isinstance(sample, (list, tuple)) else sample or 512)
        width, height = min(width, tile), min(height, tile)
    return 3 * channels * frames * width * height
