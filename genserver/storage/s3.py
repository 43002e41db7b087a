"""The s3 backend: keys are objects in an S3-compatible bucket (AWS S3, MinIO, R2, Ceph), through plain boto3.

One PUT is atomic: a reader sees no object or the whole object, never half
of one, so this backend needs no temp-and-rename. Credentials and region come
the usual boto3 way (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
AWS_DEFAULT_REGION / AWS_REGION, AWS_PROFILE, instance roles). Errors become
StorageError; what each S3 error code means for a job is in `_storage_error`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from typing import Any

from .base import Data, StorageError, StorageKeyMissing, StoredEntry, StoredObject, check_key, joined

_MISSING = ("NoSuchKey", "404", "NotFound")
# A store that is out of space or over its quota: no retry helps until someone frees space, so the
# message carries the text of ENOSPC / EDQUOT, which the job service reads as "storage full".
_FULL = {
    "XMinioStorageFull": errno.ENOSPC,
    "StorageFull": errno.ENOSPC,
    "QuotaExceeded": errno.EDQUOT,
    "XMinioAdminBucketQuotaExceeded": errno.EDQUOT,
}
_CREDENTIALS = (
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
)
_DELETE_BATCH = 1000  # the most keys one DeleteObjects call takes


class S3Storage:
    def __init__(
        self, bucket: str, prefix: str = "", endpoint_url: str | None = None, client: Any | None = None
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.client = client or _make_client(endpoint_url)

    def describe(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{where} at {self.endpoint_url}" if self.endpoint_url else where

    def _object(self, key: str) -> str:
        key = check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _key_of(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    def put(self, key: str, data: Data, durable: bool = True) -> str:
        try:  # a PUT that returned is stored: `durable` asks nothing more of it
            self.client.put_object(Bucket=self.bucket, Key=self._object(key), Body=joined(data))
        except Exception as exc:
            raise self._storage_error(exc, "write", key) from exc
        return key

    def sync(self, key: str) -> None:
        """Nothing to do: the PUT was durable when it returned."""

    def get(self, key: str) -> bytes:
        stored = self.open(key)
        try:
            return stored.stream.read()
        except Exception as exc:
            raise self._storage_error(exc, "read", key) from exc
        finally:
            stored.stream.close()

    def open(self, key: str) -> StoredObject:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._object(key))
        except Exception as exc:
            raise self._storage_error(exc, "read", key) from exc
        return StoredObject(stream=answer["Body"], size=int(answer["ContentLength"]))

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._object(key))
        except Exception as exc:
            if _code(exc) in _MISSING:
                return False
            raise self._storage_error(exc, "look up", key) from exc
        return True

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._object(key))
        except Exception as exc:
            raise self._storage_error(exc, "delete", key) from exc

    def delete_prefix(self, prefix: str) -> None:
        """Remove the object `prefix` and everything under `prefix/` (a job's checkpoints once it ends)."""
        names = [self._object(prefix)] + [self._object(e.key) for e in self.list(prefix)]
        try:
            for start in range(0, len(names), _DELETE_BATCH):
                batch = [{"Key": name} for name in names[start : start + _DELETE_BATCH]]
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        except Exception as exc:
            raise self._storage_error(exc, "delete", prefix) from exc

    def list(self, prefix: str) -> Iterator[StoredEntry]:
        """Every object under `prefix/`, at any depth, with its LastModified."""
        folder = self._object(prefix) + "/"
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=folder)
            for page in pages:
                for item in page.get("Contents", []):
                    yield StoredEntry(key=self._key_of(item["Key"]), modified=item["LastModified"].timestamp())
        except Exception as exc:
            raise self._storage_error(exc, "list", prefix) from exc

    def touch(self, key: str, when: float) -> None:
        """Mark `key` as used now: a copy onto itself renews its LastModified (the store's clock, not
        `when`, which is kept in the object's metadata for people reading the bucket)."""
        name = self._object(key)
        try:
            self.client.copy_object(
                Bucket=self.bucket,
                Key=name,
                CopySource={"Bucket": self.bucket, "Key": name},
                Metadata={"genserver-used-at": f"{when:.0f}"},
                MetadataDirective="REPLACE",
            )
        except Exception as exc:
            raise self._storage_error(exc, "touch", key) from exc

    def move(self, key: str, to: str) -> None:
        """Copy `key` to `to`, then delete `key` (S3 has no rename: both exist for a moment)."""
        try:
            self.client.copy_object(
                Bucket=self.bucket, Key=self._object(to), CopySource={"Bucket": self.bucket, "Key": self._object(key)}
            )
            self.client.delete_object(Bucket=self.bucket, Key=self._object(key))
        except Exception as exc:
            raise self._storage_error(exc, "move", key) from exc

    def presigned_url(self, key: str, ttl_seconds: int, content_type: str) -> str | None:
        """A GET URL for `key` valid `ttl_seconds`, signed locally (no request to the store)."""
        try:
            return self.client.generate_presigned_url(
                "get_object",
                ExpiresIn=ttl_seconds,
                Params={"Bucket": self.bucket, "Key": self._object(key), "ResponseContentType": content_type},
            )
        except Exception as exc:
            raise self._storage_error(exc, "sign", key) from exc

    def _storage_error(self, exc: Exception, action: str, key: str) -> StorageError:
        """What an S3 failure means, in words that say what to change.

        - NoSuchKey / 404: the key does not exist (a resumed job then fails its attempt, as on disk).
        - XMinioStorageFull, QuotaExceeded: the text of ENOSPC / EDQUOT, so the job fails at once as
          "storage full" (S3 itself never fills up; MinIO and quota'd stores do).
        - NoSuchBucket, AccessDenied and other credential errors: configuration; every retry fails too.
        - Connection errors, timeouts, 5xx and SlowDown (after boto3's own retries): transient; the
          job's attempt fails and is retried from its last checkpoint.
        """
        code = _code(exc)
        where = self.describe()
        if code in _MISSING:
            return StorageKeyMissing(f"storage key {key!r} does not exist")
        if code in _FULL:
            return StorageError(f"could not {action} {key!r} in {where}: {code}: {os.strerror(_FULL[code])}")
        if code == "NoSuchBucket":
            return StorageError(
                f"could not {action} {key!r}: bucket {self.bucket!r} does not exist at "
                f"{self.endpoint_url or 'AWS'}; create it or set GENSERVER_S3_BUCKET"
            )
        if code in _CREDENTIALS:
            return StorageError(
                f"could not {action} {key!r} in {where}: {code}; check AWS_ACCESS_KEY_ID, "
                f"AWS_SECRET_ACCESS_KEY (or the instance role) and the bucket's policy"
            )
        return StorageError(f"could not {action} {key!r} in {where}: {code or type(exc).__name__}: {exc}")


def _code(exc: Exception) -> str:
    """The S3 error code of a botocore ClientError ("" for anything else)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _make_client(endpoint_url: str | None) -> Any:
    """A boto3 S3 client; region and credentials from the usual AWS_* variables and files."""
    import boto3
    from botocore.config import Config

    options: dict[str, Any] = {"signature_version": "s3v4", "retries": {"mode": "standard", "max_attempts": 5}}
    if endpoint_url:  # MinIO and most self-hosted stores serve buckets as paths, not subdomains
        options["s3"] = {"addressing_style": "path"}
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=Config(**options))
