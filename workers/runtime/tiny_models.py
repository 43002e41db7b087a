"""Tiny random-weight checkpoints, generated locally, for tests and the CPU demo.

Nothing is downloaded: the weights are random (seeded) and the tokenizers are
built here. The CLIP tokenizer's vocab.json / merges.txt hold the 256 byte-level
symbols, their end-of-word forms and a few merges. FLUX's T5 tokenizer is a real
T5Tokenizer over a small vocabulary written here (tiny_t5.py).

Each checkpoint is saved by its diffusers pipeline (StableDiffusionPipeline,
StableDiffusionXLPipeline, FluxPipeline), so the layout is the ordinary
diffusers one (model_index.json and one folder per component) and the same
loading code serves a real checkpoint; the directory also loads as a normal
diffusers pipeline, which the tests use for cross-checks.

    tiny-sd     SD 1.5 style: CLIP, UNet, 4-channel VAE                    4.4 MB
    tiny-sdxl   SDXL style: two CLIP encoders, `text_time` UNet            4.1 MB
    tiny-flux   FLUX style: CLIP + T5, FluxTransformer2DModel, 16-ch VAE   1.8 MB

Each takes well under a second to write (after the imports).

The three checkpoints share their CLIP tokenizer, text encoder and VAE builders here; tiny-wan is in
tiny_wan.py, and the T5-family encoder and tokenizer FLUX and Wan share in tiny_t5.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from workers.runtime.tiny_t5 import tiny_t5_encoder, tiny_t5_tokenizer
from workers.runtime.tiny_wan import make_tiny_wan

if TYPE_CHECKING:
    from transformers import CLIPTokenizer

logger = logging.getLogger(__name__)

MAX_TEXT_TOKENS = 77  # CLIP's context; SD pipelines always pad to it
TEXT_HIDDEN = 32  # = the UNet's cross_attention_dim
BOS, EOS = "<|startoftext|>", "<|endoftext|>"

# A few English merges so the BPE actually merges something; the byte-level
# base symbols alone already cover every possible input.
_MERGES = [
    ("t", "h"),
    ("th", "e</w>"),
    ("a", "n"),
    ("an", "d</w>"),
    ("i", "n"),
    ("in", "g</w>"),
    ("o", "n</w>"),
    ("e", "r"),
    ("a", "r"),
    ("o", "r</w>"),
    ("e", "n"),
    ("a", "t</w>"),
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from the 256 byte values to printable characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def tiny_clip_vocab() -> tuple[dict[str, int], list[str]]:
    """(vocab, merges) in CLIP's order: bytes, bytes + '</w>', merged tokens, specials."""
    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + [a + b for a, b in _MERGES] + [BOS, EOS]
    vocab = {token: index for index, token in enumerate(tokens)}
    return vocab, [f"{a} {b}" for a, b in _MERGES]


def _tiny_tokenizer(directory: Path, pad_token: str | None = None) -> CLIPTokenizer:
    """Write vocab.json + merges.txt to `directory` and return the matching CLIPTokenizer.

    The tokenizer's own files (tokenizer.json, tokenizer_config.json) are written
    when the pipeline saves it. `pad_token`: SDXL's second tokenizer pads with "!"
    (OpenCLIP's choice); by default CLIP pads with its end-of-text token.
    """
    from transformers import CLIPTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = tiny_clip_vocab()
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    extra = {"pad_token": pad_token} if pad_token else {}
    return CLIPTokenizer(vocab=vocab, merges=list(_MERGES), model_max_length=MAX_TEXT_TOKENS, **extra)


def _tiny_clip_text_encoder(tokenizer: CLIPTokenizer, projection_dim: int | None = None):
    """A 2-layer CLIP text encoder of width 32; with `projection_dim`, the
    CLIPTextModelWithProjection that SDXL uses as its second encoder (pooled, projected output)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=MAX_TEXT_TOKENS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"projection_dim": projection_dim} if projection_dim else {}),
    )
    return CLIPTextModelWithProjection(config) if projection_dim else CLIPTextModel(config)


def _tiny_vae(latent_channels: int = 4, **config):
    """A 4-block AutoencoderKL (downsamples by 8, like SD's and FLUX's) of at most 32 channels."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        sample_size=64,
        layers_per_block=1,
        block_out_channels=(16, 16, 32, 32),
        norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        **config,
    )


def _sd_scheduler():
    """SD 1.5's and SDXL's scheduler settings (the registry's `scheduler` picks the class)."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        timestep_spacing="leading",
        steps_offset=1,
    )


def make_tiny_unet(path: Path, seed: int = 0) -> Path:
    """Write a tiny SD-1.5-style diffusers checkpoint to `path`; deterministic given `seed`.

    UNet: 2 resolutions (32, 64 channels), cross-attention dim 32. VAE: 4 blocks,
    so it downsamples by 8 like SD's (the registry's size_multiple 16 and the cost
    model's geometry assume 8). Text encoder: a 2-layer CLIP of width 32.
    """
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer(path / "tokenizer")

    # fork_rng: seeding must not leak into the caller's global RNG. Each component is
    # seeded separately, so changing one's shape doesn't change the others' weights.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(32, 64),
            norm_num_groups=32,
            cross_attention_dim=TEXT_HIDDEN,
            attention_head_dim=8,
            # SD 1.5's arrangement in miniature: cross-attention at the high resolution,
            # plain ResNets at the lowest (the mid block attends there).
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        )
        torch.manual_seed(seed + 1)
        vae = _tiny_vae()
        torch.manual_seed(seed + 2)
        text_encoder = _tiny_clip_text_encoder(tokenizer)
    # Saving through the pipeline writes model_index.json too, so the directory
    # also loads with StableDiffusionPipeline.from_pretrained (handy for cross-checks).
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=_sd_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(path)
    return path


SDXL_TIME_EMBED_DIM = 8  # addition_time_embed_dim: each of the 6 time ids → 8 features


def make_tiny_sdxl(path: Path, seed: int = 0) -> Path:
    """Write a tiny SDXL-style diffusers checkpoint to `path`; deterministic given `seed`.

    Two CLIP text encoders of width 32 (the second with a 32-wide projection,
    like SDXL's OpenCLIP bigG), whose penultimate hidden states concatenate to
    the UNet's cross-attention width 64. UNet: `addition_embed_type="text_time"`
    with the pooled projection + 6 time ids (original size, crop, target size);
    SDXL's arrangement in miniature: plain ResNets at the high resolution (32
    channels), cross-attention with linear projections at the low one (48, so
    the checkpoint stays under 5 MB). VAE as tiny-sd's, with SDXL's scaling factor.
    """
    import torch
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer(path / "tokenizer")
    tokenizer_2 = _tiny_tokenizer(path / "tokenizer_2", pad_token="!")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(32, 48),
            norm_num_groups=16,
            cross_attention_dim=2 * TEXT_HIDDEN,
            attention_head_dim=(4, 8),
            use_linear_projection=True,
            transformer_layers_per_block=(1, 1),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            addition_embed_type="text_time",
            addition_time_embed_dim=SDXL_TIME_EMBED_DIM,
            projection_class_embeddings_input_dim=6 * SDXL_TIME_EMBED_DIM + TEXT_HIDDEN,
        )
        torch.manual_seed(seed + 1)
        vae = _tiny_vae(scaling_factor=0.13025)
        torch.manual_seed(seed + 2)
        text_encoder = _tiny_clip_text_encoder(tokenizer)
        torch.manual_seed(seed + 3)
        text_encoder_2 = _tiny_clip_text_encoder(tokenizer_2, projection_dim=TEXT_HIDDEN)
    pipeline = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=_sd_scheduler(),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    pipeline.save_pretrained(path)
    return path


T5_HIDDEN = 32  # = the transformer's joint_attention_dim
T5_WORDS = ("the", "a", "an", "and", "of", "in", "on", "with", "photo", "cat", "dog", "red", "fox", "snow")


def make_tiny_flux(path: Path, seed: int = 0) -> Path:
    """Write a tiny FLUX-style diffusers checkpoint to `path`; deterministic given `seed`.

    Transformer: FluxTransformer2DModel with 1 double-stream (MM-DiT) block and
    2 single-stream blocks, 2 heads of 16 (rotary axes 4+6+6), guidance
    embedding (FLUX.1-dev style), packed 2×2 latents of a 16-channel VAE
    (64 input features). Text: CLIP (pooled, width 32) and a 2-layer T5 v1.1
    encoder (gated-GELU, width 32) over 512 tokens. Scheduler:
    FlowMatchEulerDiscreteScheduler with FLUX.1-dev's dynamic shifting.
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer(path / "tokenizer")
    tokenizer_2 = tiny_t5_tokenizer(T5_WORDS)
    latent_channels = 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=latent_channels * 4,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=T5_HIDDEN,
            pooled_projection_dim=TEXT_HIDDEN,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
        torch.manual_seed(seed + 1)
        # FLUX's VAE: 16 channels, a shift as well as a scale, no quant convs.
        vae = _tiny_vae(
            latent_channels, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False
        )
        torch.manual_seed(seed + 2)
        text_encoder = _tiny_clip_text_encoder(tokenizer)
        torch.manual_seed(seed + 3)
        text_encoder_2 = tiny_t5_encoder(tokenizer_2, T5_HIDDEN, umt5=False, position_buckets=8, max_distance=32)
    # FLUX.1-dev's scheduler config.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipeline = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipeline.save_pretrained(path)
    return path


# name → writer; the directory name under models_dir is the registry's path tail.
TINY_MODELS: dict[str, Callable[[Path, int], Path]] = {
    "tiny-sd": make_tiny_unet,
    "tiny-sdxl": make_tiny_sdxl,
    "tiny-flux": make_tiny_flux,
    "tiny-wan": make_tiny_wan,
}


def ensure_tiny_models(models_dir: Path) -> list[Path]:
    """Create each tiny checkpoint under `models_dir` that is missing; return those created.

    Idempotent. Each is written to a temporary sibling and renamed into place,
    so a reader never sees a half-written checkpoint; if another process wins
    the race, its copy is kept and ours discarded.
    """
    models_dir = Path(models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    created: list[Path] = []
    for name, writer in TINY_MODELS.items():
        final = models_dir / name
        if final.exists():
            continue
        tmp = models_dir / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            writer(tmp, 0)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.exists():
                    raise
                logger.info("tiny model %s was created concurrently; keeping that copy", final)
                continue
            created.append(final)
            logger.info("created tiny model %s", final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return created
