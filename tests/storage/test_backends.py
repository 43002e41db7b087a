"""The storage interface on both backends: the local directory, and S3 through moto's server over HTTP.

Every test here runs twice (`storage_backend`: local, s3). On s3 each call is a
real HTTP request from boto3 to moto's standalone server on 127.0.0.1.
"""

from __future__ import annotations

import os
import threading
import urllib.request
import uuid

import pytest

from genserver.storage import StorageError, StorageKeyMissing, default_storage


def unique(folder: str) -> str:
    return f"{folder}/{uuid.uuid4().hex}"


def test_put_writes_parts_one_after_another(storage_backend):
    # A checkpoint arrives as its header, then each tensor's own memory (workers/runtime/blob.py).
    storage = default_storage()
    key = unique("checkpoints") + "/step-00004.pt"
    parts = [b"head", bytearray(b"-pad-"), memoryview(bytes(range(256))), b""]
    assert storage.put(key, parts) == key
    assert storage.get(key) == b"head-pad-" + bytes(range(256))


def test_put_get_exists_and_overwrite(storage_backend):
    storage = default_storage()
    key = unique("outputs") + "/0.png"
    assert not storage.exists(key)
    assert storage.put(key, b"first") == key
    assert storage.exists(key) and storage.get(key) == b"first"
    storage.put(key, b"second, longer")
    assert storage.get(key) == b"second, longer"
    stored = storage.open(key)
    try:
        assert stored.size == len(b"second, longer") and stored.stream.read() == b"second, longer"
    finally:
        stored.stream.close()


def test_a_write_left_to_sync_reads_whole_at_once_and_syncs_later(storage_backend, monkeypatch):
    """put(durable=False) skips the fsync (local: none on the write; s3: a PUT is durable anyway); sync(key) then
    makes it durable (local: the file's and its directory's fsync); a key gone meanwhile says so."""
    synced: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), fsync(fd))[1])
    storage = default_storage()
    key = unique("checkpoints") + "/step-00004.pt"
    storage.put(key, [b"head", b"-tensors"], durable=False)
    assert storage.get(key) == b"head-tensors" and synced == []
    storage.sync(key)
    assert len(synced) == (0 if storage_backend == "s3" else 2)  # the file, then the directory's entry of it
    storage.put(key, b"again")
    assert len(synced) == (0 if storage_backend == "s3" else 3)  # a durable put syncs as it writes
    if storage_backend != "s3":
        storage.delete(key)
        with pytest.raises(StorageKeyMissing, match="does not exist"):
            storage.sync(key)


def test_the_backend_is_the_one_the_environment_names(storage_backend):
    from genserver.storage.local import LocalStorage
    from genserver.storage.s3 import S3Storage

    expected = S3Storage if storage_backend == "s3" else LocalStorage
    assert isinstance(default_storage(), expected)


def test_a_missing_key_is_a_storage_error_saying_so(storage_backend):
    """…of its own kind (StorageKeyMissing: a card that encodes on itself encodes a missing prompt, and only then),
    while a refused read stays a plain StorageError."""
    storage = default_storage()
    key = unique("checkpoints") + "/step-00004.pt"
    with pytest.raises(StorageKeyMissing, match="does not exist"):
        storage.get(key)
    with pytest.raises(StorageKeyMissing, match="does not exist"):
        storage.open(key)


@pytest.mark.parametrize("key", ["", "/etc/passwd", "../outside", "outputs/../../x"])
def test_keys_that_leave_the_store_are_refused(storage_backend, key):
    with pytest.raises(StorageError, match="invalid storage key"):
        default_storage().put(key, b"x")


def test_delete_prefix_removes_a_folder_and_nothing_beside_it(storage_backend):
    storage = default_storage()
    job = unique("checkpoints")
    inside = [storage.put(f"{job}/step-{n:05d}.pt", b"s") for n in (2, 4)]
    deeper = storage.put(f"{job}/deeper/more.pt", b"s")
    beside = storage.put(f"{job}x/step-00002.pt", b"s")  # shares the string prefix, not the folder
    storage.delete_prefix(job)
    assert not any(storage.exists(k) for k in [*inside, deeper])
    assert storage.exists(beside)
    storage.delete_prefix(job)  # nothing left: no error
    single = storage.put(unique("previews") + "/preview.png", b"p")
    storage.delete_prefix(single)  # a key itself, as well as a folder
    assert not storage.exists(single)


def test_list_move_touch_and_delete(storage_backend):
    storage = default_storage()
    folder = unique("embeddings")
    a, b = storage.put(f"{folder}/a.pt", b"a"), storage.put(f"{folder}/sub/b.pt", b"b")
    assert sorted(e.key for e in storage.list(folder)) == [a, b]
    assert list(storage.list(unique("embeddings"))) == []  # an empty folder lists nothing
    storage.move(a, f"{folder}/.deleting-a.pt")
    assert not storage.exists(a) and storage.get(f"{folder}/.deleting-a.pt") == b"a"
    before = next(e.modified for e in storage.list(folder) if e.key == b)
    storage.touch(b, before + 5)
    assert storage.get(b) == b"b"  # touching keeps the bytes
    storage.delete(b)
    assert not storage.exists(b)
    storage.delete(b)  # deleting what is gone is no error
    with pytest.raises(StorageError, match="does not exist"):
        storage.touch(b, before)


def test_a_reader_never_sees_half_an_object(storage_backend):
    """One writer replaces a 2 MiB object again and again while readers read it: every read is one
    whole version (local: temp file + rename; s3: one PUT)."""
    storage = default_storage()
    key = unique("checkpoints") + "/step-00010.pt"
    versions = [bytes([n]) * (2 << 20) for n in range(4)]
    storage.put(key, versions[0])
    done = threading.Event()
    torn: list[int] = []
    reads = [0]

    def read_until_done() -> None:
        while not done.is_set():
            data = storage.get(key)
            reads[0] += 1
            if data not in versions:
                torn.append(len(data))

    readers = [threading.Thread(target=read_until_done) for _ in range(2)]
    for reader in readers:
        reader.start()
    try:
        for round_ in range(12):
            storage.put(key, versions[round_ % len(versions)])
    finally:
        done.set()
        for reader in readers:
            reader.join()
    assert reads[0] > 0 and torn == []


def test_presigned_urls_exist_on_s3_only_and_serve_the_bytes(storage_backend):
    storage = default_storage()
    key = storage.put(unique("outputs") + "/0.png", b"\x89PNG signed")
    url = storage.presigned_url(key, 60, "image/png")
    if storage_backend == "local":
        assert url is None  # a directory has no URLs: the API streams
        return
    assert url is not None and "X-Amz-Signature=" in url and "X-Amz-Expires=60" in url
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.read() == b"\x89PNG signed" and answer.headers["Content-Type"] == "image/png"


def test_s3_errors_say_what_they_mean(s3_server, monkeypatch):
    """A missing bucket names the variable to set; a full store reads as a full disk to the job service."""
    for name, value in s3_server.env("genserver-test", prefix="errors").items():
        monkeypatch.setenv(name, value)
    from botocore.exceptions import ClientError

    from genserver.jobs.services import disk_full
    from genserver.storage.s3 import S3Storage

    monkeypatch.setenv("GENSERVER_S3_BUCKET", "no-such-bucket-here")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist.*GENSERVER_S3_BUCKET"):
        default_storage().put("outputs/x/0.png", b"x")

    storage = default_storage()
    assert isinstance(storage, S3Storage)
    for code, text in (("XMinioStorageFull", os.strerror(28)), ("QuotaExceeded", os.strerror(122))):
        full = ClientError({"Error": {"Code": code, "Message": "full"}}, "PutObject")
        error = storage._storage_error(full, "write", "outputs/x/0.png")
        assert text in str(error)
        traceback_tail = f"Traceback ...\ngenserver.storage.base.StorageError: {error}"
        assert disk_full(traceback_tail), "a full store fails the job at once, as a full disk does"
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "PutObject")
    assert "AWS_ACCESS_KEY_ID" in str(storage._storage_error(denied, "write", "outputs/x/0.png"))
    assert not isinstance(storage._storage_error(denied, "read", "embeddings/x.pt"), StorageKeyMissing)
