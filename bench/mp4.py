"""The MP4 writer's determinism and speed, with x264's SIMD level capped at AVX2 and as x264 chooses it.

    .venv/bin/python -m bench.mp4 [--encodes 200] [--timing-rounds 5]

No Django, no Celery. The frames are a tiny-wan clip (9 frames, 64×64, generated
into a temporary directory through the same adapter as the service's) and that
clip tiled to larger sizes. For each size and each setting, side by side in one
process:

    differing   encodes of the same frames, between which freed heap blocks are
                filled with random bytes (a long-lived decode worker's heap holds
                old data), whose bytes differ from the first encode's
    ms          the median time of one encode of the clip (--timing-rounds)

"uncapped" is x264's own choice (AVX-512 on a CPU that has it); "capped" is what
`workers.runtime.video.encode_mp4` does on such a CPU. On a CPU without AVX-512
the two are the same setting.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import av
import numpy as np
import torch
from PIL import Image

from genserver.registry import load_registry
from workers.runtime import video
from workers.runtime.base import GenerationRequest
from workers.runtime.tiny_wan import make_tiny_wan
from workers.runtime.wan import WanFamily

SIZES = [(64, 64), (96, 96), (192, 192), (832, 480)]
SETTINGS = {"uncapped": "", "capped": video.X264_AVX512_CAP}


def tiny_wan_clip() -> list[np.ndarray]:
    with tempfile.TemporaryDirectory(prefix="genserver-bench-mp4-") as tmp:
        make_tiny_wan(Path(tmp) / "models" / "tiny-wan", seed=0)
        family = WanFamily(load_registry().get("tiny-wan"), "cpu", Path(tmp))
        request = GenerationRequest(
            job_id="bench",
            model="tiny-wan",
            prompt="waves in segments",
            negative_prompt="blurry",
            width=64,
            height=64,
            num_frames=9,
            steps=4,
            guidance_scale=5.0,
            seed=5,
            num_outputs=1,
        )
        state = family.prepare(request, family.encode([(request.prompt, request.negative_prompt)])[0])
        while not state.done:
            family.step(state)
        return [np.asarray(frame) for frame in family.decode(state)[0]]


def tiled(clip: list[np.ndarray], width: int, height: int) -> list[Image.Image]:
    reps = (-(-height // clip[0].shape[0]), -(-width // clip[0].shape[1]), 1)
    return [Image.fromarray(np.tile(frame, reps)[:height, :width]) for frame in clip]


def differing_encodes(frames: list[Image.Image], encodes: int) -> int:
    """How many of `encodes` encodes of `frames` give other bytes than the first, in a used heap: before each,
    new blocks of random bytes are allocated and old ones freed, so freed memory holds old data, as in a
    long-lived decode worker (tests/runtime/test_video.py asserts 0)."""
    first = video.encode_mp4(frames)
    draw, garbage, count = random.Random(0), [], 0
    for _ in range(encodes):
        garbage.extend(bytearray(os.urandom(draw.randrange(100, 200_000))) for _ in range(draw.randrange(1, 10)))
        del garbage[: max(0, len(garbage) - 40)]  # freed blocks keep their random bytes for the next encode
        count += video.encode_mp4(frames) != first
    return count


def median_ms(frames: list[Image.Image], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        video.encode_mp4(frames)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encodes", type=int, default=200, help="encodes per size and setting (64×64; fewer above)")
    parser.add_argument("--timing-rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    clip = tiny_wan_clip()
    cpu = "AVX-512: the writer caps x264" if video.x264_params() else "no AVX-512: nothing to cap"
    print(f"CPU: {cpu}; x264 in PyAV {av.__version__}")
    print("| size | encodes | differing uncapped | differing capped | ms uncapped | ms capped | capped / uncapped |")
    print("|---|---|---|---|---|---|---|")
    for width, height in SIZES:
        frames = tiled(clip, width, height)
        # Fewer encodes for the large size: each takes about 100× the 64×64 one.
        encodes = args.encodes if width * height <= 192 * 192 else max(10, args.encodes // 20)
        row = {}
        for name, params in SETTINGS.items():
            with mock.patch.object(video, "x264_params", lambda flags=None, params=params: params):
                row[name] = (differing_encodes(frames, encodes), median_ms(frames, args.timing_rounds))
        ratio = row["capped"][1] / row["uncapped"][1]
        print(
            f"| {width}×{height} | {encodes} | {row['uncapped'][0]} | {row['capped'][0]} | "
            f"{row['uncapped'][1]:.1f} | {row['capped'][1]:.1f} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
