"""Video outputs: frames → an H.264 MP4 (and back), and a poster image.

Uses PyAV (`av`, whose wheels bundle FFmpeg with libx264), in memory, no files
and no ffmpeg binary. The MP4 is what browsers play everywhere: H.264 High
profile, yuv420p, `+faststart` (the index up front, so playback starts before
the download ends). yuv420p needs even dimensions: odd ones are padded by
repeating the last row/column, so no picture is lost.
"""

from __future__ import annotations

import functools
import io
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

DEFAULT_FPS = 16  # Wan's native frame rate (81 frames = 5 s)
CRF = 18  # x264 quality: visually lossless for generated content, still small

# x264 chooses its SIMD code from the CPU, and its AVX-512 code reads memory it never wrote: in a process whose heap
# holds old data, the same frames then encode to other bytes (a segment and the lone job of its seed differed in one
# frame by 25 levels). `python -m bench.mp4` (PyAV 18.1's x264, one AVX-512 CPU): of 200 encodes of one tiny-wan clip
# 183 differed at 64×64 and 169 at 192×192 (14 and 40 of 100 in a second run), none capped. Valgrind, whose CPU has
# no AVX-512, finds no such read in x264's AVX2 code. Capped at AVX2 (which every AVX-512 CPU has), x264 writes the
# same bytes for the same frames every time, the same as an AVX2-only machine writes (its bytes follow its SIMD
# level: SSE2 gives its C code's bytes, SSSE3 and later their own), and no slower (0.78-1.00× the uncapped time,
# side by side, in two runs).
X264_AVX512_CAP = "asm=avx2"


def _even_rgb(frame: Image.Image, width: int, height: int) -> np.ndarray:
    """uint8 [height, width, 3], edge-padded from the frame's (possibly odd) size."""
    array = np.asarray(frame.convert("RGB"), dtype=np.uint8)
    pad_h, pad_w = height - array.shape[0], width - array.shape[1]
    if pad_h or pad_w:
        array = np.pad(array, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    return np.ascontiguousarray(array)


def encode_mp4(frames: list[Image.Image], fps: int = DEFAULT_FPS) -> bytes:
    """An H.264/yuv420p MP4 of `frames` at `fps` (all frames the same size; any size ≥ 1×1)."""
    if not frames:
        raise ValueError("encode_mp4 needs at least one frame")
    size = frames[0].size
    if any(frame.size != size for frame in frames):
        raise ValueError(f"all frames must have the same size; the first is {size[0]}×{size[1]}")
    if fps < 1:
        raise ValueError(f"fps must be a positive integer, got {fps}")
    # yuv420p subsamples chroma 2×2, so x264 wants even sides (and at least 2).
    width, height = max(2, size[0] + size[0] % 2), max(2, size[1] + size[1] % 2)

    # A temporary file, not a BytesIO: +faststart rewrites the file (moves the index
    # to the front), which FFmpeg does by reopening the output by name.
    with tempfile.TemporaryDirectory(prefix="genserver-mp4-") as tmp:
        path = Path(tmp) / "video.mp4"
        _write_mp4(path, frames, fps, width, height)
        return path.read_bytes()


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first CPU in a /proc/cpuinfo text (empty where there is no such line)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def _this_cpu_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux: x264 keeps its own choice
        return frozenset()


def x264_params(flags: frozenset[str] | None = None) -> str:
    """The x264-params that keep its output deterministic on a CPU with `flags` (default: this one's)."""
    flags = _this_cpu_flags() if flags is None else flags
    return X264_AVX512_CAP if "avx512f" in flags else ""


def add_h264_stream(container: Any, width: int, height: int, fps: int) -> Any:
    """The H.264 stream of every MP4 written here: the same frames give the same bytes (one thread, no
    wall-clock metadata, x264's SIMD level capped where it is not deterministic)."""
    stream = container.add_stream("libx264", rate=Fraction(int(fps), 1))
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    options = {"crf": str(CRF), "preset": "medium", "threads": "1"}
    if params := x264_params():
        options["x264-params"] = params
    stream.options = options
    stream.codec_context.thread_count = 1
    return stream


def _write_mp4(path: Path, frames: list[Image.Image], fps: int, width: int, height: int) -> None:
    import av

    with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = add_h264_stream(container, width, height, fps)
        for frame in frames:
            picture = av.VideoFrame.from_ndarray(_even_rgb(frame, width, height), format="rgb24")
            container.mux(stream.encode(picture))
        container.mux(stream.encode())  # flush the encoder's delayed frames


def read_mp4(data: bytes) -> list[Image.Image]:
    """Decode an MP4 (as written by encode_mp4) back into RGB frames; for tests and checks."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        return [frame.to_image() for frame in container.decode(video=0)]


def poster(frames: list[Image.Image]) -> Image.Image:
    """The video's still: its first frame (what a player shows before and at the start of playback)."""
    if not frames:
        raise ValueError("poster needs at least one frame")
    return frames[0].convert("RGB")
