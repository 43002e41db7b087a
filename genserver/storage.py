"""Blob storage for checkpoints, embeddings, previews and outputs, behind one small interface.

Keys are slash-separated relative paths ("checkpoints/<job>/step-00010.pt").
Writes are atomic (temp file + rename in the same directory), so a reader or
a resumed worker never sees half a file. The local filesystem is the default;
any worker that mounts the same directory can resume any job. An object
store fits behind the same five methods.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath


class StorageError(RuntimeError):
    pass


class LocalStorage:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        pure = PurePosixPath(key)
        if pure.is_absolute() or ".." in pure.parts or not key:
            raise StorageError(f"invalid storage key {key!r}")
        return self.root.joinpath(*pure.parts)

    def put(self, key: str, data: bytes) -> str:
        target = self.path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise StorageError(f"could not write {key!r} under {self.root}: {exc.strerror or exc}") from exc
        return key

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            raise StorageError(f"storage key {key!r} does not exist") from None

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete_prefix(self, prefix: str) -> None:
        """Remove everything under `prefix` (a job's checkpoints once it ends)."""
        target = self.path(prefix)
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)


def default_storage() -> LocalStorage:
    from django.conf import settings

    return LocalStorage(settings.STORAGE_DIR)
