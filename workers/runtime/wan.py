"""The video family (Wan 2.1 text-to-video style): a diffusers checkpoint run one step at a time.

The flow is diffusers' WanPipeline, cut at step boundaries:

    1. encode      T5 tokenizer + UMT5 encoder, prompts and negatives in one batch; each
                   embedding is kept trimmed to its real tokens (zero-padded to 512 later,
                   as WanPipeline does)
    2. prepare     seeded Gaussian latents [n, C, 1 + (F-1)/4, H/8, W/8], scheduler set for `steps`
    3. step        classifier-free guidance (one transformer call on [uncond, cond]) + scheduler.step
    4. checkpoint  latents, step, scheduler position *and multistep history*, generator state
    5. preview     Wan 2.1's 16×3 latent→RGB projection of the middle latent frame, no VAE
    6. decode      latents × std + mean, AutoencoderKLWan decode → per output a list of PIL frames

Video contract: `decode(state)` returns one list of `request.num_frames` PIL frames per
output (`list[list[PIL.Image]]`); `workers.runtime.video.encode_mp4` turns a list into an MP4.

Schedulers (the registry entry's `scheduler`), all with Wan's flow-matching settings
(flow_prediction, flow sigmas, `flow_shift` from the checkpoint's scheduler config):

    unipc       UniPCMultistepScheduler (order 2, bh2), what Wan 2.1 ships with
    dpmpp_2m    DPMSolverMultistepScheduler, dpmsolver++ order 2
    flow_euler  FlowMatchEulerDiscreteScheduler

The multistep solvers keep a history (previous model outputs, their timesteps, the
warm-up counter, the corrector's last sample and order); it is saved in the checkpoint
with the position, so a job resumed in another process continues exactly.

Each stage builds only its own components (components.py): encode the UMT5
encoder, denoise the transformer, decode the VAE. Latents stay float32 (as
WanPipeline keeps them); the transformer runs in the entry's dtype.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from genserver.registry import ModelSpec
from workers.runtime.base import STAGES, DenoiseState, Family, GenerationRequest
from workers.runtime.common import (
    CheckpointMissingError,
    check_checkpoint_dir,
    latent_preview,
    scheduler_attributes,
    to_device,
    to_uint8,
)
from workers.runtime.components import read_config, torch_dtype

__all__ = ["WanFamily", "CheckpointMissingError", "CHECKPOINT_FORMAT", "SCHEDULERS"]

CHECKPOINT_FORMAT = "wan/1"
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
MAX_TEXT_TOKENS = 512  # WanPipeline's max_sequence_length (and the cost model's +512 text tokens)
DEFAULT_FLOW_SHIFT = 3.0  # Wan 2.1 at 480p; a checkpoint's scheduler config normally says

# The scheduler attributes that carry state from one step to the next, beyond the
# position. They have no public setter; they are plain (non-underscore) attributes
# that `set_timesteps` resets, so restore sets them after `set_timesteps`.
#   model_outputs     converted model outputs of the last `solver_order` steps (UniPC, DPM++)
#   timestep_list     their timesteps (UniPC)
#   lower_order_nums  warm-up counter: how many history entries are valid (UniPC, DPM++)
#   last_sample       the sample before the last predictor step; the corrector's input (UniPC)
#   this_order        the order of the last predictor step; the corrector's order (UniPC)
SCHEDULER_HISTORY = ("model_outputs", "timestep_list", "lower_order_nums", "last_sample", "this_order")

# Wan 2.1's latent → RGB projection (ComfyUI's Wan21 latent_rgb_factors), applied to the
# normalized latents the transformer works in. Rows: the 16 latent channels; columns: R, G, B.
WAN21_LATENT_RGB = torch.tensor(
    [
        [-0.1299, -0.1692, 0.2932],
        [0.0671, 0.0406, 0.0442],
        [0.3568, 0.2548, 0.1747],
        [0.0372, 0.2344, 0.1420],
        [0.0313, 0.0189, -0.0328],
        [0.0296, -0.0956, -0.0665],
        [-0.3477, -0.4059, -0.2925],
        [0.0166, 0.1902, 0.1975],
        [-0.0412, 0.0267, -0.1364],
        [-0.1293, 0.0740, 0.1636],
        [0.0680, 0.3019, 0.1128],
        [0.0032, 0.0581, 0.0639],
        [-0.1251, 0.0927, 0.1699],
        [0.0060, -0.0633, 0.0005],
        [0.3477, 0.2275, 0.2950],
        [0.1984, 0.0913, 0.1861],
    ]
)
WAN21_LATENT_RGB_BIAS = torch.tensor([-0.1835, -0.0868, -0.3360])


SCHEDULERS = ("dpmpp_2m", "flow_euler", "unipc")  # the registry's `scheduler` values


def _new_scheduler_of(name: str, config: dict[str, Any]) -> Any:
    """A fresh scheduler of the registry's kind, with Wan's flow settings and the checkpoint's shift."""
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    shift = float(config.get("flow_shift") or config.get("shift") or DEFAULT_FLOW_SHIFT)
    train_steps = int(config.get("num_train_timesteps", 1000))
    if name == "unipc":
        # The checkpoint's own config (Wan ships UniPC), with the flow settings enforced.
        return UniPCMultistepScheduler.from_config(
            config, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift
        )
    if name == "dpmpp_2m":
        return DPMSolverMultistepScheduler(
            num_train_timesteps=train_steps,
            prediction_type="flow_prediction",
            use_flow_sigmas=True,
            flow_shift=shift,
            algorithm_type="dpmsolver++",
            solver_order=2,
            lower_order_final=True,
            final_sigmas_type="zero",
        )
    if name == "flow_euler":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=train_steps, shift=shift)
    raise ValueError(f"wan family: unknown scheduler {name!r}; known: {sorted(SCHEDULERS)}")


class WanFamily(Family):
    """A Wan-2.1-style text-to-video model: UMT5 encoder, WanTransformer3DModel, AutoencoderKLWan.

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
        check_checkpoint_dir(
            spec, self.path, tuple(c for c in COMPONENTS if weights == "checkpoint" or "tokenizer" not in c)
        )
        if spec.scheduler not in SCHEDULERS:  # fail before loading weights
            raise ValueError(f"wan family: unknown scheduler {spec.scheduler!r}; known: {sorted(SCHEDULERS)}")
        self.dtype = torch_dtype(spec, device)
        # Shapes and settings from the configs (no weights): every stage knows them.
        # The checkpoint's scheduler settings (flow_shift, ...), whatever class it names.
        self.scheduler_config = read_config(self.path, "scheduler")
        vae_config, self.transformer_config = read_config(self.path, "vae"), read_config(self.path, "transformer")
        self.vae_scale_spatial = int(vae_config["scale_factor_spatial"])
        self.vae_scale_temporal = int(vae_config["scale_factor_temporal"])
        self.patch = tuple(self.transformer_config["patch_size"])  # (t, h, w)
        self.latent_channels = int(self.transformer_config["in_channels"])
        z = int(vae_config["z_dim"])
        self.latents_mean = torch.tensor(vae_config["latents_mean"], dtype=torch.float32).view(1, z, 1, 1, 1)
        self.latents_std = torch.tensor(vae_config["latents_std"], dtype=torch.float32).view(1, z, 1, 1, 1)
        self._step_takes_generator: dict[type, bool] = {}
        components = self.load_components(weights)
        self.tokenizer, self.text_encoder = components.get("tokenizer"), components.get("text_encoder")
        self.transformer, self.vae = components.get("transformer"), components.get("vae")

    def blank_embeddings(self) -> dict[str, Any]:
        """Zero embeddings of the real shapes (the compile warm-up; benchmarks without tokenizers)."""
        embeds = torch.zeros(1, MAX_TEXT_TOKENS, self.transformer_config["text_dim"])
        return {"prompt_embeds": embeds, "negative_embeds": embeds}

    # 1. encode ---------------------------------------------------------------

    @torch.no_grad()
    def encode(self, prompts: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Per pair {"prompt_embeds": [1, L, D], "negative_embeds": [1, L', D]} trimmed to the real tokens."""
        if not prompts:
            return []
        # One text-encoder call for all prompts and negatives: [p0..pn-1, n0..nn-1].
        texts = [p for p, _ in prompts] + [n for _, n in prompts]
        embeds = self._encode_texts(texts)
        n = len(prompts)
        return [{"prompt_embeds": embeds[i], "negative_embeds": embeds[n + i]} for i in range(n)]

    def _encode_texts(self, texts: list[str]) -> list[torch.Tensor]:
        """WanPipeline._get_t5_prompt_embeds, less the padding: one [1, L_i, D] CPU tensor per text."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokens = self.component("tokenizer")(
            [prompt_clean(t) for t in texts],
            padding="max_length",
            max_length=MAX_TEXT_TOKENS,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask
        device = self.encode_device
        hidden = self.text_encoder(tokens.input_ids.to(device), mask.to(device)).last_hidden_state
        hidden = hidden.to("cpu", torch.float32)
        lengths = mask.gt(0).sum(dim=1).tolist()
        # Kept trimmed (a real UMT5-XXL embedding padded to 512 is 8 MB); _conditioning
        # zero-pads to MAX_TEXT_TOKENS exactly as the pipeline does.
        return [hidden[i : i + 1, :length].clone() for i, length in enumerate(lengths)]

    # 2. prepare --------------------------------------------------------------

    def latent_shape(self, request: GenerationRequest) -> tuple[int, int, int, int, int]:
        cell = self.vae_scale_spatial * max(self.patch[1], self.patch[2])
        if request.width % cell or request.height % cell:
            raise ValueError(
                f"{self.spec.name}: width and height must be multiples of {cell}, got {request.width}×{request.height}"
            )
        step = self.vae_scale_temporal
        if request.num_frames < 1 or (request.num_frames - 1) % step:
            raise ValueError(f"{self.spec.name}: num_frames must be 1 + a multiple of {step}, got {request.num_frames}")
        latent_frames = (request.num_frames - 1) // step + 1
        return (
            request.num_outputs,
            self.latent_channels,
            latent_frames,
            request.height // self.vae_scale_spatial,
            request.width // self.vae_scale_spatial,
        )

    def prepare(self, request: GenerationRequest, embeddings: dict[str, Any]) -> DenoiseState:
        shape = self.latent_shape(request)
        # One CPU generator for the whole batch: output i is the i-th slice of one
        # seeded draw, identical on every device (as diffusers' randn_tensor does
        # with a CPU generator). Flow matching starts from unit noise: no sigma scaling.
        generator = torch.Generator("cpu").manual_seed(request.seed)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        scheduler = self._new_scheduler(request.steps, begin_index=0)
        return DenoiseState(
            request=request,
            step=0,
            latents=noise.to(self.device),
            embeddings=embeddings,
            scheduler=scheduler,
            generator=generator,
        )

    def _new_scheduler(self, steps: int, begin_index: int) -> Any:
        scheduler = _new_scheduler_of(self.spec.scheduler, self.scheduler_config)
        scheduler.set_timesteps(steps, device=self.device)
        # set_timesteps clears the position; the first step then takes it from
        # begin_index (public API, unlike assigning _step_index).
        scheduler.set_begin_index(begin_index)
        return scheduler

    # 3. step -----------------------------------------------------------------

    def _cfg(self, request: GenerationRequest) -> bool:
        return request.guidance_scale > 1.0

    def _padded(self, embeds: torch.Tensor) -> torch.Tensor:
        """[1, L, D] → [1, 512, D], zeros after the real tokens (WanPipeline's layout)."""
        embeds = embeds[:, :MAX_TEXT_TOKENS]
        pad = embeds.new_zeros(1, MAX_TEXT_TOKENS - embeds.shape[1], embeds.shape[2])
        return torch.cat([embeds, pad], dim=1)

    def _conditioning(self, state: DenoiseState) -> torch.Tensor:
        """encoder_hidden_states for the transformer batch, on the device (built once per state)."""
        cached = state.extra.get("encoder_hidden_states")
        if cached is not None:
            return cached
        n = state.request.num_outputs
        cond = self._padded(state.embeddings["prompt_embeds"]).to(self.device, self.dtype).expand(n, -1, -1)
        if self._cfg(state.request):
            uncond = self._padded(state.embeddings["negative_embeds"]).to(self.device, self.dtype)
            cond = torch.cat([uncond.expand(n, -1, -1), cond])
        state.extra["encoder_hidden_states"] = cond
        return cond

    def _step_kwargs(self, scheduler: Any, generator: torch.Generator) -> dict[str, Any]:
        """Pass the job's generator to schedulers whose step draws noise (SDE variants)."""
        cls = type(scheduler)
        if cls not in self._step_takes_generator:
            self._step_takes_generator[cls] = "generator" in inspect.signature(scheduler.step).parameters
        return {"generator": generator} if self._step_takes_generator[cls] else {}

    def step(self, state: DenoiseState) -> None:
        self.step_many([state])

    @torch.no_grad()  # not inference_mode: state.latents outlives the call and may be touched later
    def step_many(self, states: list[DenoiseState]) -> None:
        """One transformer call for every job's rows ([uncond of all, cond of all] with CFG), then each
        job's own guidance and scheduler step."""
        self.check_mergeable(states)
        cfg = self._cfg(states[0].request)
        rows = self.rows(states)
        model_input = torch.cat([state.latents for state in states])
        timestep = torch.cat([state.scheduler.timesteps[state.step].expand(state.latents.shape[0]) for state in states])
        if cfg:  # Classifier-free guidance: [uncond, cond] in one transformer call.
            model_input, timestep = torch.cat([model_input] * 2), torch.cat([timestep] * 2)
        velocity = self.component("transformer")(
            hidden_states=model_input.to(self.dtype),
            timestep=timestep,
            encoder_hidden_states=self.guidance_batch([self._conditioning(state) for state in states], cfg),
            return_dict=False,
        )[0]
        halves = [part.split(rows) for part in velocity.chunk(2)] if cfg else [velocity.split(rows)]
        for i, state in enumerate(states):
            scheduler, request = state.scheduler, state.request
            v = halves[0][i] + request.guidance_scale * (halves[1][i] - halves[0][i]) if cfg else halves[0][i]
            t = scheduler.timesteps[state.step]
            # For the preview only (not part of the checkpoint): the clean-video estimate
            # x0 = x_t - sigma·v of flow matching, a far better picture than x_t.
            sigma = float(scheduler.sigmas[state.step])
            state.extra["denoised"] = state.latents - sigma * v
            state.latents = scheduler.step(
                v, t, state.latents, return_dict=False, **self._step_kwargs(scheduler, state.generator)
            )[0]
            state.step += 1

    # 4. checkpoint / restore -------------------------------------------------

    def checkpoint(self, state: DenoiseState) -> dict[str, Any]:
        history = scheduler_attributes(state.scheduler, SCHEDULER_HISTORY)
        return self.checkpoint_fields(state, CHECKPOINT_FORMAT) | {"scheduler_history": history}

    def restore(self, request: GenerationRequest, embeddings: dict[str, Any], data: dict[str, Any]) -> DenoiseState:
        self.check_checkpoint_fields(data, request, (CHECKPOINT_FORMAT,))
        scheduler = self._new_scheduler(request.steps, begin_index=int(data["scheduler_step_index"]))
        if type(scheduler).__name__ != data["scheduler_class"]:
            raise ValueError(
                f"checkpoint used {data['scheduler_class']}, the model now uses {type(scheduler).__name__}"
            )
        # After set_timesteps (which resets the history): put the saved history back.
        for name, value in data["scheduler_history"].items():
            setattr(scheduler, name, to_device(value, self.device))
        generator = torch.Generator("cpu")
        generator.set_state(data["generator_state"])
        latents = data["latents"].to(self.device, torch.float32)
        state = DenoiseState(
            request=request,
            step=int(data["step"]),
            latents=latents,
            embeddings=embeddings,
            scheduler=scheduler,
            generator=generator,
        )
        if data.get("denoised") is not None:  # older checkpoints have no x0 estimate
            state.extra["denoised"] = data["denoised"].to(self.device, torch.float32)
        return state

    @torch.no_grad()
    def reschedule(self, state: DenoiseState, new_steps: int) -> DenoiseState:
        """Continue on a fresh schedule for `new_steps` (see reschedule.py; multistep history reset)."""
        from workers.runtime.reschedule import continue_state

        return continue_state(state, new_steps, self._new_scheduler(new_steps, begin_index=state.step))

    # 5. preview --------------------------------------------------------------

    @torch.no_grad()
    def preview(self, state: DenoiseState) -> Image.Image:
        """The middle latent frame of the first output through Wan 2.1's latent→RGB projection."""
        latents = state.extra.get("denoised")
        if latents is None:
            # Before the first step (or right after a restore) only x_t exists; flow
            # latents are a (1-σ)·x0 + σ·noise mix, already in range.
            latents = state.latents
        frames = latents.shape[2]
        return latent_preview(latents[0, :, frames // 2], WAN21_LATENT_RGB, WAN21_LATENT_RGB_BIAS)  # [C, h, w]

    # 6. decode ---------------------------------------------------------------

    @torch.no_grad()
    def decode(self, state: DenoiseState) -> list[list[Image.Image]]:
        """Per output, its `num_frames` RGB frames (width × height): Family.decode's video form."""
        vae = self.component("vae")
        videos = []
        mean, std = self.latents_mean.to(self.device), self.latents_std.to(self.device)
        # One output at a time: a video decode is the memory peak of the whole job.
        self.set_vae_tiling(vae, state.request.width, state.request.height)
        for latent in self.final_latents(state).to(self.device, torch.float32).split(1):
            pixels = vae.decode((latent * std + mean).to(vae.dtype), return_dict=False)[0]  # [1, 3, F, H, W]
            frames = to_uint8(pixels)[0]  # [F, H, W, 3]
            videos.append([Image.fromarray(frame) for frame in frames])
        return videos
