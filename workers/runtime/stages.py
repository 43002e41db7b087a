"""The three stages as plain functions over storage keys: encode, denoise one chunk, decode.

Tasks call these with a GenerationRequest and keys; these call a family
adapter and storage. Nothing here knows about Django or Celery: the task
passes callbacks for the cancel check, the lease heartbeat and previews.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from genserver.storage import Storage, StorageKeyMissing, data_size, joined, keys

from . import blob
from .base import DenoiseState, Family, GenerationRequest
from .cache import embeddings_cache
from .common import png_bytes


def checkpoint_key(job_id: str, step: int) -> str:
    return f"checkpoints/{job_id}/step-{step:05d}.pt"


def embeddings_key(family: Family, prompt: str, negative: str) -> str:
    """The cache key of these prompts' embeddings (genserver.storage.keys: the API computes the same one)."""
    return keys.embeddings_key(family.encoder_identity, prompt, negative)


@dataclass(frozen=True)
class EncodeResult:
    key: str
    cache_hit: bool


def encode(family: Family, storage: Storage, requests: list[GenerationRequest]) -> list[EncodeResult]:
    """Prompt embeddings for several requests, from the cache when the same encoder saw the same prompts.

    Every prompt not in the cache is encoded in one batched call (prompts that
    waited together cost one text-encoder pass); duplicates are encoded once.
    """
    keys = [embeddings_key(family, r.prompt, r.negative_prompt) for r in requests]
    missing: dict[str, tuple[str, str]] = {}
    for key, r in zip(keys, requests):
        if key not in missing and not storage.exists(key):
            missing[key] = (r.prompt, r.negative_prompt)
    if missing:
        for key, embeddings in zip(missing, family.encode(list(missing.values()))):
            storage.put(key, blob.dump_parts(embeddings))
    return [EncodeResult(key, key not in missing) for key in keys]


def load_state(
    family: Family,
    storage: Storage,
    request: GenerationRequest,
    embeddings_ref: str,
    checkpoint_ref: str,
    encoder: Callable[[], Family] | None = None,
) -> DenoiseState:
    """The state to denoise (or decode) from: fresh from the request's seed, or restored from `checkpoint_ref`.
    `encoder`: for a model that encodes on its card, the text encoders to call (and how to load them) when the
    embeddings under `embeddings_ref` are not stored yet (`encode_on_card`)."""
    embeddings = _embeddings(storage, embeddings_ref, request, encoder)
    if not checkpoint_ref:
        return family.prepare(request, embeddings)
    return _restored(family, request, embeddings, read_checkpoint(storage, checkpoint_ref))


def final_state(family: Family, storage: Storage, request: GenerationRequest, checkpoint_ref: str) -> DenoiseState:
    """The state a decode turns into pixels: restored from the job's last checkpoint, without its prompt
    embeddings (a VAE needs the latents only; reading them cost a storage read, a Wan prompt's 4 MB, and made
    the decode fail where they were gone)."""
    if not checkpoint_ref:
        raise CheckpointUnreadable(f"job {request.job_id} has no checkpoint to decode: its denoising never saved one")
    return _restored(family, request, {}, read_checkpoint(storage, checkpoint_ref))


def _restored(
    family: Family, request: GenerationRequest, embeddings: dict[str, Any], data: dict[str, Any]
) -> DenoiseState:
    if int(data.get("steps", request.steps)) != request.steps:
        return restore_for_new_total(family, request, embeddings, data)
    return family.restore(request, embeddings, data)


class CheckpointUnreadable(RuntimeError):
    """A recorded checkpoint that is missing or not a whole blob: written without its fsync and lost with the
    machine's power before the sync (`save_chunk_end(synced=False)`), or removed by hand."""


def read_checkpoint(storage: Storage, key: str) -> dict[str, Any]:
    try:
        return blob.loads(storage.get(key))
    except (StorageKeyMissing, blob.BlobError) as exc:
        raise CheckpointUnreadable(f"checkpoint {key!r} cannot be read: {exc}") from exc


def previous_checkpoint(storage: Storage, job_id: str, before: int, not_before: int) -> tuple[int, str] | None:
    """(step, key) of the job's latest readable checkpoint at a step in [not_before, before), None if there is none:
    where a job resumes when the checkpoint recorded at `before` cannot be read. A checkpoint written without its
    fsync is the only one that can be lost so, and the one before it stays until that sync is done."""
    found = []
    for entry in storage.list(f"checkpoints/{job_id}/"):
        name = entry.key.rsplit("/", 1)[-1]
        if name.startswith("step-") and name.endswith(".pt") and name[5:-3].isdigit():
            step = int(name[5:-3])
            if not_before <= step < before:
                found.append((step, entry.key))
    for step, key in sorted(found, reverse=True):
        try:
            read_checkpoint(storage, key)
        except CheckpointUnreadable:
            continue
        return step, key
    return None


def _embeddings(
    storage: Storage, ref: str, request: GenerationRequest, encoder: Callable[[], Family] | None
) -> dict[str, Any]:
    """The prompt embeddings stored under `ref` (encoded and stored first when `encoder` is given and they are
    not); kept in this process's memory when the key names its content."""

    def read() -> dict[str, Any]:
        try:
            return blob.loads(storage.get(ref))
        except StorageKeyMissing:  # one request either way: a stored prompt costs no lookup before its read
            if encoder is None:
                raise
            return encode_on_card(encoder(), storage, request, ref)

    if not keys.names_its_content(ref):
        return read()
    return embeddings_cache().get(f"{storage.describe()} {ref}", read)


def encode_on_card(family: Family, storage: Storage, request: GenerationRequest, ref: str) -> dict[str, Any]:
    """Encode the request's prompts on the denoising card and store them under `ref` (the key the API computed,
    so later jobs of the prompt hit and a resume on another card or the decode reads them); the write runs beside
    the first steps (`embeddings_stored`). Returns them as a reader of `ref` gets them, so the first chunk
    denoises exactly what a resume would."""
    expected = embeddings_key(family, request.prompt, request.negative_prompt)
    if ref != expected:  # the job's key names another encoder (the registry entry changed since the submit)
        raise ValueError(f"job {request.job_id}: its embeddings key {ref!r} is not this encoder's {expected!r}")
    data = blob.dump_parts(family.encode([(request.prompt, request.negative_prompt)])[0])
    _pending_writes.append(_embeddings_writer.submit(storage.put, ref, data))  # beside the first steps
    return blob.loads(joined(data))


# The card's embeddings are written while its first steps run (on an object store a PUT is milliseconds): nothing
# reads them before the chunk's end, which waits for the write before it records the chunk or publishes what reads
# them (`embeddings_stored`). A crash before the write leaves the key missing, and the retried chunk encodes again.
_embeddings_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embeddings-write")
_pending_writes: list[Future[str]] = []


def embeddings_stored() -> None:
    """Wait until the embeddings this process encoded on its card are stored; raises the first write's error. The
    denoise task calls it at every chunk's end, before it records the chunk (after which another worker, the
    decode or a resume elsewhere, may read them)."""
    writes, _pending_writes[:] = list(_pending_writes), []
    for write in writes:
        write.result()


def restore_for_new_total(
    family: Family, request: GenerationRequest, embeddings: dict[str, Any], data: dict[str, Any]
) -> DenoiseState:
    """A checkpoint made for another total (the job's steps changed midway; the only way past the
    families' step-count check). Restored on the schedule it was made for, then:

    * k = its step ≥ the request's total (the job stopped early): returned as it is, unfinished on its
      own schedule, so `decode` decodes its x0 estimate;
    * k < the request's total: continued on a schedule for the new total (`Family.reschedule`).
    """
    made_for = dataclasses.replace(request, steps=int(data["steps"]))
    state = family.restore(made_for, embeddings, data)
    if state.step >= request.steps:
        return state
    return family.reschedule(state, request.steps)


@dataclass(frozen=True)
class ChunkResult:
    step: int  # steps done after the chunk
    checkpoint_key: str  # where that state was saved ("" if stopped before saving, or not saved yet)
    stopped: str  # "" ran to the chunk's end; "cancelled", "lease-lost" or "steps-changed" otherwise
    step_seconds: float | None  # mean measured seconds per step in this chunk
    checkpoint_bytes: int = 0  # the size of the checkpoint written (0 if none)
    checkpoint_seconds: float = 0.0  # how long writing it took (part of the chunk boundary)
    checkpoint_synced: bool = True  # False: written without its fsync, which `Storage.sync` does later
    seconds: float = 0.0  # wall seconds of the chunk's steps for this job (its rows' share of a merged batch)


def run_chunk(
    family: Family,
    storage: Storage,
    state: DenoiseState,
    *,
    until_step: int,
    preview_every: int,
    should_stop: Callable[[int], str],
    on_preview: Callable[[str, int], None],
) -> ChunkResult:
    """Advance `state` in place up to `until_step`, then save an atomic checkpoint.

    `should_stop(step)` is asked before every step and returns "" to go on or
    the reason to stop (it also renews the lease and records progress).
    """
    return run_merged_chunk(
        family,
        storage,
        [state],
        until_step=until_step,
        preview_every=preview_every,
        should_stop=lambda _, step: should_stop(step),
        on_preview=lambda _, key, step: on_preview(key, step),
    )[0]


def run_merged_chunk(
    family: Family,
    storage: Storage,
    states: list[DenoiseState],
    *,
    until_step: int,
    preview_every: int,
    should_stop: Callable[[DenoiseState, int], str],
    on_preview: Callable[[DenoiseState, str, int], None],
    cut_short: Callable[[], bool] | None = None,
    save: bool = True,
) -> list[ChunkResult]:
    """Advance several jobs of one shape together (one batched model call per step), each in place.

    Before every step each job is asked `should_stop(state, step)`; a job that
    stops (cancelled, lease lost) leaves the batch there and the others go on.
    After the chunk's first step, `cut_short()` is asked before each further
    step: True ends the chunk there for the whole batch (a better job waits
    for this card), exactly as if it had been planned that short.
    At the end every job still in the batch saves its own checkpoint (`save`;
    False leaves it to the caller, `save_chunk_end`, who decides once it knows
    whether the card keeps the jobs). Returns one result per state, in order. A merged batch reports no step time: its
    steps are not one job's, and must not teach the cost model.
    """
    results: dict[int, ChunkResult] = {}
    active = list(states)
    start_step, started = states[0].step, time.perf_counter()
    while active and active[0].step < until_step:
        if cut_short is not None and active[0].step > start_step and cut_short():
            break
        for state in list(active):
            reason = should_stop(state, state.step)
            if reason:
                results[id(state)] = ChunkResult(state.step, "", reason, None)
                active.remove(state)
        if not active:
            break
        if len(active) == 1:
            family.step(active[0])
        else:
            family.step_many(active)
        for state in active:
            if preview_every and state.step % preview_every == 0 and state.step < state.request.steps:
                key = f"previews/{state.request.job_id}/preview.png"
                storage.put(key, png_bytes(family.preview(state)))
                on_preview(state, key, state.step)
    elapsed = time.perf_counter() - started
    rows = sum(state.request.num_outputs for state in active) or 1
    for state in active:
        steps_run = state.step - start_step
        solo = len(states) == 1
        result = ChunkResult(
            state.step,
            "",
            "",
            elapsed / steps_run if steps_run and solo else None,
            seconds=elapsed * state.request.num_outputs / rows,
        )
        results[id(state)] = save_chunk_end(family, storage, state, result) if save else result
    return [results[id(state)] for state in states]


def save_chunk_end(
    family: Family, storage: Storage, state: DenoiseState, result: ChunkResult, synced: bool = True
) -> ChunkResult:
    """Save the atomic checkpoint of a chunk that ran to its end: `result` with where, how large, how long.
    `synced=False` leaves its fsync to the caller (`Storage.sync`): the checkpoint is whole for every reader at
    once and survives the worker's crash, not yet a power loss."""
    saving = time.perf_counter()
    data = blob.dump_parts(family.checkpoint(state))
    key = storage.put(checkpoint_key(state.request.job_id, state.step), data, durable=synced)
    return dataclasses.replace(
        result,
        checkpoint_key=key,
        checkpoint_bytes=data_size(data),
        checkpoint_seconds=time.perf_counter() - saving,
        checkpoint_synced=synced,
    )


def save_checkpoint(family: Family, storage: Storage, state: DenoiseState) -> str:
    """An atomic checkpoint of `state` outside a chunk's end (a worker stopping for a change of steps)."""
    return storage.put(checkpoint_key(state.request.job_id, state.step), blob.dump_parts(family.checkpoint(state)))


def decode(
    family: Family, storage: Storage, request: GenerationRequest, *, checkpoint_ref: str
) -> list[dict[str, str]]:
    """Final outputs saved through storage; returns [{key, content_type}].

    An image family yields one PIL image per output (a PNG each); a video
    family yields one list of frames per output (an H.264 MP4 each, followed
    by its poster frame as a PNG).
    """
    state = final_state(family, storage, request, checkpoint_ref)
    outputs = []
    for index, result in enumerate(family.decode(state)):
        if isinstance(result, list):
            from .video import DEFAULT_FPS, encode_mp4, poster

            key = storage.put(f"outputs/{request.job_id}/{index}.mp4", encode_mp4(result, fps=DEFAULT_FPS))
            outputs.append({"key": key, "content_type": "video/mp4"})
            key = storage.put(f"outputs/{request.job_id}/{index}.poster.png", png_bytes(poster(result)))
            outputs.append({"key": key, "content_type": "image/png"})
        else:
            key = storage.put(f"outputs/{request.job_id}/{index}.png", png_bytes(result))
            outputs.append({"key": key, "content_type": "image/png"})
    return outputs
