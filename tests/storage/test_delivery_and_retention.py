"""Outputs through the API and retention, on both storage backends (local, and S3 through moto's server).

* The output endpoint checks the owner, then streams the bytes, or with
  GENSERVER_OUTPUT_DELIVERY=presigned on S3 answers 302 to a short-lived URL.
* Retention expires outputs and previews, and sweeps unused embeddings
  (moving candidates aside, then asking the database again), on both.
"""

from __future__ import annotations

import urllib.request
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from genserver.jobs import services
from genserver.jobs.models import Job, JobStatus
from genserver.storage import default_storage
from tests.support.jobs import make_job
from tests.support.waits import job_row, wait_for

pytestmark = pytest.mark.django_db


def finished_job_with_output(owner, ended_ago: float = 0.0) -> Job:
    job = make_job(
        owner, status=JobStatus.SUCCEEDED, stage="done", finished_at=timezone.now() - timedelta(seconds=ended_ago)
    )
    storage = default_storage()
    out = storage.put(f"outputs/{job.pk}/0.png", b"\x89PNG " + job.pk.bytes)
    preview = storage.put(f"previews/{job.pk}/preview.png", b"\x89PNG preview")
    Job.objects.filter(pk=job.pk).update(outputs=[{"key": out, "content_type": "image/png"}], preview_key=preview)
    job.refresh_from_db()
    return job


def read(response) -> bytes:
    return b"".join(response.streaming_content) if response.streaming else response.content


@pytest.mark.parametrize("delivery", ["stream", "presigned"])
def test_an_output_reaches_its_owner_only(storage_backend, delivery, make_user, settings):
    settings.OUTPUT_DELIVERY, settings.OUTPUT_URL_TTL_SECONDS = delivery, 120
    alice, bob = make_user("alice"), make_user("bob")
    job = finished_job_with_output(alice.user)
    url = f"/api/v1/jobs/{job.pk}/outputs/0/"
    assert bob.get(url).status_code == 404  # the owner check comes first, whatever the delivery
    answer = alice.get(url)
    expected = b"\x89PNG " + job.pk.bytes
    if delivery == "presigned" and storage_backend == "s3":
        assert answer.status_code == 302 and answer["Cache-Control"] == "private, no-store"
        assert "X-Amz-Expires=120" in answer["Location"]
        with urllib.request.urlopen(answer["Location"], timeout=10) as fetched:  # the client, straight from S3
            assert fetched.read() == expected and fetched.headers["Content-Type"] == "image/png"
    else:  # streamed through the API (the local backend has no URLs of its own)
        assert answer.status_code == 200 and answer["Content-Type"] == "image/png"
        assert answer["Content-Length"] == str(len(expected)) and read(answer) == expected
    assert read(alice.get(f"/api/v1/jobs/{job.pk}/preview/")) == b"\x89PNG preview"  # previews stream
    default_storage().delete_prefix(f"outputs/{job.pk}")
    assert alice.get(url).status_code == 404  # gone from storage: 404, not 500


def test_outputs_expire_on_either_backend(storage_backend, make_user, settings):
    settings.OUTPUT_TTL_SECONDS = 3600
    alice = make_user("alice")
    old, recent = finished_job_with_output(alice.user, 7200), finished_job_with_output(alice.user, 60)
    storage = default_storage()
    assert services.expire_outputs() == 1
    assert not list(storage.list(f"outputs/{old.pk}")) and not list(storage.list(f"previews/{old.pk}"))
    assert job_row(old.pk).stage == "expired"
    assert alice.get(f"/api/v1/jobs/{old.pk}/outputs/0/").status_code == 404
    assert storage.exists(job_row(recent.pk).outputs[0]["key"])


def test_unused_embeddings_are_swept_on_either_backend(storage_backend, make_user, settings):
    """Old and unused goes; in use, or written after the cut-off, stays. The cut-off is set from the
    store's own clock (S3's LastModified has whole seconds), by waiting until it has moved on."""
    settings.EMBEDDINGS_TTL_SECONDS = 600
    storage = default_storage()
    run = uuid.uuid4().hex[:8]
    keys = {
        name: storage.put(f"embeddings/{name}-{run}.pt", b"e")
        for name in ("in_use", "old_unused", "old_of_finished_job")
    }

    def modified(key: str) -> float:
        return next(e.modified for e in storage.list("embeddings") if e.key == key)

    last_old = max(modified(k) for k in keys.values())
    probe = f"embeddings/probe-{run}.pt"

    def clock_moved_on() -> bool:
        storage.put(probe, b"p")
        return modified(probe) > last_old

    wait_for(clock_moved_on, 10, interval=0.2, what="the store's clock to pass the old objects' time")
    cutoff = modified(probe)
    keys["fresh_unused"] = storage.put(f"embeddings/fresh_unused-{run}.pt", b"e")
    storage.delete(probe)
    owner = make_user("alice").user
    make_job(owner, status=JobStatus.DENOISING, embeddings_key=keys["in_use"])
    make_job(owner, status=JobStatus.SUCCEEDED, embeddings_key=keys["old_of_finished_job"])
    now = datetime.fromtimestamp(cutoff + settings.EMBEDDINGS_TTL_SECONDS, tz=UTC)
    assert services.sweep_embeddings(now) >= 2
    assert storage.exists(keys["in_use"]) and storage.exists(keys["fresh_unused"])
    assert not storage.exists(keys["old_unused"]) and not storage.exists(keys["old_of_finished_job"])
    assert not [e.key for e in storage.list("embeddings") if "/.deleting-" in e.key]


def test_a_sweep_that_died_midway_is_undone_and_an_encode_keeps_candidates(storage_backend, make_user, settings):
    settings.EMBEDDINGS_TTL_SECONDS = 0
    storage = default_storage()
    run = uuid.uuid4().hex[:8]
    left_aside = storage.put(f"embeddings/.deleting-orphan-{run}.pt", b"e")  # its original is gone
    make_job(make_user("alice").user, status=JobStatus.ENCODING, lease_owner="encode@x:1")
    later = timezone.now() + timedelta(hours=1)
    assert services.sweep_embeddings(later) == 0  # a job is encoding: every candidate is put back
    assert storage.exists(f"embeddings/orphan-{run}.pt") and not storage.exists(left_aside)
    Job.objects.filter(status=JobStatus.ENCODING).update(status=JobStatus.SUCCEEDED)
    assert services.sweep_embeddings(later) >= 1
    assert not storage.exists(f"embeddings/orphan-{run}.pt")
