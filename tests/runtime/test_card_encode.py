"""A model that encodes on its card (`encode_on_card`): the first chunk's load encodes a prompt whose embeddings are
not stored, stores them under the key the API computed, and denoises exactly what the encode worker's path does."""

from __future__ import annotations

import pytest
import torch

from genserver.storage import LocalStorage, StorageError
from workers.runtime import blob, stages

from .conftest import make_request, run_to_end


def test_a_missing_prompt_is_encoded_stored_and_denoised_as_the_encode_stage_would(family, tmp_path):
    request = make_request(prompt="a card that encodes", negative_prompt="blurry", seed=7, steps=4)
    key = stages.embeddings_key(family, request.prompt, request.negative_prompt)
    on_card, calls = LocalStorage(tmp_path / "card"), []

    def encoder():
        calls.append(1)
        return family

    state = stages.load_state(family, on_card, request, key, "", encoder)
    stages.embeddings_stored()  # written beside the first steps; the chunk's end waits for it
    assert calls == [1] and on_card.exists(key)

    # The encode worker's path on another storage (another entry of the process's embeddings cache): the same
    # bytes stored, the same latents denoised.
    by_worker = LocalStorage(tmp_path / "worker")
    [result] = stages.encode(family, by_worker, [request])
    assert result.key == key and not result.cache_hit
    assert on_card.get(key) == by_worker.get(key)
    reference = stages.load_state(family, by_worker, request, key, "")
    assert torch.equal(run_to_end(family, state), run_to_end(family, reference))


def test_stored_embeddings_are_read_and_the_encoder_is_never_loaded(family, tmp_path):
    request = make_request(prompt="seen before")
    storage = LocalStorage(tmp_path)
    [result] = stages.encode(family, storage, [request])

    def encoder():
        raise AssertionError("a stored prompt must not load the text encoders")

    state = stages.load_state(family, storage, request, result.key, "", encoder)
    stored = blob.loads(storage.get(result.key))
    assert all(torch.equal(state.embeddings[name], stored[name]) for name in stored)


def test_a_key_of_another_encoder_is_refused_with_both_keys(family, tmp_path):
    request = make_request(prompt="renamed model")
    with pytest.raises(ValueError, match="is not this encoder's"):
        stages.load_state(family, LocalStorage(tmp_path), request, "embeddings/other/abc.pt", "", lambda: family)


class RefusingStorage(LocalStorage):
    def put(self, key, data):
        raise StorageError(f"could not write {key!r}: No space left on device")


def test_a_failed_write_is_raised_where_the_chunk_ends_and_only_there(family, tmp_path):
    request = make_request(prompt="nowhere to write")
    key = stages.embeddings_key(family, request.prompt, request.negative_prompt)
    state = stages.load_state(family, RefusingStorage(tmp_path), request, key, "", lambda: family)
    assert state.step == 0  # the first steps need not wait for the write
    with pytest.raises(StorageError, match="No space left on device"):
        stages.embeddings_stored()
    stages.embeddings_stored()  # reported once: the next chunk's end has nothing pending
