"""The flow-matching transformer family (FLUX style): a diffusers checkpoint run one step at a time.

The flow is FluxPipeline's (diffusers 0.42), cut at step boundaries:

    1. encode      CLIP → pooled text vector; T5 → per-token embeddings (512 tokens),
                   all prompts in one batch per encoder
    2. prepare     seeded Gaussian latents [n, 16, H/8, W/8], packed into 2×2 patches
                   → [n, (H/16)·(W/16), 64]; flow sigmas 1 → 1/steps, shifted by
                   mu = calculate_shift(image tokens) (FLUX's resolution-dependent shift)
    3. step        one transformer call with the guidance *embedding* (FLUX.1-dev is
                   guidance-distilled: no classifier-free guidance, no negative pass)
                   + scheduler.step on the predicted velocity
    4. checkpoint  packed latents, step, scheduler position and multistep history, generator state (CPU)
    5. preview     the x0 estimate (latents − σ·velocity), unpacked, through FLUX's 16×3
                   latent→RGB projection, no VAE
    6. decode      unpack, latents / scaling_factor + shift_factor, VAE decode

Each stage builds only its own components (components.py): encode CLIP + T5,
denoise the transformer, decode the VAE.

The negative prompt is not used: FLUX has no unconditional pass (the pipeline's
optional "true CFG" doubles the cost and is not offered; the cost model counts
one pass per step for this family). Its guidance_scale feeds the guidance
embedding when the transformer has one (FLUX.1-dev); FLUX.1-schnell has none.

Schedulers (the registry's `scheduler`): `flow_euler` (FlowMatchEulerDiscreteScheduler,
FLUX's own; `euler` is an alias, being the registry's default) and `flow_dpmpp_2m`
(DPMSolverMultistepScheduler with flow sigmas and flow_prediction: DPM-Solver++
2M on the same shifted schedule, multistep, so its history is checkpointed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from genserver.registry import ModelSpec
from workers.runtime.base import STAGES, DenoiseState, Family, GenerationRequest
from workers.runtime.common import (
    CheckpointMissingError,
    check_checkpoint_dir,
    last_denoised,
    latent_preview,
    pil_images,
    resumed_state,
    scheduler_class,
    scheduler_history,
)
from workers.runtime.components import read_config, torch_dtype

__all__ = ["FluxFamily", "CheckpointMissingError", "CHECKPOINT_FORMAT", "FLUX_SCHEDULERS"]

CHECKPOINT_FORMAT = "flux/1"
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")
MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's default (and maximum) T5 length

# FLUX's latent → RGB projection (ComfyUI's factors, applied to the scaled and
# shifted latents the transformer works on). Rows: 16 latent channels; columns: R, G, B.
FLUX_LATENT_RGB = torch.tensor(
    [
        [-0.0346, 0.0244, 0.0681],
        [0.0034, 0.0210, 0.0687],
        [0.0275, -0.0668, -0.0433],
        [-0.0174, 0.0160, 0.0617],
        [0.0859, 0.0721, 0.0329],
        [0.0004, 0.0383, 0.0115],
        [0.0405, 0.0861, 0.0915],
        [-0.0236, -0.0185, -0.0259],
        [-0.0245, 0.0250, 0.1180],
        [0.1008, 0.0755, -0.0421],
        [-0.0515, 0.0201, 0.0011],
        [0.0428, -0.0012, -0.0036],
        [0.0817, 0.0765, 0.0749],
        [-0.1264, -0.0522, -0.1103],
        [-0.0280, -0.0881, -0.0499],
        [-0.1262, -0.0982, -0.0778],
    ]
)
FLUX_LATENT_RGB_BIAS = torch.tensor([-0.0329, -0.0718, -0.0851])

# Registry `scheduler` name → (diffusers class, settings on top of the checkpoint's
# scheduler config). For DPM++ the flow settings are added in _scheduler_settings
# (its `flow_shift` is the checkpoint's `shift`).
_FLOW_EULER = ("FlowMatchEulerDiscreteScheduler", {})
FLUX_SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "flow_euler": _FLOW_EULER,
    "euler": _FLOW_EULER,  # the registry's default scheduler name
    "flow_dpmpp_2m": (
        "DPMSolverMultistepScheduler",
        {
            "algorithm_type": "dpmsolver++",
            "solver_order": 2,
            "use_flow_sigmas": True,
            "prediction_type": "flow_prediction",
        },
    ),
}


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FluxPipeline's `calculate_shift`: mu grows linearly with the number of image tokens."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[n, C, h, w] → [n, (h/2)·(w/2), C·4]: each 2×2 patch becomes one token (FluxPipeline._pack_latents)."""
    n, c, h, w = latents.shape
    latents = latents.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(n, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of pack_latents, for latent height h and width w (FluxPipeline._unpack_latents)."""
    n, _, features = latents.shape
    latents = latents.view(n, h // 2, w // 2, features // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(n, features // 4, h, w)


def latent_image_ids(h: int, w: int) -> torch.Tensor:
    """[(h/2)·(w/2), 3] rotary positions (0, row, column) of the packed tokens (FluxPipeline's)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


class FluxFamily(Family):
    """A FLUX-style model: CLIP + T5 text encoders, FluxTransformer2DModel, 16-channel AutoencoderKL.

    Weights load once, at construction, with `local_files_only=True`. Modules live
    on `device`; embeddings, checkpoints and the random generator stay on the CPU.
    """

    def __init__(
        self,
        spec: ModelSpec,
        device: str,
        data_dir: Path,
        stages: tuple[str, ...] = STAGES,
        *,
        weights: str = "checkpoint",
    ) -> None:
        super().__init__(spec, device, data_dir, stages)
        self.path = spec.resolved_path(data_dir)
        check_checkpoint_dir(
            spec, self.path, tuple(c for c in COMPONENTS if weights == "checkpoint" or "tokenizer" not in c)
        )
        # Fail before loading weights.
        self.scheduler_class, self.scheduler_settings = scheduler_class("flux", FLUX_SCHEDULERS, spec.scheduler)
        self.dtype = torch_dtype(spec, device)
        # Shapes from the configs (no weights): every stage knows them, whichever it loads.
        self.transformer_config = read_config(self.path, "transformer")
        self.vae_scale_factor = 2 ** (len(read_config(self.path, "vae")["block_out_channels"]) - 1)
        self.latent_channels = self.transformer_config["in_channels"] // 4  # packed 2×2
        self.max_sequence_length = min(MAX_SEQUENCE_LENGTH, self._t5_max_length())
        if self.scheduler_class.__name__ == "DPMSolverMultistepScheduler":
            self.scheduler_settings.update(self._dpm_flow_settings())
        components = self.load_components(weights)
        self.tokenizer, self.text_encoder = components.get("tokenizer"), components.get("text_encoder")
        self.tokenizer_2, self.text_encoder_2 = components.get("tokenizer_2"), components.get("text_encoder_2")
        self.transformer, self.vae = components.get("transformer"), components.get("vae")

    def _t5_max_length(self) -> int:
        config = self.path / "tokenizer_2" / "tokenizer_config.json"
        length = json.loads(config.read_text()).get("model_max_length") if config.is_file() else None
        return int(length) if isinstance(length, (int, float)) and length < 10**6 else MAX_SEQUENCE_LENGTH

    def blank_embeddings(self) -> dict[str, Any]:
        """Zero embeddings of the real shapes (the compile warm-up; benchmarks without tokenizers)."""
        config = self.transformer_config
        return {
            "prompt_embeds": torch.zeros(1, self.max_sequence_length, config["joint_attention_dim"], dtype=self.dtype),
            "pooled_embeds": torch.zeros(1, config["pooled_projection_dim"], dtype=self.dtype),
        }

    def _dpm_flow_settings(self) -> dict[str, Any]:
        """DPM++ on FLUX's schedule: its `flow_shift` is the flow scheduler's static `shift`;
        with dynamic shifting, set_timesteps(mu=...) replaces it by exp(mu), as FLUX's time shift does."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = FlowMatchEulerDiscreteScheduler.load_config(self.path / "scheduler", local_files_only=True)
        return {
            "flow_shift": float(config.get("shift", 1.0)),
            "use_dynamic_shifting": bool(config.get("use_dynamic_shifting", False)),
            "time_shift_type": "exponential",
        }

    # 1. encode ---------------------------------------------------------------

    @torch.no_grad()
    def encode(self, prompts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Per prompt: T5 `prompt_embeds` [1, 512, D] and CLIP `pooled_embeds` [1, P]. Negatives are unused."""
        if not prompts:
            return []
        texts = [p for p, _ in prompts]
        # CLIP: only the pooled output (FluxPipeline._get_clip_prompt_embeds).
        clip_ids = self.component("tokenizer")(
            texts,
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        pooled = self.text_encoder(clip_ids.to(self.encode_device), output_hidden_states=False).pooler_output
        # T5: every token's last hidden state, padded to 512, no attention mask
        # (FluxPipeline._get_t5_prompt_embeds).
        t5_ids = self.component("tokenizer_2")(
            texts, padding="max_length", max_length=self.max_sequence_length, truncation=True, return_tensors="pt"
        ).input_ids
        embeds = self.text_encoder_2(t5_ids.to(self.encode_device), output_hidden_states=False)[0]
        embeds, pooled = embeds.to("cpu"), pooled.to("cpu")
        return [
            {"prompt_embeds": embeds[i : i + 1].clone(), "pooled_embeds": pooled[i : i + 1].clone()}
            for i in range(len(prompts))
        ]

    # 2. prepare --------------------------------------------------------------

    def _latent_size(self, request: GenerationRequest) -> tuple[int, int]:
        cell = self.vae_scale_factor * 2  # VAE downsampling × 2×2 packing
        if request.width % cell or request.height % cell:
            raise ValueError(
                f"{self.spec.name}: width and height must be multiples of {cell}, got {request.width}×{request.height}"
            )
        return request.height // self.vae_scale_factor, request.width // self.vae_scale_factor

    def prepare(self, request: GenerationRequest, embeddings: dict[str, Any]) -> DenoiseState:
        h, w = self._latent_size(request)
        # One CPU generator for the whole batch: output i is the i-th slice of one
        # seeded draw (what FluxPipeline's randn_tensor does with a CPU generator).
        generator = torch.Generator("cpu").manual_seed(request.seed)
        noise = torch.randn((request.num_outputs, self.latent_channels, h, w), generator=generator, dtype=self.dtype)
        latents = pack_latents(noise).to(self.device)  # σ = 1: pure noise, no scaling
        scheduler = self._new_scheduler(request, begin_index=0)
        return DenoiseState(
            request=request, step=0, latents=latents, embeddings=embeddings, scheduler=scheduler, generator=generator
        )

    def _new_scheduler(self, request: GenerationRequest, begin_index: int) -> Any:
        scheduler = self.scheduler_class.from_pretrained(
            self.path / "scheduler", local_files_only=True, **self.scheduler_settings
        )
        h, w = self._latent_size(request)
        config = scheduler.config
        # FluxPipeline: mu from the number of image tokens, sigmas 1 → 1/steps
        # (which the scheduler then shifts by mu), unless the scheduler makes its
        # own flow sigmas (DPM++ with use_flow_sigmas).
        mu = calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        kwargs: dict[str, Any] = {"mu": mu} if config.get("use_dynamic_shifting", False) else {}
        if not config.get("use_flow_sigmas", False):
            kwargs["sigmas"] = np.linspace(1.0, 1 / request.steps, request.steps)
            scheduler.set_timesteps(device=self.device, **kwargs)
        else:
            scheduler.set_timesteps(request.steps, device=self.device, **kwargs)
        if len(scheduler.timesteps) != request.steps:
            raise ValueError(
                f"{type(scheduler).__name__} made {len(scheduler.timesteps)} timesteps for {request.steps} steps"
            )
        # set_timesteps clears the position; the first step takes it from begin_index.
        scheduler.set_begin_index(begin_index)
        return scheduler

    # 3. step -----------------------------------------------------------------

    def _conditioning(self, state: DenoiseState) -> dict[str, Any]:
        """The transformer's conditioning inputs for the batch, on the device (built once per state)."""
        cached = state.extra.get("conditioning")
        if cached is not None:
            return cached
        request, n = state.request, state.request.num_outputs
        embeds = state.embeddings["prompt_embeds"].to(self.device, self.dtype)
        pooled = state.embeddings["pooled_embeds"].to(self.device, self.dtype)
        h, w = self._latent_size(request)
        conditioning = {
            "encoder_hidden_states": embeds.expand(n, -1, -1),
            "pooled_projections": pooled.expand(n, -1),
            "txt_ids": torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype),
            "img_ids": latent_image_ids(h, w).to(self.device, self.dtype),
            # FLUX.1-dev's distilled guidance: a number the transformer embeds, one pass.
            "guidance": (
                torch.full([n], request.guidance_scale, device=self.device, dtype=torch.float32)
                if self.transformer_config.get("guidance_embeds")
                else None
            ),
        }
        state.extra["conditioning"] = conditioning
        return conditioning

    def step(self, state: DenoiseState) -> None:
        self.step_many([state])

    @torch.no_grad()  # not inference_mode: state.latents outlives the call and may be touched later
    def step_many(self, states: list[DenoiseState]) -> None:
        """One transformer call for every job's rows, then each job's own scheduler step."""
        self.check_mergeable(states)
        conditioning = [self._conditioning(state) for state in states]
        batch = dict(conditioning[0])  # txt_ids / img_ids depend on the shape only: shared
        for name in ("encoder_hidden_states", "pooled_projections", "guidance"):
            if batch[name] is not None:
                batch[name] = torch.cat([c[name] for c in conditioning])
        latents = torch.cat([state.latents for state in states])
        # The transformer takes t in [0, 1] (FluxPipeline: timestep / 1000).
        timestep = (
            torch.cat([state.scheduler.timesteps[state.step].expand(state.latents.shape[0]) for state in states]).to(
                latents.dtype
            )
            / 1000
        )
        velocities = self.component("transformer")(
            hidden_states=latents, timestep=timestep, return_dict=False, **batch
        )[0].split(self.rows(states))
        for state, velocity in zip(states, velocities):
            scheduler, latents = state.scheduler, state.latents
            t = scheduler.timesteps[state.step]
            sigma = scheduler.sigmas[state.step].to(latents.device, latents.dtype)
            state.latents = scheduler.step(velocity, t, latents, generator=state.generator).prev_sample
            # x_t = (1 − σ)·x0 + σ·noise and v = noise − x0, so x0 = x_t − σ·v. For the
            # preview only; not part of the checkpoint.
            state.extra["denoised"] = latents - sigma * velocity
            state.step += 1

    # 4. checkpoint / restore -------------------------------------------------

    def checkpoint(self, state: DenoiseState) -> dict[str, Any]:
        # Latents stay packed: [n, tokens, 64].
        return self.checkpoint_fields(state, CHECKPOINT_FORMAT) | scheduler_history(state.scheduler)

    def restore(self, request: GenerationRequest, embeddings: dict[str, Any], data: dict[str, Any]) -> DenoiseState:
        self.check_checkpoint_fields(data, request, (CHECKPOINT_FORMAT,))
        h, w = self._latent_size(request)
        expected = (request.num_outputs, (h // 2) * (w // 2), self.latent_channels * 4)
        if tuple(data["latents"].shape) != expected:
            raise ValueError(f"checkpoint latents {tuple(data['latents'].shape)} do not fit the request ({expected})")
        scheduler = self._new_scheduler(request, begin_index=int(data["scheduler_step_index"]))
        return resumed_state(scheduler, data, request, embeddings, self.device, self.dtype)

    @torch.no_grad()
    def reschedule(self, state: DenoiseState, new_steps: int) -> DenoiseState:
        """Continue on a fresh (shifted) schedule for `new_steps` (see reschedule.py; history reset)."""
        import dataclasses

        from workers.runtime.reschedule import continue_state

        scheduler = self._new_scheduler(dataclasses.replace(state.request, steps=new_steps), begin_index=state.step)
        return continue_state(state, new_steps, scheduler)

    # 5. preview --------------------------------------------------------------

    @torch.no_grad()
    def preview(self, state: DenoiseState) -> Image.Image:
        denoised = last_denoised(state)
        if denoised is None:
            denoised = state.latents  # before the first step (or after a restore): the noisy latents
        h, w = self._latent_size(state.request)
        latent = unpack_latents(denoised[:1].to("cpu", torch.float32), h, w)[0]  # first output
        return latent_preview(latent, FLUX_LATENT_RGB, FLUX_LATENT_RGB_BIAS)

    # 6. decode ---------------------------------------------------------------

    @torch.no_grad()
    def decode(self, state: DenoiseState) -> list[Image.Image]:
        vae = self.component("vae")
        h, w = self._latent_size(state.request)
        latents = unpack_latents(self.final_latents(state).to(self.device, vae.dtype), h, w)
        latents = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        self.set_vae_tiling(vae, state.request.width, state.request.height)
        return pil_images(vae.decode(latents).sample)  # [n, 3, H, W] in [-1, 1] → RGB
