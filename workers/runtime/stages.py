"""The three stages as plain functions over storage keys: encode, denoise one chunk, decode.

Tasks call these with a GenerationRequest and keys; these call a family
adapter and storage. Nothing here knows about Django or Celery: the task
passes callbacks for the cancel check, the lease heartbeat and previews.
"""
from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from genserver.storage import LocalStorage

from .base import DenoiseState, Family, GenerationRequest


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def checkpoint_key(job_id: str, step: int) -> str:
    return f"checkpoints/{job_id}/step-{step:05d}.pt"


def embeddings_key(family: Family, prompt: str, negative: str) -> str:
    digest = hashlib.sha256(f"{family.encoder_identity}\0{prompt}\0{negative}".encode()).hexdigest()
    return f"embeddings/{digest}.pt"


@dataclass(frozen=True)
class EncodeResult:
    key: str
    cache_hit: bool


def encode(family: Family, storage: LocalStorage, request: GenerationRequest) -> EncodeResult:
    """Prompt embeddings, from the cache when the same encoder saw the same prompts."""
    key = embeddings_key(family, request.prompt, request.negative_prompt)
    if storage.exists(key):
        return EncodeResult(key, True)
    (embeddings,) = family.encode([(request.prompt, request.negative_prompt)])
    storage.put(key, _to_bytes(embeddings))
    return EncodeResult(key, False)


def load_state(family: Family, storage: LocalStorage, request: GenerationRequest, embeddings_ref: str,
               checkpoint_ref: str) -> DenoiseState:
    embeddings = _from_bytes(storage.get(embeddings_ref))
    if not checkpoint_ref:
        return family.prepare(request, embeddings)
    return family.restore(request, embeddings, _from_bytes(storage.get(checkpoint_ref)))


@dataclass(frozen=True)
class ChunkResult:
    step: int  # steps done after the chunk
    checkpoint_key: str  # where that state was saved ("" if stopped before saving)
    stopped: str  # "" ran to the chunk's end; "cancelled" or "lease-lost" otherwise
    step_seconds: float | None  # mean measured seconds per step in this chunk


def denoise_chunk(family: Family, storage: LocalStorage, request: GenerationRequest, *,
                  embeddings_ref: str, checkpoint_ref: str, until_step: int, preview_every: int,
                  should_stop: Callable[[int], str], on_preview: Callable[[str, int], None]) -> ChunkResult:
    """Restore, run steps up to `until_step`, save an atomic checkpoint.

    `should_stop(step)` is asked before every step and returns "" to go on or
    the reason to stop (it also renews the lease and records progress).
    """
    state = load_state(family, storage, request, embeddings_ref, checkpoint_ref)
    start_step, started = state.step, time.perf_counter()
    while state.step < until_step:
        reason = should_stop(state.step)
        if reason:
            return ChunkResult(state.step, "", reason, None)
        family.step(state)
        if preview_every and state.step % preview_every == 0 and state.step < request.steps:
            key = f"previews/{request.job_id}/preview.png"
            storage.put(key, _png(family.preview(state)))
            on_preview(key, state.step)
    elapsed = time.perf_counter() - started
    key = storage.put(checkpoint_key(request.job_id, state.step), _to_bytes(family.checkpoint(state)))
    steps_run = state.step - start_step
    return ChunkResult(state.step, key, "", elapsed / steps_run if steps_run else None)


def decode(family: Family, storage: LocalStorage, request: GenerationRequest, *, embeddings_ref: str,
           checkpoint_ref: str) -> list[dict[str, str]]:
    """Final outputs saved through storage; returns [{key, content_type}]."""
    state = load_state(family, storage, request, embeddings_ref, checkpoint_ref)
    outputs = []
    for index, image in enumerate(family.decode(state)):
        key = storage.put(f"outputs/{request.job_id}/{index}.png", _png(image))
        outputs.append({"key": key, "content_type": "image/png"})
    return outputs

