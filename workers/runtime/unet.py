"""The UNet family (SD 1.5 style): a diffusers checkpoint run one step at a time.

The flow is StableDiffusionPipeline's, cut at step boundaries:

    1. encode      CLIP tokenizer + text encoder, prompt and negative in one batch
    2. prepare     seeded Gaussian latents × init_noise_sigma, scheduler set for `steps`
    3. step        classifier-free guidance (one UNet call on [uncond, cond]) + scheduler.step
    4. checkpoint  latents, step, scheduler position, generator state (CPU)
    5. preview     SD's 4×3 latent→RGB projection, no VAE
    6. decode      VAE decode of latents / scaling_factor

SDXL (second text encoder, pooled embeddings, time ids) has marked hooks but is
not implemented yet.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from genserver.registry import ModelSpec
from workers.runtime.base import DenoiseState, Family, GenerationRequest

CHECKPOINT_FORMAT = "unet/1"
COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")

# SD 1.5's latent → RGB projection (the community-standard factors, as used by
# ComfyUI's previews). Rows: latent channels; columns: R, G, B in [-1, 1].
SD15_LATENT_RGB = torch.tensor([
    [0.3512, 0.2297, 0.3227],
    [0.3250, 0.4974, 0.2350],
    [-0.2829, 0.1762, 0.2721],
    [-0.2120, -0.2616, -0.7177],
])
PREVIEW_MAX_SIDE = 64


class CheckpointMissingError(FileNotFoundError):
    """The model's local checkpoint directory (or one of its components) is missing."""


def _scheduler_class(name: str) -> type:
    """The scheduler the registry names (`scheduler = ...`); its config comes from the checkpoint."""
    from diffusers import EulerAncestralDiscreteScheduler, EulerDiscreteScheduler

    # Both keep their position in `_step_index` (set from `begin_index`), which is
    # what checkpoint/restore relies on. A multistep scheduler (DPM++) would also
    # need its `model_outputs` history saved; add it here together with that.
    classes = {"euler": EulerDiscreteScheduler, "euler_a": EulerAncestralDiscreteScheduler}
    try:
        return classes[name]
    except KeyError:
        raise ValueError(f"unet family: unknown scheduler {name!r}; known: {sorted(classes)}") from None


class UNetFamily(Family):
    """An SD-1.5-style model: CLIP text encoder, UNet2DConditionModel, AutoencoderKL.

    Weights load once, at construction, with `local_files_only=True`. Modules live
    on `device`; embeddings, checkpoints and the random generator stay on the CPU,
    so a job's randomness doesn't depend on the card it happens to run on.
    """

    def __init__(self, spec: ModelSpec, device: str, data_dir: Path) -> None:
        super().__init__(spec, device, data_dir)
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from diffusers.utils import is_accelerate_available
        from transformers import CLIPTextModel, CLIPTokenizer

        self.path = spec.resolved_path(data_dir)
        self._check_checkpoint()
        self.scheduler_class = _scheduler_class(spec.scheduler)  # fail before loading weights
        # float32 everywhere: the tiny model is cheap anyway, and exact resumption
        # is easier to reason about. (Real SD on a GPU would want fp16/bf16 here.)
        self.dtype = torch.float32
        # dtype at load time (not .to(dtype) later), so modules a model keeps in fp32 stay so;
        # low_cpu_mem_usage only where accelerate can do it (else diffusers warns on every load).
        diffusers_load = {"local_files_only": True, "torch_dtype": self.dtype,
                          "low_cpu_mem_usage": is_accelerate_available()}
        self.tokenizer = CLIPTokenizer.from_pretrained(self.path / "tokenizer", local_files_only=True)
        self.text_encoder = CLIPTextModel.from_pretrained(self.path / "text_encoder", local_files_only=True,
                                                          dtype=self.dtype)
        self.unet = UNet2DConditionModel.from_pretrained(self.path / "unet", **diffusers_load)
        self.vae = AutoencoderKL.from_pretrained(self.path / "vae", **diffusers_load)
        # SDXL hook: load tokenizer_2 / text_encoder_2 (CLIPTextModelWithProjection) here.
        for module in (self.text_encoder, self.unet, self.vae):
            module.to(self.device).eval().requires_grad_(False)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_channels = self.unet.config.in_channels

    def _check_checkpoint(self) -> None:
        missing = [c for c in COMPONENTS if not (self.path / c).is_dir()]
        if missing:
            what = "does not exist" if not self.path.is_dir() else "lacks " + ", ".join(f"{c}/" for c in missing)
            raise CheckpointMissingError(
                f"model {self.spec.name!r}: checkpoint directory {self.path} {what}. "
                f"For the tiny test models run `python manage.py make_tiny_models`; otherwise "
                f"put a diffusers checkpoint there (or fix `path` in the registry)."
            )

    # 1. encode ---------------------------------------------------------------

    @torch.no_grad()
    def encode(self, prompts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        if not prompts:
            return []
        # One text-encoder call for all prompts and negatives: [p0..pn-1, n0..nn-1].
        texts = [p for p, _ in prompts] + [n for _, n in prompts]
        embeds = self._encode_texts(texts).to("cpu")
        n = len(prompts)
        return [{"prompt_embeds": embeds[i:i + 1].clone(), "negative_embeds": embeds[n + i:n + i + 1].clone()}
                for i in range(n)]

    def _encode_texts(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), 77, D] last hidden states, padded/truncated like SD 1.5."""
        tokens = self.tokenizer(texts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                truncation=True, return_tensors="pt")
        # SD 1.5 passes no attention mask (padding tokens are attended to, as in training).
        hidden = self.text_encoder(tokens.input_ids.to(self.device))[0]
        # SDXL hook: run text_encoder_2 as well, concatenate the penultimate hidden
        # states along the feature axis, and return its pooled output too.
        return hidden

    # 2. prepare --------------------------------------------------------------

    def prepare(self, request: GenerationRequest, embeddings: dict[str, Any]) -> DenoiseState:
        cell = self.vae_scale_factor
        if request.width % cell or request.height % cell:
            raise ValueError(f"{self.spec.name}: width and height must be multiples of {cell}, "
                             f"got {request.width}×{request.height}")
        shape = (request.num_outputs, self.latent_channels, request.height // cell, request.width // cell)
        # One CPU generator for the whole batch: output i is the i-th slice of one
        # seeded draw, identical on every device (as diffusers' randn_tensor does
        # with a CPU generator).
        generator = torch.Generator("cpu").manual_seed(request.seed)
        noise = torch.randn(shape, generator=generator, dtype=self.dtype)
        scheduler = self._new_scheduler(request.steps, begin_index=0)
        latents = (noise * scheduler.init_noise_sigma).to(self.device)
        return DenoiseState(request=request, step=0, latents=latents, embeddings=embeddings,
                            scheduler=scheduler, generator=generator)

    def _new_scheduler(self, steps: int, begin_index: int) -> Any:
        scheduler = self.scheduler_class.from_pretrained(self.path / "scheduler", local_files_only=True)
        scheduler.set_timesteps(steps, device=self.device)
        # set_timesteps clears the position; the first scale_model_input/step then
        # takes it from begin_index (public API, unlike assigning _step_index).
        scheduler.set_begin_index(begin_index)
        return scheduler

    # 3. step -----------------------------------------------------------------

    def _cfg(self, request: GenerationRequest) -> bool:
        return request.guidance_scale > 1.0

    def _conditioning(self, state: DenoiseState) -> torch.Tensor:
        """encoder_hidden_states for the UNet batch, on the device (built once per state)."""
        cached = state.extra.get("encoder_hidden_states")
        if cached is not None:
            return cached
        n = state.request.num_outputs
        cond = state.embeddings["prompt_embeds"].to(self.device, self.dtype).expand(n, -1, -1)
        if self._cfg(state.request):
            uncond = state.embeddings["negative_embeds"].to(self.device, self.dtype).expand(n, -1, -1)
            cond = torch.cat([uncond, cond])
        # SDXL hook: also build added_cond_kwargs {"text_embeds", "time_ids"} here.
        state.extra["encoder_hidden_states"] = cond
        return cond

    @torch.no_grad()  # not inference_mode: state.latents outlives the call and may be touched later
    def step(self, state: DenoiseState) -> None:
        if state.done:
            raise ValueError(f"job {state.request.job_id}: all {state.request.steps} steps are done")
        scheduler, request = state.scheduler, state.request
        t = scheduler.timesteps[state.step]
        cfg = self._cfg(request)
        # Classifier-free guidance: [uncond, cond] in one UNet call.
        model_input = torch.cat([state.latents] * 2) if cfg else state.latents
        model_input = scheduler.scale_model_input(model_input, t)
        noise_pred = self.unet(model_input, t, encoder_hidden_states=self._conditioning(state)).sample
        if cfg:
            uncond, cond = noise_pred.chunk(2)
            noise_pred = uncond + request.guidance_scale * (cond - uncond)
        out = scheduler.step(noise_pred, t, state.latents, generator=state.generator)
        state.latents = out.prev_sample
        # Kept for the preview only (a far better picture than the noisy latents);
        # not part of the checkpoint.
        state.extra["denoised"] = out.pred_original_sample
        state.step += 1

    # 4. checkpoint / restore -------------------------------------------------

    def checkpoint(self, state: DenoiseState) -> dict[str, Any]:
        scheduler = state.scheduler
        # Position: the index the next step will use. None until the first
        # scale_model_input, in which case begin_index says where it will start.
        index = scheduler.step_index if scheduler.step_index is not None else scheduler.begin_index
        return {
            "format": CHECKPOINT_FORMAT,
            "model": self.spec.name,
            "step": int(state.step),
            "steps": int(state.request.steps),
            "latents": state.latents.detach().to("cpu", copy=True),
            "scheduler_class": type(scheduler).__name__,
            "scheduler_step_index": int(index),
            "generator_state": state.generator.get_state().clone(),
        }

    def restore(self, request: GenerationRequest, embeddings: dict[str, Any],
                data: dict[str, Any]) -> DenoiseState:
        if data.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"not a {CHECKPOINT_FORMAT} checkpoint (format={data.get('format')!r})")
        if data["steps"] != request.steps:
            raise ValueError(f"checkpoint was made for {data['steps']} steps, the request has {request.steps}")
        scheduler = self._new_scheduler(request.steps, begin_index=int(data["scheduler_step_index"]))
        if type(scheduler).__name__ != data["scheduler_class"]:
            raise ValueError(f"checkpoint used {data['scheduler_class']}, the model now uses "
                             f"{type(scheduler).__name__}")
        generator = torch.Generator("cpu")
        generator.set_state(data["generator_state"])
        latents = data["latents"].to(self.device, self.dtype)
        return DenoiseState(request=request, step=int(data["step"]), latents=latents,
                            embeddings=embeddings, scheduler=scheduler, generator=generator)

    # 5. preview --------------------------------------------------------------

    @torch.no_grad()
    def preview(self, state: DenoiseState) -> Image.Image:
        denoised = state.extra.get("denoised")
        if denoised is None:
            # Before the first step (or right after a restore) only the noisy
            # latents exist; undo the sigma scaling so they stay in range.
            sigma = float(state.scheduler.sigmas[min(state.step, len(state.scheduler.sigmas) - 1)])
            denoised = state.latents / (sigma ** 2 + 1) ** 0.5
        latent = denoised[0].detach().to("cpu", torch.float32)  # [C, h, w], first output
        rgb = torch.einsum("chw,cr->rhw", latent[:4], SD15_LATENT_RGB)
        rgb = ((rgb + 1) / 2).clamp(0, 1)
        image = Image.fromarray((rgb.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
        h, w = latent.shape[-2:]
        scale = max(1, PREVIEW_MAX_SIDE // max(h, w))
        return image.resize((w * scale, h * scale), Image.NEAREST) if scale > 1 else image

    # 6. decode ---------------------------------------------------------------

    @torch.no_grad()
    def decode(self, state: DenoiseState) -> list[Image.Image]:
        latents = state.latents.to(self.device, self.dtype) / self.vae.config.scaling_factor
        pixels = self.vae.decode(latents).sample  # [n, 3, H, W] in [-1, 1]
        pixels = ((pixels / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        arrays = pixels.permute(0, 2, 3, 1).cpu().numpy()
        return [Image.fromarray(array) for array in arrays]  # uint8 [H, W, 3] → RGB

    def memory_bytes(self) -> int:
        modules = (self.text_encoder, self.unet, self.vae)
        return sum(t.numel() * t.element_size()
                   for m in modules for t in [*m.parameters(), *m.buffers()])
