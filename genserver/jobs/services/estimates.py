"""Estimates: a request's cost, class, priority and chunking, and the online step-time correction."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from django.conf import settings

from genserver import deployment
from genserver.jobs.models import Job
from genserver.redis_client import CORRECTION_KEY, STAGE_SECONDS_KEY, client as redis_client
from genserver.scheduling.chunking import steps_per_chunk
from genserver.scheduling.classes import priority_for
from genserver.scheduling.cost import JobShape, StepTimeCorrection, estimate_job_seconds
from genserver.scheduling.segments import estimate_segmented_seconds, segment_plan, segment_shape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Estimate:
    """What the scheduler decides for a request before it is recorded."""

    seconds: float
    duration_class: str
    priority: int
    chunk_steps: int
    clock_scale: float
    segment_frames: int = 0  # a long video runs as segments of this many frames (0: one piece)
    segment_count: int = 1


def _learned_correction(model: str, bucket: str) -> float:
    """The measured / modelled step-time ratio learned for this model and shape bucket (1.0: none yet)."""
    try:
        raw = redis_client().hget(CORRECTION_KEY, StepTimeCorrection.key(model, bucket))
    except Exception:  # noqa: BLE001 - a missing correction must never block a submit
        return 1.0
    return float(raw) if raw else 1.0


def estimate(data: dict[str, Any]) -> Estimate:
    """Cost, class, priority and chunking of a validated request."""
    spec = deployment.registry().get(data["model"])
    shape = JobShape(
        family=spec.family,
        width=data["width"],
        height=data["height"],
        num_frames=data["num_frames"],
        steps=data["steps"],
        guidance_scale=data["guidance_scale"],
        num_outputs=data["num_outputs"],
    )
    # A long video costs all its segments (each at the frames it generates).
    plan = segment_plan(data["num_frames"], spec.segment_frames, spec.limits.frames_step)
    # Simulated models *are* the cost model; only real ones learn from measured steps.
    correction = (
        1.0
        if spec.backend == "simulated"
        else _learned_correction(spec.name, segment_shape(shape, spec.segment_frames).bucket())
    )
    seconds = estimate_segmented_seconds(shape, plan, spec.cost_points, settings.EFFECTIVE_TFLOPS, correction)
    duration_class = deployment.thresholds().classify(seconds)
    total_steps = data["steps"] * len(plan)
    chunk_steps = min(data["steps"], steps_per_chunk(settings.CHUNK_SECONDS, seconds / total_steps))
    return Estimate(
        seconds=seconds,
        duration_class=duration_class,
        priority=priority_for(duration_class, seconds, False, deployment.thresholds()),
        chunk_steps=chunk_steps,
        clock_scale=deployment.clock_scale(spec.backend),
        segment_frames=spec.segment_frames if len(plan) > 1 else 0,
        segment_count=len(plan),
    )


def chunked_for_queue(est: Estimate, queue: str, steps: int) -> Estimate:
    """Chunks of CHUNK_SECONDS of wall time where the job runs: a card group of k runs a step
    group_speedup(k) times faster, so its chunks hold that many more steps."""
    speedup = deployment.layout().job_speedup(queue)
    if speedup == 1.0:
        return est
    chunk_steps = min(steps, steps_per_chunk(settings.CHUNK_SECONDS, est.seconds / steps / speedup))
    return replace(est, chunk_steps=chunk_steps)


def rescale_to_total(job: Job, steps: int) -> None:
    """Give `job` (locked, saved by the caller) the total `steps`: the cost scales with it, the chunk
    length and the next message's priority follow; class and queue stay as at submit."""
    if job.steps_requested is None:
        job.steps_requested = job.steps
    per_step = job.estimated_seconds / job.steps if job.steps else 0.0
    job.estimated_seconds = per_step * steps
    job.steps = steps
    job.chunk_steps = max(1, min(steps, steps_per_chunk(settings.CHUNK_SECONDS, per_step))) if per_step else steps
    job.priority = priority_for(
        job.duration_class, job.remaining_seconds, job.checkpoint_step > 0, deployment.thresholds()
    )


def learn_step_time(job: Job, measured_step_seconds: float) -> None:
    """Fold a chunk's measured single-card step time into the model's correction for its shape bucket."""
    if job.backend == "simulated":
        return
    shape = segment_shape(
        JobShape(job.family, job.width, job.height, job.num_frames, job.steps, job.guidance_scale, job.num_outputs),
        job.segment_frames,
    )
    key = StepTimeCorrection.key(job.model, shape.bucket())
    try:
        r = redis_client()
        stored = r.hget(CORRECTION_KEY, key)  # none yet: the first measurement sets the factor
        correction = StepTimeCorrection(ratios={key: float(stored)} if stored else {})
        uncorrected_step = (
            estimate_job_seconds(shape, deployment.registry().get(job.model).cost_points, settings.EFFECTIVE_TFLOPS)
            / job.steps
        )
        r.hset(
            CORRECTION_KEY, key, correction.observe(job.model, shape.bucket(), uncorrected_step, measured_step_seconds)
        )
    except Exception:
        log.warning("could not record step time of job %s", job.id, exc_info=True)


# How far one job's measured stage time moves the learned one, as a share of it: the learned value steps up when a
# job took longer and down when it took less, so it settles on the median (a mean would follow the few jobs whose
# decode waited behind a video's: measured in bench.replay, the mean doubled image ETAs' overhead). Larger
# follows a change of load sooner, smaller is steadier. The first measurement sets it.
STAGE_LEARN_STEP = 0.1
_STAGE_FLOOR_SECONDS = 1e-3  # a median learned as 0 could never step up again


def learn_stage_seconds(model: str, stage: str, seconds: float) -> None:
    """Fold one job's measured wall seconds of a stage around its denoising steps (redis_client's LEAD_IN, HOP,
    BOUNDARY, TAIL) into the model's learned median."""
    field = f"{model}:{stage}"
    try:
        r = redis_client()
        stored = r.hget(STAGE_SECONDS_KEY, field)
        learned = max(0.0, seconds) if stored is None else _median_step(float(stored), seconds)
        r.hset(STAGE_SECONDS_KEY, field, round(learned, 6))
    except Exception:
        log.warning("could not record the %s seconds of a %s job", stage, model, exc_info=True)


def _median_step(learned: float, seconds: float) -> float:
    """One step of the learned median towards `seconds`: STAGE_LEARN_STEP of it up or down, never past it."""
    base = max(learned, _STAGE_FLOOR_SECONDS)
    if seconds > learned:
        return min(seconds, base * (1 + STAGE_LEARN_STEP))
    if seconds < learned:
        return max(seconds, base * (1 - STAGE_LEARN_STEP))
    return learned
