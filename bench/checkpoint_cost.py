"""Where a chunk boundary's checkpoint time goes, part by part, at a real video's size.

    python -m bench.checkpoint_cost [--device cuda] [--shape 832x480x81] [--repeat 7] [--dir DIR]

A Wan checkpoint holds five latent-sized float32 tensors (the latents, the last x0 estimate, UniPC's two
model outputs and its last sample): 42 MB at 832×480×81. `bench.gpu_bench` measured its save at 93-114 ms
and its restore at 48-60 ms on an H200, against the target of save + restore ≤ 2 % of a step. This prints
the median of each part of the path the workers run (workers/runtime/stages.py, genserver/storage/local.py):

    save     snapshot (card → host copies) · serialise (torch.save to bytes) · write · fsync · rename
    restore  read · deserialise (torch.load) · host → card copies

for the path before this stop (pageable copies, torch.save / torch.load) and now (page-locked copies,
workers/runtime/blob.py: the parts written from the tensors' own memory), alternating round by round.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from genserver.storage import Data, data_size
from workers.runtime import blob
from workers.runtime.common import to_cpu, to_device

LATENT_CHANNELS, TEMPORAL, SPATIAL = 16, 4, 8  # Wan 2.1's VAE: 16 channels, 4× in time, 8× in space


def latent_shape(width: int, height: int, frames: int) -> tuple[int, ...]:
    return (1, LATENT_CHANNELS, (frames - 1) // TEMPORAL + 1, height // SPATIAL, width // SPATIAL)


def wan_state(shape: tuple[int, ...], device: str) -> dict[str, Any]:
    """The tensors a Wan state holds on the card at a chunk boundary (workers/runtime/wan.py)."""
    tensor = lambda: torch.randn(shape, device=device, dtype=torch.float32)  # noqa: E731
    return {
        "latents": tensor(),
        "denoised": tensor(),
        "model_outputs": [tensor(), tensor()],
        "last_sample": tensor(),
        "timestep_list": [torch.tensor(999, device=device), torch.tensor(990, device=device)],
    }


def snapshot_before(state: dict[str, Any]) -> dict[str, Any]:
    """Family.checkpoint's copies before: pageable CPU copies (`.to("cpu", copy=True)`)."""
    return {
        k: ([t.detach().to("cpu", copy=True) for t in v] if isinstance(v, list) else v.detach().to("cpu", copy=True))
        for k, v in state.items()
    }


def snapshot_now(state: dict[str, Any]) -> dict[str, Any]:
    """Family.checkpoint's copies now (workers.runtime.common.to_cpu: page-locked from a card)."""
    return {k: to_cpu(v) for k, v in state.items()}


def torch_save(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def torch_load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(work: Callable[[], Any], device: str) -> tuple[Any, float]:
    sync(device)
    started = time.perf_counter()
    result = work()
    sync(device)
    return result, time.perf_counter() - started


def write_parts(folder: Path, name: str, data: Data) -> dict[str, float]:
    """LocalStorage.put's steps, each timed: temp file and write, fsync, rename (to a new name, as each
    checkpoint's key is)."""
    parts: dict[str, float] = {}
    started = time.perf_counter()
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    with os.fdopen(fd, "wb") as fh:
        fh.writelines(data) if isinstance(data, list) else fh.write(data)
        fh.flush()
        parts["write"] = time.perf_counter() - started
        started = time.perf_counter()
        os.fsync(fh.fileno())
        parts["fsync"] = time.perf_counter() - started
    started = time.perf_counter()
    os.replace(tmp, folder / name)
    parts["rename"] = time.perf_counter() - started
    return parts


PATHS = {  # name → (snapshot, serialise, deserialise)
    "before": (snapshot_before, torch_save, torch_load),
    "now": (snapshot_now, blob.dump_parts, blob.loads),  # the parts, as stages hands them to Storage.put
}


def measure(device: str, shape: tuple[int, ...], repeat: int, folder: Path) -> dict[str, dict[str, list[float]]]:
    """{path: {part: seconds of each round}}, the two paths alternating round by round."""
    state = wan_state(shape, device)
    rows: dict[str, dict[str, list[float]]] = {path: {} for path in PATHS}
    for round_ in range(repeat + 1):  # the first round warms the allocators and the page cache: dropped
        for path, (take, save, load) in PATHS.items():
            add = lambda part, seconds: rows[path].setdefault(part, []).append(seconds)  # noqa: B023, E731
            cpu, seconds = timed(lambda: take(state), device)  # noqa: B023
            add("save: snapshot (card → host)", seconds)
            data, seconds = timed(lambda: save(cpu), device)  # noqa: B023
            add("save: serialise", seconds)
            name = f"{path}-{round_}.pt"
            for part, seconds in write_parts(folder, name, data).items():
                add(f"save: {part}", seconds)
            raw, seconds = timed((folder / name).read_bytes, device)
            add("restore: read", seconds)
            loaded, seconds = timed(lambda: load(raw), device)  # noqa: B023
            add("restore: deserialise", seconds)
            _, seconds = timed(lambda: {k: to_device(v, device) for k, v in loaded.items()}, device)  # noqa: B023
            add("restore: host → card", seconds)
    return {path: {part: values[1:] for part, values in parts.items()} for path, parts in rows.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="832x480x81", help="WIDTHxHEIGHTxFRAMES of the video")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--dir", default="", help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    width, height, frames = (int(v) for v in args.shape.split("x"))
    shape = latent_shape(width, height, frames)
    with tempfile.TemporaryDirectory(prefix="genserver-ckpt-", dir=args.dir or None) as tmp:
        rows = measure(args.device, shape, args.repeat, Path(tmp))
        sizes = {path: data_size(PATHS[path][1](PATHS[path][0](wan_state(shape, args.device)))) for path in PATHS}
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(
        f"# bench.checkpoint_cost on {name}: Wan state at {args.shape} (latents {shape}); "
        f"before (torch.save) {sizes['before'] / 1e6:.1f} MB, now (blob) {sizes['now'] / 1e6:.1f} MB; "
        f"median of {args.repeat} rounds, the two paths alternating"
    )
    print("| part | before ms | now ms |\n|---|---|---|")
    totals = {path: {"save": 0.0, "restore": 0.0} for path in PATHS}
    for part in rows["before"]:
        medians = {path: statistics.median(rows[path][part]) for path in PATHS}
        for path in PATHS:
            totals[path][part.split(":")[0]] += medians[path]
        print(f"| {part} | {medians['before'] * 1e3:.1f} | {medians['now'] * 1e3:.1f} |")
    for side in ("save", "restore"):
        print(f"| **{side}, sum** | {totals['before'][side] * 1e3:.1f} | {totals['now'][side] * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
