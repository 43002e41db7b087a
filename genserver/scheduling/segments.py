"""Long videos as a sequence of segments: the plan, the seeds and the step numbering.

A video longer than its model's `segment_frames` is generated as S segments,
each an independent clip of the same prompt, denoised on the card one after
the other and decoded (on the decode worker) while the card denoises the
next one. The whole video is the segments' frames end to end.

* Frames: every segment keeps `segment_frames` frames but the last, which
  keeps the rest. A model may only generate `1 + k × frames_step` frames (Wan:
  4k+1), so the last segment generates the smallest such count ≥ what it keeps
  and drops the extra frames at decode.
* Seeds: segment 0 uses the job's seed (a one-segment job is exactly an
  unsegmented one); segment i > 0 uses a seed derived from (seed, i) by
  SHA-256, so the same job always gets the same segments.
* Steps: the job's step counter runs over all segments. Segment i's local step
  s is global step i × steps + s; `steps_done`, `checkpoint_step` and the
  chunk messages use global steps, so a checkpoint names its segment
  unambiguously, and global step i × steps (i ≥ 1) means "segment i starts
  from its seed" (segment i-1's final checkpoint, kept for its decode, is not
  restored).

Cross-segment temporal consistency (conditioning a segment on the previous
one's last frames) is out of scope: segments are independent clips.

Plain Python, no Django.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

from .cost import JobShape, estimate_job_seconds

SEED_MASK = 2**63 - 1


@dataclass(frozen=True)
class Segment:
    index: int
    frames: int  # frames this segment contributes to the video
    generate_frames: int  # frames denoised (≥ frames; 1 + k × frames_step)
    seed: int


def is_segmented(num_frames: int, segment_frames: int) -> bool:
    return segment_frames > 0 and num_frames > segment_frames


def segment_count(num_frames: int, segment_frames: int) -> int:
    if not is_segmented(num_frames, segment_frames):
        return 1
    return math.ceil(num_frames / segment_frames)


def segment_seed(seed: int, index: int) -> int:
    """Segment 0 keeps the job's seed; the others get SHA-256(seed, index) (63 bits)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"genserver-segment:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & SEED_MASK


def generated_frames(frames: int, frames_step: int) -> int:
    """The smallest 1 + k × frames_step that is ≥ frames."""
    step = max(1, frames_step)
    return 1 + math.ceil(max(0, frames - 1) / step) * step


def segment_plan(num_frames: int, segment_frames: int, frames_step: int = 1, seed: int = 0) -> list[Segment]:
    """The segments of a video of `num_frames` (one segment when it fits in `segment_frames`)."""
    if num_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {num_frames}")
    if not is_segmented(num_frames, segment_frames):
        return [Segment(0, num_frames, num_frames, seed)]
    if (segment_frames - 1) % max(1, frames_step):
        raise ValueError(f"segment_frames {segment_frames} is not 1 + a multiple of {frames_step}")
    count = segment_count(num_frames, segment_frames)
    plan = []
    for index in range(count):
        frames = min(segment_frames, num_frames - index * segment_frames)
        plan.append(Segment(index, frames, generated_frames(frames, frames_step), segment_seed(seed, index)))
    return plan


def segment_of_step(global_step: int, steps: int) -> tuple[int, int]:
    """(segment index, local step) of a global step; a segment's end is the next one's start."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    return divmod(global_step, steps)


def estimate_segmented_seconds(
    shape: JobShape,
    plan: list[Segment],
    cost_points: Mapping[int, float],
    effective_tflops: float,
    correction: float = 1.0,
) -> float:
    """Expected denoising seconds of every segment together (each costed at the frames it generates)."""
    total = 0.0
    for segment in plan:
        seg_shape = JobShape(
            shape.family,
            shape.width,
            shape.height,
            segment.generate_frames,
            shape.steps,
            shape.guidance_scale,
            shape.num_outputs,
        )
        total += estimate_job_seconds(seg_shape, cost_points, effective_tflops, correction)
    return total


def segment_shape(shape: JobShape, segment_frames: int) -> JobShape:
    """The shape one (full) segment is denoised at: what step times are measured and corrected by."""
    if not is_segmented(shape.num_frames, segment_frames):
        return shape
    return JobShape(
        shape.family, shape.width, shape.height, segment_frames, shape.steps, shape.guidance_scale, shape.num_outputs
    )
