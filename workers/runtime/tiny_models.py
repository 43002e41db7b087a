"""Tiny random-weight checkpoints, generated locally, for tests and the CPU demo.

Nothing is downloaded: the weights are random (seeded) and the CLIP tokenizer's
vocab.json / merges.txt are written here (the 256 byte-level symbols, their
end-of-word forms, a few merges). The layout is the ordinary diffusers one
(model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/), so the
same loading code serves a real SD 1.5 checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from transformers import CLIPTokenizer

logger = logging.getLogger(__name__)

MAX_TEXT_TOKENS = 77  # CLIP's context; SD pipelines always pad to it
TEXT_HIDDEN = 32  # = the UNet's cross_attention_dim
BOS, EOS = "<|startoftext|>", "<|endoftext|>"

# A few English merges so the BPE actually merges something; the byte-level
# base symbols alone already cover every possible input.
_MERGES = [
    ("t", "h"), ("th", "e</w>"), ("a", "n"), ("an", "d</w>"), ("i", "n"), ("in", "g</w>"),
    ("o", "n</w>"), ("e", "r"), ("a", "r"), ("o", "r</w>"), ("e", "n"), ("a", "t</w>"),
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from the 256 byte values to printable characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
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


def _tiny_tokenizer(directory: Path) -> CLIPTokenizer:
    """Write vocab.json + merges.txt to `directory` and return the matching CLIPTokenizer.

    The tokenizer's own files (tokenizer.json, tokenizer_config.json) are written
    when the pipeline saves it.
    """
    from transformers import CLIPTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = tiny_clip_vocab()
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return CLIPTokenizer(vocab=vocab, merges=list(_MERGES), model_max_length=MAX_TEXT_TOKENS)


def make_tiny_unet(path: Path, seed: int = 0) -> Path:
    """Write a tiny SD-1.5-style diffusers checkpoint to `path`; deterministic given `seed`.

    UNet: 2 resolutions (32, 64 channels), cross-attention dim 32. VAE: 4 blocks,
    so it downsamples by 8 like SD's (the registry's size_multiple 16 and the cost
    model's geometry assume 8). Text encoder: a 2-layer CLIP of width 32.
    """
    import torch
    from diffusers import (AutoencoderKL, EulerDiscreteScheduler, StableDiffusionPipeline,
                           UNet2DConditionModel)
    from transformers import CLIPTextConfig, CLIPTextModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer(path / "tokenizer")

    # fork_rng: seeding must not leak into the caller's global RNG. Each component is
    # seeded separately, so changing one's shape doesn't change the others' weights.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(32, 64), norm_num_groups=32, cross_attention_dim=TEXT_HIDDEN,
            attention_head_dim=8,
            # SD 1.5's arrangement in miniature: cross-attention at the high resolution,
            # plain ResNets at the lowest (the mid block attends there).
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        )
        torch.manual_seed(seed + 1)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, sample_size=64, layers_per_block=1,
            block_out_channels=(16, 16, 32, 32), norm_num_groups=8,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        )
        torch.manual_seed(seed + 2)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=MAX_TEXT_TOKENS,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ))
    # SD 1.5's scheduler settings.
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", timestep_spacing="leading", steps_offset=1,
    )
    # Saving through the pipeline writes model_index.json too, so the directory
    # also loads with StableDiffusionPipeline.from_pretrained (handy for cross-checks).
    pipeline = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.save_pretrained(path)
    return path


# name → writer; the directory name under models_dir is the registry's path tail.
TINY_MODELS: dict[str, Callable[[Path, int], Path]] = {"tiny-sd": make_tiny_unet}


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
