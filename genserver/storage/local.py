"""The local backend: keys are files under one directory, written by temp file and rename.

Any worker that mounts the same directory can resume any job; across machines
without a shared filesystem use the s3 backend (genserver/storage/s3.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .base import Data, StorageError, StorageKeyMissing, StoredEntry, StoredObject, check_key


class LocalStorage:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def describe(self) -> str:
        return str(self.root)

    def path(self, key: str) -> Path:
        """The file of `key` (this backend only: code that must run on both uses the methods below)."""
        return self.root.joinpath(*check_key(key).split("/"))

    def put(self, key: str, data: Data, durable: bool = True) -> str:
        target = self.path(key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as fh:
                    if isinstance(data, list):
                        fh.writelines(data)  # each part from its own memory
                    else:
                        fh.write(data)
                    fh.flush()
                    if durable:
                        os.fsync(fh.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise StorageError(f"could not write {key!r} under {self.root}: {exc.strerror or exc}") from exc
        return key

    def sync(self, key: str) -> None:
        """The file's bytes, then its name in the directory (the rename), to the disk."""
        target = self.path(key)
        try:
            fd = os.open(target, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            directory = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except FileNotFoundError:
            raise StorageKeyMissing(f"storage key {key!r} does not exist") from None
        except OSError as exc:
            raise StorageError(f"could not sync {key!r} under {self.root}: {exc.strerror or exc}") from exc

    def get(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise StorageKeyMissing(f"storage key {key!r} does not exist") from None
        except OSError as exc:
            raise StorageError(f"could not read {key!r} under {self.root}: {exc.strerror or exc}") from exc

    def open(self, key: str) -> StoredObject:
        """The file opened for reading, for streaming to a client."""
        try:
            stream = open(self.path(key), "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise StorageKeyMissing(f"storage key {key!r} does not exist") from None
        except OSError as exc:
            raise StorageError(f"could not read {key!r} under {self.root}: {exc.strerror or exc}") from exc
        return StoredObject(stream=stream, size=os.fstat(stream.fileno()).st_size)

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        """Remove everything under `prefix` (a job's checkpoints once it ends)."""
        target = self.path(prefix)
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)

    def list(self, prefix: str) -> Iterator[StoredEntry]:
        """Every file under the folder `prefix`, at any depth (temp files of writes in flight left out)."""
        root = self.path(prefix)
        if not root.is_dir():
            return
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                full = Path(dirpath) / name
                try:
                    modified = full.stat().st_mtime
                except OSError:  # deleted while we walked
                    continue
                yield StoredEntry(key=full.relative_to(self.root).as_posix(), modified=modified)

    def touch(self, key: str, when: float) -> None:
        """Mark `key` as used at `when` (retention keeps what was used recently)."""
        try:
            os.utime(self.path(key), (when, when))
        except FileNotFoundError:
            raise StorageKeyMissing(f"storage key {key!r} does not exist") from None

    def move(self, key: str, to: str) -> None:
        """Rename `key` to `to` (atomic here: one rename)."""
        try:
            os.replace(self.path(key), self.path(to))
        except FileNotFoundError:
            raise StorageKeyMissing(f"storage key {key!r} does not exist") from None
        except OSError as exc:
            raise StorageError(f"could not move {key!r} to {to!r} under {self.root}: {exc.strerror or exc}") from exc

    def presigned_url(self, key: str, ttl_seconds: int, content_type: str) -> str | None:
        """None: a directory has no URLs of its own; the API streams the file."""
        return None
