"""The UNet family (SD 1.5 and SDXL): a diffusers checkpoint run one step at a time.

The flow is StableDiffusionPipeline's (and StableDiffusionXLPipeline's), cut at
step boundaries:

    1. encode      CLIP tokenizer + text encoder, prompt and negative in one batch
                   (SDXL: both encoders, penultimate hidden states concatenated,
                   plus the second encoder's pooled projection)
    2. prepare     seeded Gaussian latents × init_noise_sigma, scheduler set for `steps`
    3. step        classifier-free guidance (one UNet call on [uncond, cond]) + scheduler.step
                   (SDXL: pooled text embeds + time ids as `added_cond_kwargs`)
    4. checkpoint  latents, step, scheduler position and multistep history, generator state, the last
                   x0 estimate (CPU); `reschedule` continues on a schedule for another total
    5. preview     SD's (or SDXL's) 4×3 latent→RGB projection, no VAE
    6. decode      VAE decode of latents / scaling_factor (a job stopped early: its x0 estimate)

A checkpoint directory with `text_encoder_2/` and `tokenizer_2/` is SDXL; one
without is SD 1.5. As StableDiffusionXLPipeline does for a missing negative
prompt (`force_zeros_for_empty_prompt`), SDXL's empty negative prompt is zeros,
not the encoding of "". The scheduler is the registry entry's `scheduler`
(UNET_SCHEDULERS), configured from the checkpoint's scheduler/ folder.

Each stage builds only its own components (components.py): encode the CLIP
tokenizers and encoders, denoise the UNet, decode the VAE; every stage reads the
others' config.json files for shapes. Shared helpers live in common.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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

__all__ = ["UNetFamily", "CheckpointMissingError", "CHECKPOINT_FORMAT", "UNET_SCHEDULERS"]

# unet/2 added the multistep history (`scheduler_history`, `scheduler_model_outputs`);
# a unet/1 checkpoint has none, which is exact for the schedulers unet/1 knew (Euler, Euler a).
CHECKPOINT_FORMAT = "unet/2"
READABLE_FORMATS = ("unet/1", "unet/2")
COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
SDXL_COMPONENTS = ("text_encoder_2", "tokenizer_2")

# Latent → RGB projections (the community-standard factors, as used by ComfyUI's
# previews). Rows: latent channels; columns: R, G, B in [-1, 1].
SD15_LATENT_RGB = torch.tensor(
    [
        [0.3512, 0.2297, 0.3227],
        [0.3250, 0.4974, 0.2350],
        [-0.2829, 0.1762, 0.2721],
        [-0.2120, -0.2616, -0.7177],
    ]
)
SDXL_LATENT_RGB = torch.tensor(
    [
        [0.3651, 0.4232, 0.4341],
        [-0.2533, -0.0042, 0.1068],
        [0.1076, 0.1111, -0.0362],
        [-0.3165, -0.2492, -0.2188],
    ]
)
SDXL_LATENT_RGB_BIAS = torch.tensor([0.1084, -0.0175, -0.0011])

# Registry `scheduler` name → (diffusers class, settings on top of the checkpoint's
# scheduler config). The checkpoint's config keeps the model's noise schedule
# (betas, timestep spacing, prediction type); the class and these settings pick
# the solver, as `Scheduler.from_config(pipe.scheduler.config, **settings)` would.
UNET_SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    # DPM++ 2M: multistep, second order, data (x0) prediction; no Karras sigmas.
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
}


class UNetFamily(Family):
    """An SD-1.5- or SDXL-style model: CLIP text encoder(s), UNet2DConditionModel, AutoencoderKL.

    Weights load once, at construction, with `local_files_only=True`. Modules live
    on `device`; embeddings, checkpoints and the random generator stay on the CPU,
    so a job's randomness doesn't depend on the card it happens to run on.
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
        # SDXL if either second-encoder folder is there (then both must be).
        self.is_sdxl = any((self.path / c).exists() for c in SDXL_COMPONENTS)
        required = COMPONENTS + (SDXL_COMPONENTS if self.is_sdxl else ())
        check_checkpoint_dir(
            spec, self.path, tuple(c for c in required if weights == "checkpoint" or "tokenizer" not in c)
        )
        # Fail before loading weights.
        self.scheduler_class, self.scheduler_settings = scheduler_class("unet", UNET_SCHEDULERS, spec.scheduler)
        self.dtype = torch_dtype(spec, device)
        # Shapes from the configs (no weights): every stage knows them, whichever it loads.
        self.unet_config = read_config(self.path, "unet")
        self.vae_scale_factor = 2 ** (len(read_config(self.path, "vae")["block_out_channels"]) - 1)
        self.latent_channels = self.unet_config["in_channels"]
        if self.is_sdxl:
            self._check_sdxl_dims()
        # SDXL zeroes an empty negative prompt (StableDiffusionXLPipeline's
        # `force_zeros_for_empty_prompt`, stored in model_index.json) instead of encoding "".
        self.force_zeros_for_empty_prompt = self.is_sdxl and self._model_index().get(
            "force_zeros_for_empty_prompt", True
        )
        components = self.load_components(weights)
        self.tokenizer, self.text_encoder = components.get("tokenizer"), components.get("text_encoder")
        # SDXL: a second CLIP (OpenCLIP bigG) whose projected pooled output and the
        # 6 time ids make the UNet's `text_time` added conditioning.
        self.tokenizer_2, self.text_encoder_2 = components.get("tokenizer_2"), components.get("text_encoder_2")
        self.unet, self.vae = components.get("unet"), components.get("vae")

    def _model_index(self) -> dict[str, Any]:
        index = self.path / "model_index.json"
        return json.loads(index.read_text()) if index.is_file() else {}

    def _check_sdxl_dims(self) -> None:
        """The UNet's added embedding must take 6 time ids + the pooled projection (as the pipeline checks)."""
        config = self.unet_config
        if config.get("addition_embed_type") != "text_time":
            raise ValueError(
                f"model {self.spec.name!r}: has text_encoder_2/ but its UNet's addition_embed_type "
                f"is {config.get('addition_embed_type')!r}, not 'text_time' (SDXL)"
            )
        passed = config["addition_time_embed_dim"] * 6 + self.pooled_dim
        expected = config["projection_class_embeddings_input_dim"]
        if passed != expected:
            raise ValueError(
                f"model {self.spec.name!r}: UNet expects an added embedding of {expected}, "
                f"6 time ids + pooled text give {passed}"
            )

    @property
    def pooled_dim(self) -> int:
        """SDXL's pooled text width: the second encoder's projection."""
        return int(read_config(self.path, "text_encoder_2")["projection_dim"])

    def blank_embeddings(self) -> dict[str, Any]:
        """Zero embeddings of the real shapes (the compile warm-up; benchmarks without tokenizers)."""
        tokens = int(read_config(self.path, "text_encoder").get("max_position_embeddings", 77))
        embeds = torch.zeros(1, tokens, self.unet_config["cross_attention_dim"], dtype=self.dtype)
        out = {"prompt_embeds": embeds, "negative_embeds": embeds}
        if self.is_sdxl:
            out["pooled_embeds"] = out["negative_pooled_embeds"] = torch.zeros(1, self.pooled_dim, dtype=self.dtype)
        return out

    # 1. encode ---------------------------------------------------------------

    @torch.no_grad()
    def encode(self, prompts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        if not prompts:
            return []
        # One text-encoder call (per encoder) for all prompts and negatives: [p0..pn-1, n0..nn-1].
        texts = [p for p, _ in prompts] + [n for _, n in prompts]
        embeds, pooled = self._encode_texts(texts)  # needs the encode stage
        embeds = embeds.to("cpu")
        pooled = pooled.to("cpu") if pooled is not None else None
        n = len(prompts)
        out = []
        for i, (_, negative) in enumerate(prompts):
            item = {"prompt_embeds": embeds[i : i + 1].clone(), "negative_embeds": embeds[n + i : n + i + 1].clone()}
            if pooled is not None:
                item["pooled_embeds"] = pooled[i : i + 1].clone()
                item["negative_pooled_embeds"] = pooled[n + i : n + i + 1].clone()
                if self.force_zeros_for_empty_prompt and not negative:
                    item["negative_embeds"] = torch.zeros_like(item["negative_embeds"])
                    item["negative_pooled_embeds"] = torch.zeros_like(item["negative_pooled_embeds"])
            out.append(item)
        return out

    def _encode_texts(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([len(texts), 77, D] hidden states, [len(texts), P] pooled or None), like the pipelines."""
        if not self.is_sdxl:
            tokens = self._tokens(self.component("tokenizer"), texts)
            # SD 1.5: last hidden states; no attention mask (padding is attended to, as in training).
            return self.text_encoder(tokens)[0], None
        # SDXL: the penultimate hidden states of both encoders, side by side; the
        # pooled projection of the second (its output [0] is the 2-D `text_embeds`).
        hidden = []
        for tokenizer, encoder in (
            (self.component("tokenizer"), self.text_encoder),
            (self.component("tokenizer_2"), self.text_encoder_2),
        ):
            output = encoder(self._tokens(tokenizer, texts), output_hidden_states=True)
            hidden.append(output.hidden_states[-2])
        return torch.cat(hidden, dim=-1), output[0]

    def _tokens(self, tokenizer: Any, texts: list[str]) -> torch.Tensor:
        return tokenizer(
            texts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
        ).input_ids.to(self.encode_device)

    # 2. prepare --------------------------------------------------------------

    def prepare(self, request: GenerationRequest, embeddings: dict[str, Any]) -> DenoiseState:
        cell = self.vae_scale_factor
        if request.width % cell or request.height % cell:
            raise ValueError(
                f"{self.spec.name}: width and height must be multiples of {cell}, got {request.width}×{request.height}"
            )
        shape = (request.num_outputs, self.latent_channels, request.height // cell, request.width // cell)
        # One CPU generator for the whole batch: output i is the i-th slice of one
        # seeded draw, identical on every device (as diffusers' randn_tensor does
        # with a CPU generator).
        generator = torch.Generator("cpu").manual_seed(request.seed)
        noise = torch.randn(shape, generator=generator, dtype=self.dtype)
        scheduler = self._new_scheduler(request.steps, begin_index=0)
        latents = (noise * scheduler.init_noise_sigma).to(self.device)
        return DenoiseState(
            request=request, step=0, latents=latents, embeddings=embeddings, scheduler=scheduler, generator=generator
        )

    def _new_scheduler(self, steps: int, begin_index: int) -> Any:
        scheduler = self.scheduler_class.from_pretrained(
            self.path / "scheduler", local_files_only=True, **self.scheduler_settings
        )
        scheduler.set_timesteps(steps, device=self.device)
        # set_timesteps clears the position; the first scale_model_input/step then
        # takes it from begin_index (public API, unlike assigning _step_index).
        scheduler.set_begin_index(begin_index)
        return scheduler

    # 3. step -----------------------------------------------------------------

    def _cfg(self, request: GenerationRequest) -> bool:
        return request.guidance_scale > 1.0

    def _conditioning(self, state: DenoiseState) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """(encoder_hidden_states, added_cond_kwargs) for the UNet batch, on the device (built once per state)."""
        cached = state.extra.get("conditioning")
        if cached is not None:
            return cached
        request, n = state.request, state.request.num_outputs
        cfg = self._cfg(request)

        def batch(positive: str, negative: str) -> torch.Tensor:
            """[uncond × n, cond × n] with CFG (the pipelines' order), else [cond × n]."""
            cond = state.embeddings[positive].to(self.device, self.dtype)
            cond = cond.expand(n, *cond.shape[1:])
            if not cfg:
                return cond
            uncond = state.embeddings[negative].to(self.device, self.dtype)
            return torch.cat([uncond.expand(n, *uncond.shape[1:]), cond])

        hidden = batch("prompt_embeds", "negative_embeds")
        added = None
        if self.is_sdxl:
            # SDXL's micro-conditioning: original size, crop top-left, target size, in
            # pixels, (h, w) order; the pipeline's defaults (no crop, original = target).
            h, w = request.height, request.width
            time_ids = torch.tensor([[h, w, 0, 0, h, w]], dtype=self.dtype, device=self.device)
            added = {
                "text_embeds": batch("pooled_embeds", "negative_pooled_embeds"),
                "time_ids": time_ids.repeat(hidden.shape[0], 1),
            }
        state.extra["conditioning"] = (hidden, added)
        return hidden, added

    def step(self, state: DenoiseState) -> None:
        self.step_many([state])

    @torch.no_grad()  # not inference_mode: state.latents outlives the call and may be touched later
    def step_many(self, states: list[DenoiseState]) -> None:
        """One UNet call for every job's rows ([uncond of all, cond of all] with CFG), then each job's
        own guidance and scheduler step with its own generator."""
        self.check_mergeable(states)
        cfg = self._cfg(states[0].request)
        rows = self.rows(states)
        inputs, timesteps, hidden, text_embeds, time_ids = [], [], [], [], []
        for state in states:
            t = state.scheduler.timesteps[state.step]
            inputs.append(state.scheduler.scale_model_input(state.latents, t))
            timesteps.append(t.expand(state.latents.shape[0]))
            state_hidden, added = self._conditioning(state)
            hidden.append(state_hidden)
            if added is not None:
                text_embeds.append(added["text_embeds"])
                time_ids.append(added["time_ids"])
        model_input, timestep = torch.cat(inputs), torch.cat(timesteps)
        if cfg:  # Classifier-free guidance: [uncond, cond] in one UNet call.
            model_input, timestep = torch.cat([model_input] * 2), torch.cat([timestep] * 2)
        added = (
            {"text_embeds": self.guidance_batch(text_embeds, cfg), "time_ids": self.guidance_batch(time_ids, cfg)}
            if text_embeds
            else None
        )
        unet = self.component("unet")
        noise_pred = unet(
            model_input, timestep, encoder_hidden_states=self.guidance_batch(hidden, cfg), added_cond_kwargs=added
        ).sample
        halves = [part.split(rows) for part in noise_pred.chunk(2)] if cfg else [noise_pred.split(rows)]
        for i, state in enumerate(states):
            pred = halves[0][i] + state.request.guidance_scale * (halves[1][i] - halves[0][i]) if cfg else halves[0][i]
            t = state.scheduler.timesteps[state.step]
            out = state.scheduler.step(pred, t, state.latents, generator=state.generator)
            state.latents = out.prev_sample
            # Kept for the preview only (a far better picture than the noisy latents);
            # not part of the checkpoint. Euler's pred_original_sample; DPM++'s newest
            # history entry is the same thing (its data prediction).
            denoised = getattr(out, "pred_original_sample", None)
            if denoised is None and getattr(state.scheduler, "model_outputs", None):
                denoised = state.scheduler.model_outputs[-1]
            state.extra["denoised"] = denoised
            state.step += 1

    # 4. checkpoint / restore -------------------------------------------------

    def checkpoint(self, state: DenoiseState) -> dict[str, Any]:
        return self.checkpoint_fields(state, CHECKPOINT_FORMAT) | scheduler_history(state.scheduler)

    def restore(self, request: GenerationRequest, embeddings: dict[str, Any], data: dict[str, Any]) -> DenoiseState:
        self.check_checkpoint_fields(data, request, READABLE_FORMATS)
        scheduler = self._new_scheduler(request.steps, begin_index=int(data["scheduler_step_index"]))
        return resumed_state(scheduler, data, request, embeddings, self.device, self.dtype)

    @torch.no_grad()
    def reschedule(self, state: DenoiseState, new_steps: int) -> DenoiseState:
        """Continue on a fresh schedule for `new_steps` (see reschedule.py; multistep history reset)."""
        from workers.runtime.reschedule import continue_state

        return continue_state(state, new_steps, self._new_scheduler(new_steps, begin_index=state.step))

    # 5. preview --------------------------------------------------------------

    @torch.no_grad()
    def preview(self, state: DenoiseState) -> Image.Image:
        scheduler = state.scheduler
        denoised = last_denoised(state)
        if denoised is None:
            # Before the first step (or right after a restore) only the noisy
            # latents exist. Euler-type schedulers scale them by ~sqrt(σ² + 1); undo
            # that so they stay in range. DPM++ keeps them at unit variance already.
            denoised = state.latents
            if scheduler.init_noise_sigma > 1:
                sigma = float(scheduler.sigmas[min(state.step, len(scheduler.sigmas) - 1)])
                denoised = denoised / (sigma**2 + 1) ** 0.5
        if self.is_sdxl:
            return latent_preview(denoised[0], SDXL_LATENT_RGB, SDXL_LATENT_RGB_BIAS)
        return latent_preview(denoised[0], SD15_LATENT_RGB)  # first output

    # 6. decode ---------------------------------------------------------------

    @torch.no_grad()
    def decode(self, state: DenoiseState) -> list[Image.Image]:
        vae = self.component("vae")
        # In the VAE's dtype: float32 where a float16 entry's VAE says force_upcast (components.py).
        latents = self.final_latents(state).to(self.device, vae.dtype) / vae.config.scaling_factor
        self.set_vae_tiling(vae, state.request.width, state.request.height)
        return pil_images(vae.decode(latents).sample)  # [n, 3, H, W] in [-1, 1] → RGB
