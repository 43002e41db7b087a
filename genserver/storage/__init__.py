"""Blob storage for checkpoints, embeddings, previews, outputs and segments, behind one small interface.

Keys are slash-separated relative paths ("checkpoints/<job>/step-00010.pt").
Two backends implement the same methods (`Storage` below):

- `LocalStorage`: a directory (the embedded default, `make up`). Writes go to a
  temp file and are renamed into place, so a reader never sees half a file.
- `S3Storage`: an S3-compatible bucket (AWS S3, MinIO, R2, Ceph) shared by every
  node, through plain boto3. One PUT is atomic: an object is absent or whole.

`default_storage()` picks one from GENSERVER_STORAGE and friends, read through
`genserver.config` (no Django), so the Django-free model runtime, the tasks and
the API all reach the same bytes. Errors of both backends are `StorageError`;
a full disk (or a store's quota) says so in the text the job service looks for.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Protocol

from .base import Data, StorageError, StorageKeyMissing, StoredEntry, StoredObject, data_size, joined
from .local import LocalStorage

__all__ = [
    "Data",
    "data_size",
    "joined",
    "Storage",
    "StorageError",
    "StorageKeyMissing",
    "LocalStorage",
    "StoredObject",
    "StoredEntry",
    "default_storage",
    "storage_from_config",
]


class Storage(Protocol):
    """What every backend offers; the model runtime, the tasks and the services use only this."""

    def put(self, key: str, data: Data, durable: bool = True) -> str:
        """Store `data` under `key`, whole or not at all. `durable=False`: readable at once by every process, but
        on the local disk only in the page cache until `sync(key)` (a power loss may lose it before then)."""
        ...

    def sync(self, key: str) -> None:
        """Make what `put(key, durable=False)` stored survive a power loss (at once for an object store)."""
        ...

    def get(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> None: ...

    def open(self, key: str) -> StoredObject: ...

    def list(self, prefix: str) -> Iterator[StoredEntry]: ...

    def touch(self, key: str, when: float) -> None: ...

    def move(self, key: str, to: str) -> None: ...

    def presigned_url(self, key: str, ttl_seconds: int, content_type: str) -> str | None: ...

    def describe(self) -> str: ...


_cache: dict[tuple, Storage] = {}


def storage_from_config() -> Storage:
    """The backend the environment chooses (GENSERVER_STORAGE=local|s3), built once per configuration."""
    from genserver import config

    backend = config.storage_backend()
    if backend == "s3":
        key: tuple = ("s3", config.s3_bucket(), config.s3_prefix(), config.s3_endpoint_url(), os.getpid())
    else:
        key = ("local", str(config.storage_dir()))
    storage = _cache.get(key)
    if storage is None:
        if backend == "s3":
            from .s3 import S3Storage

            storage = S3Storage(bucket=key[1], prefix=key[2], endpoint_url=key[3] or None)
        else:
            storage = LocalStorage(config.storage_dir())
        _cache[key] = storage
    return storage


default_storage = storage_from_config
