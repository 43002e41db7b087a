"""What the storage backends share: the error type and the records `open` and `list` return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

# What `put` writes: bytes, or parts written one after another (a checkpoint's header, then each tensor's
# own memory: workers/runtime/blob.py), so a large object never passes through an intermediate buffer.
Data = bytes | bytearray | list[bytes | bytearray | memoryview]


def joined(data: Data) -> bytes | bytearray:
    """`data` as one buffer (a backend that sends one body)."""
    return bytearray().join(data) if isinstance(data, list) else data


def data_size(data: Data) -> int:
    return sum(memoryview(part).nbytes for part in data) if isinstance(data, list) else len(data)


class StorageError(RuntimeError):
    """A key that does not exist, or a write or read the backend refused; the text says which and why."""


class StorageKeyMissing(StorageError):
    """The key does not exist (a read that found nothing, as opposed to one the backend refused)."""


@dataclass(frozen=True)
class StoredObject:
    """An object opened for streaming: read `stream` to the end, then close it."""

    stream: BinaryIO
    size: int


@dataclass(frozen=True)
class StoredEntry:
    """One object found by `list`: its key and when it was last written or touched (epoch seconds)."""

    key: str
    modified: float


def check_key(key: str) -> str:
    """A relative slash-separated key without `..`; raises StorageError naming the bad key."""
    from pathlib import PurePosixPath

    pure = PurePosixPath(key)
    if not key or pure.is_absolute() or ".." in pure.parts or key.startswith("/"):
        raise StorageError(f"invalid storage key {key!r}: use a relative path such as outputs/<job>/0.png")
    return str(pure)
