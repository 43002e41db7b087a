"""Expected duration of a generation: the seed's cost model, plus online correction.

    est_seconds = steps × cfg_passes × tokens/1000 × tflop_per_1k_tokens / effective_tflops

Tokens come from the family's latent geometry (VAE downsampling, patching, text
tokens joined into the sequence). The per-1k-token factor grows with the
sequence (attention's quadratic term), so a model gives it as calibration
points `{tokens: factor}` and we interpolate linearly between them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# H100-class dense bf16 throughput actually reached by a diffusion step (the seed's figure).
DEFAULT_EFFECTIVE_TFLOPS = 450.0


@dataclass(frozen=True)
class LatentGeometry:
    """How a family turns pixels (and frames) into transformer/UNet tokens."""

    spatial_downsample: int = 8  # VAE
    patch: int = 2  # latent patchify (UNet mid-res counted the same way by the seed)
    temporal_downsample: int = 1  # video VAE: 4 for Wan (1 + (frames-1)/4 latent frames)
    text_tokens: int = 0  # text tokens that join the sequence (MM-DiT families)
    cfg: bool = True  # classifier-free guidance doubles the forward passes

    def tokens(self, width: int, height: int, num_frames: int = 1) -> int:
        cell = self.spatial_downsample * self.patch
        spatial = math.ceil(width / cell) * math.ceil(height / cell)
        if self.temporal_downsample > 1:
            latent_frames = 1 + max(0, num_frames - 1) // self.temporal_downsample
        else:
            latent_frames = max(1, num_frames)
        return spatial * latent_frames + self.text_tokens


# Geometry per family, checked against the seed's token counts:
# SDXL 512² → 1,024; FLUX 1024² → 4,608; Wan 5 s 480p (81 frames, 832×480) → 33,272.
FAMILY_GEOMETRY: dict[str, LatentGeometry] = {
    "unet": LatentGeometry(),
    "flux": LatentGeometry(text_tokens=512, cfg=False),  # guidance-distilled: one pass
    "wan": LatentGeometry(temporal_downsample=4, text_tokens=512),
}


def geometry_for(family: str) -> LatentGeometry:
    try:
        return FAMILY_GEOMETRY[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(FAMILY_GEOMETRY)}") from None


def est_seconds(
    tokens: int,
    steps: int,
    cfg: int,
    model_tflop_per_1k_tokens: float,
    gpu_eff_tflops: float = DEFAULT_EFFECTIVE_TFLOPS,
) -> float:
    """The seed's formula: forward passes × FLOP per step / effective throughput."""
    step_tflop = tokens / 1000 * model_tflop_per_1k_tokens
    return steps * cfg * step_tflop / gpu_eff_tflops


def interpolate_factor(points: Mapping[int, float], tokens: int) -> float:
    """TFLOP per 1k tokens at `tokens`, linear through the calibration points.

    Outside the points the nearest segment is extended (attention keeps growing
    with the sequence); one point means a constant factor. Never below 1 % of
    the smallest point, so an extrapolation can't go to zero.
    """
    if not points:
        raise ValueError("a model needs at least one cost calibration point")
    xs = sorted(points)
    if len(xs) == 1:
        return float(points[xs[0]])
    if tokens <= xs[0]:
        lo, hi = xs[0], xs[1]
    elif tokens >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi_index = next(i for i, x in enumerate(xs) if x >= tokens)
        lo, hi = xs[hi_index - 1], xs[hi_index]
    slope = (points[hi] - points[lo]) / (hi - lo)
    value = points[lo] + slope * (tokens - lo)
    return max(value, 0.01 * min(points.values()))


@dataclass(frozen=True)
class JobShape:
    """What the cost model needs to know about a request."""

    family: str
    width: int
    height: int
    num_frames: int
    steps: int
    guidance_scale: float
    num_outputs: int = 1

    def cfg_passes(self) -> int:
        geometry = geometry_for(self.family)
        return 2 if geometry.cfg and self.guidance_scale > 1.0 else 1

    def tokens(self) -> int:
        return geometry_for(self.family).tokens(self.width, self.height, self.num_frames)

    def bucket(self) -> str:
        """Shape bucket for online correction: same family, tokens within a factor of 2."""
        return f"{self.family}:{int(math.log2(max(1, self.tokens())))}"


def estimate_job_seconds(
    shape: JobShape,
    cost_points: Mapping[int, float],
    effective_tflops: float = DEFAULT_EFFECTIVE_TFLOPS,
    correction: float = 1.0,
) -> float:
    """Expected seconds of denoising for a whole job on one card.

    Outputs of one job are denoised as one batch; a compute-bound step is
    linearly slower with the batch, so outputs multiply the cost.
    """
    tokens = shape.tokens()
    factor = interpolate_factor(cost_points, tokens)
    base = est_seconds(tokens, shape.steps, shape.cfg_passes(), factor, effective_tflops)
    return base * shape.num_outputs * correction


def merged_step_seconds(
    shape: JobShape, rows: int, cost_points: Mapping[int, float], effective_tflops: float = DEFAULT_EFFECTIVE_TFLOPS
) -> float:
    """Seconds of one denoising step over `rows` same-shape outputs merged into one batch.

    A model's factor at a small sequence holds the card's under-use (kernels too
    small to fill it); a merged batch presents rows × tokens of work at once, so
    it runs at the factor of that larger sequence, while attention stays within
    each image: the factor is never above the single image's. A large model,
    whose factor only grows with the sequence, gains nothing (the seed: one
    step is compute-bound and a batch saves nothing); a small one fills the card.
    """
    tokens = shape.tokens()
    factor = min(interpolate_factor(cost_points, tokens), interpolate_factor(cost_points, tokens * rows))
    return rows * est_seconds(tokens, 1, shape.cfg_passes(), factor, effective_tflops)


def merge_speedup(shape: JobShape, rows: int, cost_points: Mapping[int, float]) -> float:
    """Throughput of a merged batch of `rows` against running the rows one by one (≥ 1)."""
    return rows * merged_step_seconds(shape, 1, cost_points) / merged_step_seconds(shape, rows, cost_points)


@dataclass
class StepTimeCorrection:
    """Online correction of the cost model from measured step times.

    Keeps, per (model, shape bucket), an exponentially weighted mean of
    measured / predicted step seconds. `alpha` trades reaction speed (high)
    against noise from one slow step (low). Bounded: one observation counts
    as at most `max_jump` times (at least 1/`max_jump`) the factor it updates,
    so a single outlier chunk (a cold load, a stalled card) moves the factor by
    at most alpha × (max_jump − 1); and every factor stays within `limits`.
    """

    alpha: float = 0.2
    ratios: dict[str, float] = field(default_factory=dict)
    max_jump: float = 4.0
    limits: tuple[float, float] = (1e-3, 1e4)  # CPU-run tiny models are far slower than the card model

    @staticmethod
    def key(model: str, bucket: str) -> str:
        return f"{model}|{bucket}"

    @staticmethod
    def split(key: str) -> tuple[str, str]:
        """(model, bucket) of a `key`."""
        model, _, bucket = key.partition("|")
        return model, bucket

    def factor(self, model: str, bucket: str) -> float:
        return self.ratios.get(self.key(model, bucket), 1.0)

    def observe(self, model: str, bucket: str, predicted_step: float, measured_step: float) -> float:
        """Fold one measured step time into the factor of (model, bucket); returns the new factor."""
        if predicted_step <= 0 or measured_step <= 0:
            return self.factor(model, bucket)
        ratio = measured_step / predicted_step
        k = self.key(model, bucket)
        old = self.ratios.get(k)
        if old is not None:
            ratio = min(max(ratio, old / self.max_jump), old * self.max_jump)
        new = ratio if old is None else (1 - self.alpha) * old + self.alpha * ratio
        self.ratios[k] = min(max(new, self.limits[0]), self.limits[1])
        return self.ratios[k]
