"""Job rows written directly, as the submit service would record them, with no message published."""

from __future__ import annotations

from typing import Any

IMAGE_REQUEST: dict[str, Any] = {
    "model": "sdxl-sim",
    "prompt": "p",
    "width": 512,
    "height": 512,
    "num_frames": 1,
    "steps": 20,
    "guidance_scale": 5.0,
    "num_outputs": 1,
    "seed": 1,
}


def make_job(owner: Any, request: dict[str, Any] | None = None, **fields: Any) -> Any:
    """A Job row for `request` (merged over an sdxl-sim 512², 20-step image), estimated and classed as
    submit does (segments included); `fields` set any column directly (status, stage, lease, times...).
    No worker takes it: nothing is published."""
    from genserver import deployment
    from genserver.jobs import services
    from genserver.jobs.models import Job

    data = IMAGE_REQUEST | (request or {})
    spec = deployment.registry().get(data["model"])
    est = services.estimate(data)
    values = dict(
        owner=owner,
        model=spec.name,
        family=spec.family,
        kind=spec.kind,
        backend=spec.backend,
        prompt=data["prompt"],
        width=data["width"],
        height=data["height"],
        num_frames=data["num_frames"],
        steps=data["steps"],
        guidance_scale=data["guidance_scale"],
        seed=data["seed"],
        num_outputs=data["num_outputs"],
        estimated_seconds=est.seconds,
        clock_scale=est.clock_scale,
        duration_class=est.duration_class,
        queue=est.duration_class,
        priority=est.priority,
        chunk_steps=est.chunk_steps,
        segment_frames=est.segment_frames,
        segment_count=est.segment_count,
    )
    return Job.objects.create(**(values | fields))
