"""A tiny random-weight Wan-style video checkpoint, generated locally, for tests and the CPU demo.

Nothing is downloaded. The layout is the ordinary diffusers one for Wan 2.1
text-to-video (model_index.json, transformer/, vae/, text_encoder/, tokenizer/,
scheduler/), written by `WanPipeline.save_pretrained`, so the directory loads
both through `workers.runtime.wan.WanFamily` and as a plain diffusers
`WanPipeline.from_pretrained(path, local_files_only=True)`.

The components are Wan 2.1's in miniature:

* transformer  WanTransformer3DModel, patch (1, 2, 2), 2 layers of width 32
* vae          AutoencoderKLWan, z_dim 16 (Wan 2.1's latent channels and their
               mean/std), 8× spatial and 4× temporal downsampling like the real one
* text_encoder UMT5EncoderModel, 2 layers of width 32 (= the transformer's text_dim)
* tokenizer    transformers' T5Tokenizer (a tokenizers Unigram model, as UMT5's)
               built from an in-memory vocabulary written here: the special
               tokens, "▁", the printable ASCII characters, their word-initial
               "▁x" forms and a few common words. Anything else becomes <unk>.
               No SentencePiece model file is needed; tokenizer.json is written
               by save_pretrained and loads with AutoTokenizer.
* scheduler    UniPCMultistepScheduler with Wan's flow settings
               (flow_prediction, use_flow_sigmas, flow_shift 3.0)
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import T5Tokenizer

TEXT_HIDDEN = 32  # UMT5 d_model = the transformer's text_dim
LATENT_CHANNELS = 16  # Wan 2.1's z_dim
FLOW_SHIFT = 3.0  # Wan 2.1 uses 3.0 at 480p, 5.0 at 720p

# A few whole words, so the Unigram model prefers real pieces over characters.
_WORDS = (
    "a",
    "the",
    "and",
    "of",
    "on",
    "in",
    "with",
    "cat",
    "dog",
    "red",
    "blue",
    "photo",
    "video",
    "walking",
    "running",
    "sky",
    "sea",
    "tree",
    "blurry",
    "low",
    "quality",
)


def tiny_t5_vocab() -> list[tuple[str, float]]:
    """(piece, log-probability) in T5's order: <pad>=0, </s>=1, <unk>=2, then the pieces."""
    chars = [c for c in string.printable if not c.isspace()]
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -6.0) for c in chars]
    pieces += [("▁" + c, -5.0) for c in chars]
    pieces += [("▁" + w, -3.0) for w in _WORDS if len(w) > 1]
    return pieces


def _tiny_tokenizer() -> T5Tokenizer:
    from transformers import T5Tokenizer

    # extra_ids=0: no sentinel tokens (they only matter for T5's span-corruption training).
    return T5Tokenizer(vocab=tiny_t5_vocab(), extra_ids=0, model_max_length=512)


def make_tiny_wan(path: Path, seed: int = 0) -> Path:
    """Write a tiny Wan-2.1-style diffusers checkpoint to `path`; deterministic given `seed`.

    About 1 MB, a couple of seconds on a CPU.
    """
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer()

    # fork_rng: seeding must not leak into the caller's global RNG. Each component is
    # seeded separately, so changing one's shape doesn't change the others' weights.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=LATENT_CHANNELS,
            out_channels=LATENT_CHANNELS,
            text_dim=TEXT_HIDDEN,
            freq_dim=64,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=64,
        )
        torch.manual_seed(seed + 1)
        # Three spatial downsamplings (8×), the last two also temporal (4×), as Wan's.
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=LATENT_CHANNELS,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=[False, True, True],
        )
        torch.manual_seed(seed + 2)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer),
                d_model=TEXT_HIDDEN,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=32,
                relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu",
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=tokenizer.pad_token_id,
            )
        )
    # Wan 2.1's scheduler settings.
    scheduler = UniPCMultistepScheduler(
        num_train_timesteps=1000,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=FLOW_SHIFT,
        solver_order=2,
        solver_type="bh2",
        lower_order_final=True,
        final_sigmas_type="zero",
        timestep_spacing="linspace",
    )
    # Saving through the pipeline writes model_index.json too, so the directory
    # also loads with WanPipeline.from_pretrained (handy for cross-checks).
    pipeline = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    pipeline.save_pretrained(path)
    return path
