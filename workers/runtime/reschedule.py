"""Changing a job's step count midway: continue a state on a schedule made for another total.

After k steps of a schedule for T steps a state holds x_k (the latents at the
noise level σ_old[k] of the next step) and x̂0, the last step's clean-sample
estimate. Every scheduler here writes a latent as

    x = α(σ)·x0 + s(σ)·ε        VE (Euler, Euler a):            α = 1,           s = σ
                                 VP (DPM-Solver++, UniPC):        α = 1/√(σ²+1),   s = σ·α
                                 flow (flow-matching schedules):  α = 1 − σ,       s = σ

so the noise estimate is ε̂ = (x_k − α_old·x̂0) / s_old, and the same state re-expressed
at the new schedule's (N steps) noise level for step k is

    x'_k = α_new·x̂0 + s_new·ε̂          (deterministic: the DDIM-style jump)

The step counter stays k (k steps are done, N − k remain). Extending (N > T) puts
noise back (σ_new[k] > σ_old[k]) and refines from there, like image-to-image;
shortening (k < N < T) jumps forward. A multistep solver's history was made on the
old schedule, so the new scheduler starts without one (a first-order restart).
Rescheduling to the same total is the identity up to float rounding.

A state whose schedule had ended (σ_old[k] = 0, x_k = x̂0) has no noise left to
estimate; ε̂ is then drawn from the job's own generator, so it stays deterministic.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

VE_SCHEDULERS = ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler")
VP_SCHEDULERS = ("DPMSolverMultistepScheduler", "UniPCMultistepScheduler")


def convention(scheduler: Any) -> str:
    """ "ve", "vp" or "flow": how the scheduler's latents mix signal and noise at its `sigmas`."""
    name = type(scheduler).__name__
    if name.startswith("FlowMatch") or getattr(scheduler.config, "use_flow_sigmas", False):
        return "flow"
    if name in VE_SCHEDULERS:
        return "ve"
    if name in VP_SCHEDULERS:
        return "vp"
    raise ValueError(f"cannot change the step count midway with {name}")


def alpha_sigma(kind: str, sigma: float) -> tuple[float, float]:
    """(signal scale α, noise scale s) of a latent at the schedule's noise level `sigma`."""
    if kind == "ve":
        return 1.0, sigma
    if kind == "flow":
        return 1.0 - sigma, sigma
    alpha = 1.0 / (sigma * sigma + 1.0) ** 0.5
    return alpha, sigma * alpha


def sigma_at(scheduler: Any, index: int) -> float:
    sigmas = scheduler.sigmas
    return float(sigmas[min(index, len(sigmas) - 1)])


def reexpress(
    latents: torch.Tensor,
    denoised: torch.Tensor | None,
    old: Any,
    new: Any,
    step: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """x_k on the `old` schedule → the same x̂0 and ε̂ at the `new` schedule's level for step `step`."""
    kind = convention(old)
    if convention(new) != kind:
        raise ValueError(f"cannot move a state from {type(old).__name__} to {type(new).__name__}")
    if denoised is None:
        # A checkpoint from before the x0 estimate was saved: nothing to re-express from.
        log.warning("no x0 estimate in the state at step %s: continuing the latents as they are", step)
        return latents
    x0 = denoised.to(latents.device, latents.dtype)
    a_old, s_old = alpha_sigma(kind, sigma_at(old, step))
    a_new, s_new = alpha_sigma(kind, sigma_at(new, step))
    if s_old > 1e-8:
        noise = (latents - a_old * x0) / s_old
    else:  # the old schedule had ended: fresh noise from the job's generator (deterministic)
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents.device, latents.dtype)
    return a_new * x0 + s_new * noise


def continue_state(state: Any, new_steps: int, new_scheduler: Any) -> Any:
    """A DenoiseState for `new_steps` in all, at the same step, on `new_scheduler` (fresh from set_timesteps,
    positioned at state.step: no multistep history)."""
    import dataclasses

    from .base import DenoiseState

    if not state.step < new_steps:
        raise ValueError(f"cannot continue {state.step} steps done on a schedule of {new_steps}")
    denoised = state.extra.get("denoised")
    latents = reexpress(state.latents, denoised, state.scheduler, new_scheduler, state.step, state.generator)
    return DenoiseState(
        request=dataclasses.replace(state.request, steps=new_steps),
        step=state.step,
        latents=latents,
        embeddings=state.embeddings,
        scheduler=new_scheduler,
        generator=state.generator,
        extra=dict(state.extra),
    )
