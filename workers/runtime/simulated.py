"""The simulated backend: steps take the cost model's time (× GENSERVER_TIME_SCALE), no GPU.

Everything else is real: latents are tensors, checkpoints are files written
through storage, previews and outputs are PNGs. It exists for capacity
planning and load tests of the real Django/Celery/Redis stack.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from genserver.registry import ModelSpec
from genserver.scheduling.cost import JobShape, estimate_job_seconds, merged_step_seconds

from .base import DenoiseState, Family, GenerationRequest

LATENT_SIDE = 8  # simulated latents stay tiny whatever the resolution
MAX_OUTPUT_SIDE = 1024  # the default cap on an output's longest side (GENSERVER_SIM_OUTPUT_SIDE)
PULL = 0.85  # each step keeps this much of the latents and moves the rest towards the prompt's target


class SimulatedFault(RuntimeError):
    """Raised by a registry entry with `fault_at_step`, to drill poison-job handling."""


class SimulatedFamily(Family):
    def __init__(
        self,
        spec: ModelSpec,
        device: str,
        data_dir: Path,
        *,
        time_scale: float = 1.0,
        effective_tflops: float = 450.0,
        output_side: int = MAX_OUTPUT_SIDE,
    ) -> None:
        """`output_side` caps an output's longest side (the requested aspect kept): a simulated output's pixels
        carry nothing, and its PNG or MP4 encode is the decode worker's real CPU work (a 1024² PNG 0.5 CPU-s,
        an 81-frame 832×480 clip 2.2 CPU-s, on a 2-core test machine)."""
        super().__init__(spec, device, data_dir)
        self.time_scale = time_scale
        self.effective_tflops = effective_tflops
        self.output_side = output_side

    def step_seconds(self, request: GenerationRequest) -> float:
        shape = JobShape(
            self.spec.family,
            request.width,
            request.height,
            request.num_frames,
            request.steps,
            request.guidance_scale,
            request.num_outputs,
        )
        return estimate_job_seconds(shape, self.spec.cost_points, self.effective_tflops) / request.steps

    def encode(self, prompts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for prompt, negative in prompts:
            digest = hashlib.sha256(f"{prompt}\0{negative}".encode()).digest()
            out.append({"prompt_embeds": torch.tensor(list(digest[:16]), dtype=torch.float32) / 255.0})
        return out

    def prepare(self, request: GenerationRequest, embeddings: dict[str, Any]) -> DenoiseState:
        generator = torch.Generator("cpu").manual_seed(request.seed)
        latents = torch.randn(request.num_outputs, 4, LATENT_SIDE, LATENT_SIDE, generator=generator)
        return DenoiseState(request=request, step=0, latents=latents, embeddings=embeddings, generator=generator)

    def merged_step_seconds(self, states: list[DenoiseState]) -> float:
        """One step over every state's rows as one batch (cost.merged_step_seconds)."""
        r = states[0].request
        shape = JobShape(self.spec.family, r.width, r.height, r.num_frames, r.steps, r.guidance_scale, 1)
        return merged_step_seconds(shape, sum(self.rows(states)), self.spec.cost_points, self.effective_tflops)

    def step(self, state: DenoiseState) -> None:
        self.step_many([state])

    def step_many(self, states: list[DenoiseState]) -> None:
        """Move each state on by itself, in the merged batch's modelled step time: the arithmetic stands in for
        the card's work, so it is part of that time, not added to it (0.14 ms a step on a 2-core test machine,
        which the replay counted as the service's overhead)."""
        began = time.perf_counter()
        self.check_mergeable(states)
        for state in states:
            if self.spec.fault_at_step and state.step + 1 == self.spec.fault_at_step:
                raise SimulatedFault(f"simulated out-of-memory at step {state.step + 1} of {self.spec.name}")
        seconds = self.step_seconds(states[0].request) if len(states) == 1 else self.merged_step_seconds(states)
        for state in states:
            # A deterministic pull towards a prompt-dependent target: outputs depend on prompt and seed.
            target = self._target(state)
            state.latents = state.latents * PULL + target * (1 - PULL)
            state.step += 1
            # The x0 estimate: where the remaining pulls take the latents (exact for this linear model).
            remaining = max(0, state.request.steps - state.step)
            state.extra["denoised"] = target + (state.latents - target) * PULL**remaining
        time.sleep(max(0.0, began + seconds * self.time_scale - time.perf_counter()))

    @staticmethod
    def _target(state: DenoiseState) -> torch.Tensor:
        return state.embeddings["prompt_embeds"][:4].view(1, 4, 1, 1)

    def checkpoint(self, state: DenoiseState) -> dict[str, Any]:
        # `steps` (the total the state was made for) tells load_state when the job's total changed.
        return {
            "step": state.step,
            "steps": state.request.steps,
            "latents": state.latents.clone(),
        } | self.denoised_field(state)

    def restore(self, request: GenerationRequest, embeddings: dict[str, Any], data: dict[str, Any]) -> DenoiseState:
        state = DenoiseState(request=request, step=int(data["step"]), latents=data["latents"], embeddings=embeddings)
        if data.get("denoised") is not None:
            state.extra["denoised"] = data["denoised"]
        return state

    def reschedule(self, state: DenoiseState, new_steps: int) -> DenoiseState:
        """No schedule to rebuild: the same latents, a new total (the x0 estimate follows it)."""
        import dataclasses

        if not state.step < new_steps:
            raise ValueError(f"cannot continue {state.step} steps done on a schedule of {new_steps}")
        request = dataclasses.replace(state.request, steps=new_steps)
        target = self._target(state)
        denoised = target + (state.latents - target) * PULL ** (new_steps - state.step)
        return DenoiseState(
            request=request,
            step=state.step,
            latents=state.latents,
            embeddings=state.embeddings,
            extra={"denoised": denoised},
        )

    def _render(self, latents: torch.Tensor, width: int, height: int) -> Image.Image:
        rgb = latents[:3].unsqueeze(0)
        rgb = torch.nn.functional.interpolate(rgb, size=(height, width), mode="bilinear", align_corners=False)[0]
        rgb = ((rgb - rgb.min()) / (rgb.max() - rgb.min() + 1e-6) * 255).clamp(0, 255).to(torch.uint8)
        return Image.fromarray(rgb.permute(1, 2, 0).numpy(), "RGB")

    def preview(self, state: DenoiseState) -> Image.Image:
        return self._render(state.latents[0], 64, 64)

    def decode(self, state: DenoiseState) -> list[Image.Image]:
        r = state.request
        scale = min(1.0, self.output_side / max(r.width, r.height))
        size = (max(1, int(r.width * scale)), max(1, int(r.height * scale)))
        return [self._render(latents, *size) for latents in self.final_latents(state)]
