"""The family adapter interface every model backend implements.

The flow mirrors a diffusers pipeline, cut at step boundaries so a job can
stop after any step and continue in another process:

    1. encode    prompts → embeddings (cached by the encode stage)
    2. prepare   initial latents from the seed, scheduler set for `steps`
    3. step      one denoising step (the scheduler's `step` contract); `step_many`
                 steps several same-shape jobs with one batched model call
    4. checkpoint / restore   everything needed to continue exactly
       (reschedule: continue a restored state on a schedule for another total)
    5. preview   a cheap latent → RGB picture
    6. decode    VAE decode → per output a PIL image (video: a list of PIL frames)

A family instance holds the weights of the stages it was built for (`stages`:
encode → text encoders, denoise → the denoiser, decode → the VAE; see
components.py); steps 2-5 need the denoise stage, and a decode worker also runs
`restore` (configs only, no denoiser weights).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genserver import config
from genserver.registry import ModelSpec
from genserver.storage import keys

STAGES = ("encode", "denoise", "decode")  # = components.STAGES (kept here: base.py imports no torch)


@dataclass(frozen=True)
class GenerationRequest:
    """Everything about a job that the runtime needs, detached from the ORM."""

    job_id: str
    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_frames: int
    steps: int
    guidance_scale: float
    seed: int
    num_outputs: int = 1


@dataclass
class DenoiseState:
    """A job between two steps. `step` is the number of steps done."""

    request: GenerationRequest
    step: int
    latents: Any  # torch.Tensor
    embeddings: dict[str, Any]
    scheduler: Any = None  # a diffusers scheduler, positioned at `step`
    generator: Any = None  # torch.Generator whose state is part of the checkpoint
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.step >= self.request.steps


class Family(ABC):
    """One loaded model. Instances are cached per worker process (see cache.py)."""

    def __init__(self, spec: ModelSpec, device: str, data_dir: Path, stages: tuple[str, ...] = STAGES) -> None:
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise ValueError(f"unknown stages {unknown}; stages are {STAGES}")
        self.spec = spec
        self.device = device
        self.data_dir = data_dir
        self.stages = tuple(stages)
        self.components: dict[str, Any] = {}  # what build_stage loaded, by component folder

    def load_components(self, weights: str = "checkpoint") -> dict[str, Any]:
        """Build this instance's stages (components.build_stage: weights "checkpoint", "random" or
        "meta"), each on its device: the text encoders on the CPU where the entry says
        `encode_device = "cpu"`; then the speed options (speed.py)."""
        from .components import build_stage
        from .speed import apply_speed_options

        for stage in self.stages:
            device = "cpu" if stage == "encode" and self.spec.encode_device == "cpu" else self.device
            self.components |= build_stage(self.spec, stage, device=device, weights=weights, data_dir=self.data_dir)
        apply_speed_options(self)
        return self.components

    @property
    def encode_device(self) -> str:
        return "cpu" if self.spec.encode_device == "cpu" else self.device

    def component(self, name: str) -> Any:
        """A loaded component, or an error naming the stage that would have loaded it."""
        try:
            return self.components[name]
        except KeyError:
            raise RuntimeError(
                f"model {self.spec.name!r}: {name} is not loaded in this worker, which holds "
                f"the {'/'.join(self.stages)} stage(s) (components.py)"
            ) from None

    @property
    def denoiser(self) -> Any:
        """The UNet or transformer (None where this instance holds no denoise stage)."""
        return self.components.get("unet", self.components.get("transformer"))

    @property
    def encoder_identity(self) -> str:
        """Names the text encoder, so cached embeddings are shared only where valid (the API computes the
        same name from the registry entry: genserver.storage.keys)."""
        return keys.encoder_identity(self.spec.family, self.spec.name)

    @abstractmethod
    def encode(self, prompts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Embeddings for each (prompt, negative_prompt), as dicts of CPU tensors."""

    @abstractmethod
    def prepare(self, request: GenerationRequest, embeddings: dict[str, Any]) -> DenoiseState:
        """Initial latents from the request's seed; state.step == 0."""

    @abstractmethod
    def step(self, state: DenoiseState) -> None:
        """Run one denoising step in place; increments state.step."""

    def step_many(self, states: list[DenoiseState]) -> None:
        """One step of several jobs of the same shape (merged work), each its own state.

        A family whose model call can take the jobs as one batch overrides this:
        one forward pass over every job's rows, then each job's own scheduler
        step with its own generator, so a job's result does not depend on its
        batch mates. This default runs them one after another.
        """
        for state in states:
            self.step(state)

    @abstractmethod
    def checkpoint(self, state: DenoiseState) -> dict[str, Any]:
        """A dict of CPU tensors and plain values from which `restore` continues exactly."""

    @abstractmethod
    def restore(self, request: GenerationRequest, embeddings: dict[str, Any], data: dict[str, Any]) -> DenoiseState:
        """Rebuild the state saved by `checkpoint`."""

    @abstractmethod
    def preview(self, state: DenoiseState) -> Any:
        """A small PIL image of the current latents (cheap: no full VAE decode)."""

    @abstractmethod
    def decode(self, state: DenoiseState) -> list[Any]:
        """One entry per output: a PIL image (image families) or a list of PIL frames (video families)."""

    def memory_bytes(self) -> int:
        """Resident bytes of the loaded components (parameters + buffers), for the model cache's budget."""
        from .components import component_bytes

        return sum(component_bytes(module) for module in self.components.values())

    def memory_by_component(self) -> dict[str, dict[str, int]]:
        """{component: {dtype: bytes}} of what this instance holds."""
        from .components import bytes_by_dtype

        return bytes_by_dtype(self.components)

    def blank_embeddings(self) -> dict[str, Any]:
        """Zero embeddings of the shapes `encode` makes (no text encoder needed)."""
        raise NotImplementedError(f"{type(self).__name__} has no blank embeddings")

    def warm_up(self) -> None:
        """One step at the entry's default shape on blank embeddings: what a compiled denoiser compiles
        on (speed.py), run before the worker takes a job."""
        d = self.spec.defaults
        request = GenerationRequest(
            job_id="warm-up",
            model=self.spec.name,
            prompt="",
            negative_prompt="",
            width=d.width,
            height=d.height,
            num_frames=d.num_frames,
            steps=d.steps,
            guidance_scale=d.guidance_scale,
            seed=0,
        )
        self.step(self.prepare(request, self.blank_embeddings()))

    def checkpoint_fields(self, state: DenoiseState, checkpoint_format: str) -> dict[str, Any]:
        """What every family's checkpoint holds: position, latents, scheduler index and RNG (CPU copies)."""
        from .common import host_copy  # common imports this module

        scheduler = state.scheduler
        # The index the next step will use. None until the first scale_model_input/step,
        # in which case begin_index says where it will start.
        index = scheduler.step_index if scheduler.step_index is not None else scheduler.begin_index
        fields = {
            "format": checkpoint_format,
            "model": self.spec.name,
            "step": int(state.step),
            "steps": int(state.request.steps),
            "latents": host_copy(state.latents),
            "scheduler_class": type(scheduler).__name__,
            "scheduler_step_index": int(index),
            "generator_state": state.generator.get_state().clone(),
        }
        return fields | self.denoised_field(state)

    @staticmethod
    def denoised_field(state: DenoiseState) -> dict[str, Any]:
        """The last step's x0 estimate as a checkpoint entry (none before the first step): what a job
        stopped early decodes, and what a rescheduled one continues from."""
        from .common import host_copy

        denoised = state.extra.get("denoised")
        return {} if denoised is None else {"denoised": host_copy(denoised)}

    def final_latents(self, state: DenoiseState) -> Any:
        """What `decode` turns into pixels: the latents of a finished state; for one whose schedule has
        not ended (a job stopped early) its current x0 estimate, when it has one."""
        if not state.done and state.extra.get("denoised") is not None:
            return state.extra["denoised"]
        return state.latents

    def reschedule(self, state: DenoiseState, new_steps: int) -> DenoiseState:
        """The state (k = state.step steps done) continued on a schedule for `new_steps` in all, k < new_steps:
        re-expressed at the new schedule's noise level for step k (see reschedule.py)."""
        raise NotImplementedError(f"{type(self).__name__} cannot change the step count midway")

    @staticmethod
    def check_checkpoint_fields(data: dict[str, Any], request: GenerationRequest, formats: tuple[str, ...]) -> None:
        """Refuse a checkpoint of another format or step count before restoring anything."""
        if data.get("format") not in formats:
            raise ValueError(f"not a {formats[-1]} checkpoint (format={data.get('format')!r})")
        if data["steps"] != request.steps:
            raise ValueError(f"checkpoint was made for {data['steps']} steps, the request has {request.steps}")

    @staticmethod
    def check_mergeable(states: list[DenoiseState]) -> None:
        """Refuse to batch jobs whose model inputs differ in shape or schedule (the merge key)."""
        first = states[0].request
        for state in states:
            r = state.request
            if state.done:
                raise ValueError(f"job {r.job_id}: all {r.steps} steps are done")
            if (r.model, r.width, r.height, r.num_frames, r.steps, r.guidance_scale) != (
                first.model,
                first.width,
                first.height,
                first.num_frames,
                first.steps,
                first.guidance_scale,
            ):
                raise ValueError(
                    f"job {r.job_id} cannot share a batch with job {first.job_id}: the model, size, "
                    f"frames, steps and guidance must all be equal"
                )
            if state.step != states[0].step:
                raise ValueError(f"job {r.job_id} is at step {state.step}, its batch at {states[0].step}")

    @staticmethod
    def rows(states: list[DenoiseState]) -> list[int]:
        """How many batch rows (outputs) each state brings to a merged model call."""
        return [int(state.latents.shape[0]) for state in states]

    @staticmethod
    def guidance_batch(parts: list[Any], cfg: bool) -> Any:
        """Concatenate per-job model inputs laid out [uncond rows, cond rows] into one batch in the
        same layout ([uncond of every job, cond of every job]), so one `.chunk(2)` splits it again."""
        import torch

        if not cfg:
            return torch.cat(parts)
        halves = [part.chunk(2) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])

    @staticmethod
    def set_vae_tiling(vae: Any, width: int, height: int) -> bool:
        """Decode in tiles above GENSERVER_VAE_TILE_ABOVE_PIXELS (per frame): the VAE decode is the
        memory peak of a job, and tiling caps it at some speed and faint seams. Returns whether on."""
        tiled = width * height > config.vae_tile_above_pixels()
        if hasattr(vae, "enable_tiling"):
            vae.enable_tiling() if tiled else vae.disable_tiling()
        return tiled
