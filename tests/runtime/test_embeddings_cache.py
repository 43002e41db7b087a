"""A denoise worker's prompt-embeddings cache (workers/runtime/cache.py): a key read once is served from memory,
least recently used out past the byte budget; load_state reads storage only on a miss."""

from __future__ import annotations

import io

import torch

from genserver.storage import keys
from workers.runtime import stages
from workers.runtime.cache import EmbeddingsCache

KIB = 1024


def embeddings(kib: int) -> dict[str, torch.Tensor]:
    return {"prompt_embeds": torch.zeros(kib * KIB // 4, dtype=torch.float32)}


def test_a_key_read_once_is_served_from_memory_and_the_least_recently_used_goes_first():
    cache, reads = EmbeddingsCache(budget_bytes=10 * KIB), []

    def reader(key: str, kib: int):
        return lambda: reads.append(key) or embeddings(kib)

    first = cache.get("a", reader("a", 4))
    assert cache.get("a", reader("a", 4)) is first and reads == ["a"]  # one read; every job shares the dict
    cache.get("b", reader("b", 4))
    cache.get("a", reader("a", 4))  # a is now the most recently used
    cache.get("c", reader("c", 4))  # 12 KiB > 10: b goes
    assert cache.used_bytes() == 8 * KIB
    cache.get("a", reader("a", 4))
    cache.get("b", reader("b", 4))
    assert reads == ["a", "b", "c", "b"] and (cache.hits, cache.misses) == (3, 4)


def test_an_entry_larger_than_the_budget_is_read_every_time():
    cache, reads = EmbeddingsCache(budget_bytes=2 * KIB), []
    for _ in range(2):
        cache.get("big", lambda: reads.append(1) or embeddings(4))
    assert len(reads) == 2 and cache.used_bytes() == 0
    off = EmbeddingsCache(budget_bytes=0)  # GENSERVER_EMBEDDINGS_CACHE_BYTES=0: always from storage
    for _ in range(2):
        off.get("small", lambda: reads.append(1) or embeddings(1))
    assert len(reads) == 4


class CountingStorage:
    def __init__(self, blobs: dict[str, bytes], where: str = "/var/storage") -> None:
        self.blobs, self.reads, self.where = blobs, [], where

    def describe(self) -> str:
        return self.where

    def get(self, key: str) -> bytes:
        self.reads.append(key)
        return self.blobs[key]


class PreparingFamily:
    def prepare(self, request, embeddings):
        return embeddings


def test_load_state_reads_a_prompts_embeddings_from_storage_once(monkeypatch):
    cache = EmbeddingsCache(budget_bytes=10 * KIB)
    monkeypatch.setattr(stages, "embeddings_cache", lambda: cache)
    buffer = io.BytesIO()
    torch.save(embeddings(1), buffer)
    key = keys.embeddings_key(keys.encoder_identity("unet", "tiny-sd"), "a red fox", "")
    storage = CountingStorage({key: buffer.getvalue(), "embeddings/by-hand.pt": buffer.getvalue()})
    first = stages.load_state(PreparingFamily(), storage, None, key, "")
    again = stages.load_state(PreparingFamily(), storage, None, key, "")
    assert again is first and storage.reads == [key]
    assert torch.equal(first["prompt_embeds"], embeddings(1)["prompt_embeds"])
    # A key that does not name its content may be written again with other embeddings: read every time.
    stages.load_state(PreparingFamily(), storage, None, "embeddings/by-hand.pt", "")
    stages.load_state(PreparingFamily(), storage, None, "embeddings/by-hand.pt", "")
    assert storage.reads == [key, "embeddings/by-hand.pt", "embeddings/by-hand.pt"]
    # The same key in another store is another entry.
    elsewhere = CountingStorage({key: buffer.getvalue()}, where="s3://other")
    stages.load_state(PreparingFamily(), elsewhere, None, key, "")
    assert elsewhere.reads == [key]
