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
* tokenizer    transformers' T5Tokenizer over a small vocabulary of its own (tiny_t5.py)
* scheduler    UniPCMultistepScheduler with Wan's flow settings
               (flow_prediction, use_flow_sigmas, flow_shift 3.0)
"""

from __future__ import annotations

from pathlib import Path

from workers.runtime.tiny_t5 import tiny_t5_encoder, tiny_t5_tokenizer

TEXT_HIDDEN = 32  # UMT5 d_model = the transformer's text_dim
LATENT_CHANNELS = 16  # Wan 2.1's z_dim
FLOW_SHIFT = 3.0  # Wan 2.1 uses 3.0 at 480p, 5.0 at 720p

# A few whole words, so the Unigram model prefers real pieces over characters.
WORDS = (
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


def make_tiny_wan(path: Path, seed: int = 0) -> Path:
    """Write a tiny Wan-2.1-style diffusers checkpoint to `path`; deterministic given `seed`.

    About 1 MB, a couple of seconds on a CPU.
    """
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_t5_tokenizer(WORDS)

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
        text_encoder = tiny_t5_encoder(tokenizer, TEXT_HIDDEN, umt5=True, position_buckets=32, max_distance=128)
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
