"""What GENSERVER_PNG_COMPRESS_LEVEL trades: encode time against bytes, side by side in one run.

    python -m bench.png_level [--repeat 9]

Encodes, at zlib levels 6 (PIL's default), 3, 1 and 0, the simulated backend's outputs (what `bench.replay`'s
decode worker writes: 512², 512×1024) and two synthetic 1024² pictures standing in for real outputs: smooth
(gradients and soft noise, σ 3: skies, studio shots) and grainy (σ 12: foliage, film grain). Prints the median
encode time and the size at each level, and both as a ratio to level 6.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

LEVELS = (6, 3, 1, 0)


def simulated_output(width: int, height: int) -> Image.Image:
    from genserver.registry import load_registry
    from workers.runtime.base import GenerationRequest
    from workers.runtime.simulated import SimulatedFamily

    spec = load_registry("genserver/registry.toml:bench/seed-registry.toml").get("seed-image")
    family = SimulatedFamily(spec, "cpu", Path(tempfile.mkdtemp()), time_scale=0.0, effective_tflops=450)
    request = GenerationRequest("png", spec.name, "a lighthouse", "", width, height, 1, 2, 5.0, 1, 1)
    state = family.prepare(request, family.encode([(request.prompt, "")])[0])
    while not state.done:
        family.step(state)
    return family.decode(state)[0]


def synthetic(side: int, grain: float) -> Image.Image:
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, side)
    base = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, ramp[::-1]) / 2, np.tile(ramp, (side, 1))], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, grain, base.shape), 0, 255).astype(np.uint8))


def encode(image: Image.Image, level: int, repeat: int) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(repeat):
        buf = io.BytesIO()
        started = time.perf_counter()
        image.save(buf, format="PNG", compress_level=level)
        times.append(time.perf_counter() - started)
        size = buf.tell()
    return statistics.median(times), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()
    pictures = {
        "simulated 512²": simulated_output(512, 512),
        "simulated 512×1024": simulated_output(512, 1024),
        "smooth 1024² (σ 3)": synthetic(1024, 3.0),
        "grainy 1024² (σ 12)": synthetic(1024, 12.0),
    }
    print(f"{'picture':22} level  encode ms (× level 6)   bytes (× level 6)")
    for name, image in pictures.items():
        base_time, base_size = encode(image, 6, args.repeat)
        for level in LEVELS:
            took, size = (base_time, base_size) if level == 6 else encode(image, level, args.repeat)
            print(
                f"{name:22} {level:5}  {took * 1000:8.1f} ({took / base_time:4.2f} ×)"
                f"   {size:9,} ({size / base_size:4.2f} ×)"
            )


if __name__ == "__main__":
    main()
