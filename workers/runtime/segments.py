"""Long videos: decode one segment into its clip, and assemble the clips into the whole video.

Plain functions over storage keys, like stages.py (no Django, no Celery).
A segment is an ordinary GenerationRequest (its frames, its seed) whose
`job_id` is namespaced (`<job>/segments/<index>`), so its checkpoints and
previews live under the job's own prefixes and never collide across segments.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from genserver.storage import Storage

from .base import Family, GenerationRequest
from .common import png_bytes
from .stages import final_state
from .video import DEFAULT_FPS, encode_mp4, poster


def segment_job_id(job_id: str, index: int) -> str:
    return f"{job_id}/segments/{index:03d}"


def clip_key(job_id: str, index: int) -> str:
    return f"outputs/{job_id}/segments/{index:03d}.mp4"


def _frames_of(result: Any, frames: int) -> list[Image.Image]:
    """The first `frames` frames of a decoded output. A video family yields frames; the simulated
    backend yields one still, which becomes `frames` frames fading slightly (a visibly moving clip)."""
    if isinstance(result, list):
        if len(result) < frames:
            raise ValueError(f"the segment decoded to {len(result)} frames; {frames} were planned")
        return result[:frames]
    still = np.asarray(result.convert("RGB"), dtype=np.float32)
    out = []
    for i in range(frames):
        gain = 0.75 + 0.25 * (i / max(1, frames - 1))
        out.append(Image.fromarray(np.clip(still * gain, 0, 255).astype(np.uint8), "RGB"))
    return out


def decode_segment(
    family: Family,
    storage: Storage,
    request: GenerationRequest,
    *,
    job_id: str,
    index: int,
    frames: int,
    checkpoint_ref: str,
) -> tuple[str, str]:
    """Decode a segment's final latents into its MP4 clip (`frames` frames) and poster; (clip, poster) keys."""
    state = final_state(family, storage, request, checkpoint_ref)
    results = family.decode(state)
    clip = _frames_of(results[0], frames)
    key = storage.put(clip_key(job_id, index), encode_mp4(clip, fps=DEFAULT_FPS))
    poster_key = storage.put(f"outputs/{job_id}/segments/{index:03d}.poster.png", png_bytes(poster(clip)))
    return key, poster_key


def assemble(storage: Storage, job_id: str, clip_keys: list[str]) -> list[dict[str, str]]:
    """The whole video: every segment's frames in order, re-encoded as one MP4, and its poster.

    Streamed clip by clip and frame by frame (a 60 s 720p video would be gigabytes of frames in memory)."""
    import io
    import tempfile
    from pathlib import Path

    import av

    from .video import _even_rgb, add_h264_stream

    first: Image.Image | None = None
    with tempfile.TemporaryDirectory(prefix="genserver-assemble-") as tmp:
        path = Path(tmp) / "video.mp4"
        with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as out:
            stream = None
            for key in clip_keys:
                with av.open(io.BytesIO(storage.get(key)), mode="r") as clip:
                    for frame in clip.decode(video=0):
                        image = frame.to_image()
                        if stream is None:
                            first = image.convert("RGB")
                            width = max(2, image.width + image.width % 2)
                            height = max(2, image.height + image.height % 2)
                            stream = add_h264_stream(out, width, height, DEFAULT_FPS)
                        picture = av.VideoFrame.from_ndarray(
                            _even_rgb(image, stream.width, stream.height), format="rgb24"
                        )
                        out.mux(stream.encode(picture))
            if stream is None:
                raise ValueError(f"job {job_id}: the segments hold no frames")
            out.mux(stream.encode())
        key = storage.put(f"outputs/{job_id}/0.mp4", path.read_bytes())
    poster_key = storage.put(f"outputs/{job_id}/0.poster.png", png_bytes(first))
    return [{"key": key, "content_type": "video/mp4"}, {"key": poster_key, "content_type": "image/png"}]
