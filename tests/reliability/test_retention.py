"""7. Retention and a full disk.

* Checkpoints go when a job ends, whatever the ending, but a failed job's latest stays for the
  admin's retry (which resumes there) until FAILED_CHECKPOINT_TTL_SECONDS.
* Job rows are purged JOB_TTL_SECONDS after they ended (off by default), and a deleted job (the
  purge, the admin) takes its files with it.
* Prompt embeddings that no active job uses are deleted once unused for
  EMBEDDINGS_TTL_SECONDS (a job in use refreshes them; an encode in progress
  keeps them).
* Outputs and previews expire OUTPUT_TTL_SECONDS after the job ended: the files
  go, the job stays (stage "expired", no outputs, its old URLs 404).
* The sweep is a beat task (tasks.maintenance.retain).
* A full disk fails the job at once with a clear error (not three retries of
  the same failure), frees its checkpoints but the latest, and the worker goes on.
"""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from genserver.jobs import services
from genserver.jobs.models import Job, JobStatus
from genserver.storage import default_storage
from tests.conftest import job_row, submit, wait_for
from tests.support.broker import capture_sends
from tests.support.jobs import make_job

pytestmark = pytest.mark.django_db


def age(path: Path, seconds: float) -> None:
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


@pytest.mark.parametrize("ending", ["cancelled", "failed", "succeeded"])
def test_checkpoints_go_when_a_job_ends(make_user, settings, ending, django_capture_on_commit_callbacks):
    settings.MAX_ATTEMPTS = 1
    job = make_job(
        make_user("alice").user,
        status=JobStatus.DENOISING,
        lease_owner="w1",
        lease_expires_at=timezone.now() + timedelta(seconds=30),
    )
    storage = default_storage()
    storage.put(f"checkpoints/{job.pk}/step-00010.pt", b"state")
    if ending == "cancelled":
        assert services.finish_cancelled(job.pk, "w1")
    elif ending == "failed":
        with django_capture_on_commit_callbacks(execute=True):
            assert services.fail_attempt(job.pk, "w1", "RuntimeError: boom") == "failed"
    else:
        Job.objects.filter(pk=job.pk).update(status=JobStatus.DECODING)
        assert services.finish_decoding(job.pk, "w1", [])
    assert job_row(job.pk).status == ending
    assert not storage.path(f"checkpoints/{job.pk}").exists()


def _failed_with_checkpoints(owner, django_capture_on_commit_callbacks, settings):
    """A denoising job with checkpoints at steps 5 and 10 (the row names 10), failed for good."""
    settings.MAX_ATTEMPTS = 1
    storage = default_storage()
    job = make_job(
        owner,
        status=JobStatus.DENOISING,
        embeddings_key="embeddings/e.pt",
        lease_owner="w1",
        lease_expires_at=timezone.now() + timedelta(seconds=30),
    )
    storage.put(f"checkpoints/{job.pk}/step-00005.pt", b"state 5")
    latest = storage.put(f"checkpoints/{job.pk}/step-00010.pt", b"state 10")
    Job.objects.filter(pk=job.pk).update(checkpoint_step=10, steps_done=12, checkpoint_key=latest)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.fail_attempt(job.pk, "w1", "RuntimeError: boom") == "failed"
    return job_row(job.pk), latest


def test_a_failed_job_keeps_its_latest_checkpoint_and_a_retry_resumes_there(
    make_user, settings, django_capture_on_commit_callbacks, monkeypatch
):
    storage = default_storage()
    job, latest = _failed_with_checkpoints(make_user("alice").user, django_capture_on_commit_callbacks, settings)
    assert job.status == "failed" and job.checkpoint_key == latest
    assert [e.key for e in storage.list(f"checkpoints/{job.pk}")] == [latest]  # the older one went
    sent = capture_sends(monkeypatch, "send_chunk")
    assert services.retry_failed(job)
    job = job_row(job.pk)
    assert (job.status, job.checkpoint_step, job.steps_done, job.attempts) == ("denoising", 10, 10, 0)
    assert sent == [("chunk", job.pk, 10, job.queue, job.priority, job.model)]


def test_retention_removes_a_failed_jobs_checkpoint_after_its_ttl(
    make_user, settings, django_capture_on_commit_callbacks, monkeypatch
):
    settings.FAILED_CHECKPOINT_TTL_SECONDS = 3600
    storage = default_storage()
    job, latest = _failed_with_checkpoints(make_user("alice").user, django_capture_on_commit_callbacks, settings)
    assert services.expire_failed_checkpoints() == 0 and storage.exists(latest)  # failed a moment ago
    Job.objects.filter(pk=job.pk).update(finished_at=timezone.now() - timedelta(seconds=7200))
    assert services.expire_failed_checkpoints() == 1
    assert not storage.path(f"checkpoints/{job.pk}").exists()
    job = job_row(job.pk)
    assert (job.checkpoint_key, job.checkpoint_step, job.steps_done) == ("", 0, 0)
    assert services.expire_failed_checkpoints() == 0  # idempotent
    sent = capture_sends(monkeypatch, "send_chunk")
    assert services.retry_failed(job)  # from the start now
    assert sent == [("chunk", job.pk, 0, job.queue, job.priority, job.model)]


def _ended_job_with_files(owner, ended_ago: float, status: str = JobStatus.SUCCEEDED) -> Job:
    storage = default_storage()
    job = make_job(owner, status=status, stage="done", finished_at=timezone.now() - timedelta(seconds=ended_ago))
    out = storage.put(f"outputs/{job.pk}/0.png", b"\x89PNG")
    storage.put(f"outputs/{job.pk}/segments/000.mp4", b"mp4")
    storage.put(f"previews/{job.pk}/preview.png", b"\x89PNG")
    storage.put(f"checkpoints/{job.pk}/step-00010.pt", b"state")
    Job.objects.filter(pk=job.pk).update(outputs=[{"key": out, "content_type": "image/png"}])
    return job


def _files_of(job_id) -> list[str]:
    storage = default_storage()
    return [e.key for kind in ("outputs", "previews", "checkpoints") for e in storage.list(f"{kind}/{job_id}")]


@pytest.mark.django_db(transaction=True)
def test_old_job_rows_are_purged_with_their_files_when_configured(make_user, settings):
    owner = make_user("alice").user
    old = _ended_job_with_files(owner, 10 * 86400)
    old_failed = _ended_job_with_files(owner, 10 * 86400, status=JobStatus.FAILED)
    young = _ended_job_with_files(owner, 60)
    running = make_job(owner, status=JobStatus.DENOISING)  # not ended: never purged
    assert settings.JOB_TTL_SECONDS == 0 and services.purge_jobs() == 0  # off by default: rows stay
    assert Job.objects.count() == 4
    settings.JOB_TTL_SECONDS = 86400
    assert services.purge_jobs() == 2
    assert set(Job.objects.values_list("pk", flat=True)) == {young.pk, running.pk}
    assert _files_of(old.pk) == [] and _files_of(old_failed.pk) == []
    assert len(_files_of(young.pk)) == 4
    assert services.purge_jobs() == 0
    assert "jobs_purged" in services.retain()


def test_a_job_deleted_in_the_admin_takes_its_files(make_user, django_capture_on_commit_callbacks):
    from django.contrib.auth import get_user_model
    from django.test import Client

    owner = make_user("alice").user
    doomed, kept = _ended_job_with_files(owner, 60), _ended_job_with_files(owner, 60)
    admin = get_user_model().objects.create_superuser("boss", password="pw")
    browser = Client()
    browser.force_login(admin)
    with django_capture_on_commit_callbacks(execute=True):  # the files go once the deletion commits
        response = browser.post(
            "/admin/jobs/job/", {"action": "delete_selected", "_selected_action": [doomed.pk], "post": "yes"}
        )
    assert response.status_code == 302, response.content[:500]
    assert not Job.objects.filter(pk=doomed.pk).exists()
    assert _files_of(doomed.pk) == [] and len(_files_of(kept.pk)) == 4
    with django_capture_on_commit_callbacks(execute=True):
        response = browser.post(f"/admin/jobs/job/{kept.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302 and _files_of(kept.pk) == []


def test_unused_embeddings_are_deleted_after_their_ttl(make_user, settings):
    settings.EMBEDDINGS_TTL_SECONDS = 600
    owner = make_user("alice").user
    storage = default_storage()
    keys = {
        name: storage.put(f"embeddings/{name}-{os.getpid()}.pt", b"e")
        for name in ("in_use", "old_unused", "fresh_unused", "old_of_finished_job")
    }
    for name in ("in_use", "old_unused", "old_of_finished_job"):
        age(storage.path(keys[name]), 3600)
    make_job(owner, status=JobStatus.DENOISING, embeddings_key=keys["in_use"])
    make_job(owner, status=JobStatus.SUCCEEDED, embeddings_key=keys["old_of_finished_job"])
    assert services.sweep_embeddings() >= 2
    assert storage.exists(keys["in_use"]) and storage.exists(keys["fresh_unused"])
    assert not storage.exists(keys["old_unused"]) and not storage.exists(keys["old_of_finished_job"])
    assert time.time() - storage.path(keys["in_use"]).stat().st_mtime < 60  # seen in use: refreshed
    assert not list(storage.path("embeddings").glob(".deleting-*"))


def test_an_encode_in_progress_keeps_the_embeddings_it_may_have_found(make_user, settings):
    """Encode checks the cache before it records the key: while any job encodes, candidates stay."""
    settings.EMBEDDINGS_TTL_SECONDS = 600
    storage = default_storage()
    key = storage.put(f"embeddings/cached-{os.getpid()}.pt", b"e")
    age(storage.path(key), 3600)
    make_job(make_user("alice").user, status=JobStatus.ENCODING, lease_owner="encode@x:1")
    assert services.sweep_embeddings() == 0
    assert storage.exists(key) and not list(storage.path("embeddings").glob(".deleting-*"))


def test_outputs_expire_but_the_job_stays(make_user, settings):
    settings.OUTPUT_TTL_SECONDS = 3600
    alice = make_user("alice")
    storage = default_storage()
    jobs = {}
    for name, ended_ago in (("old", 7200), ("recent", 60)):
        job = make_job(
            alice.user,
            status=JobStatus.SUCCEEDED,
            stage="done",
            finished_at=timezone.now() - timedelta(seconds=ended_ago),
        )
        out = storage.put(f"outputs/{job.pk}/0.png", b"\x89PNG")
        preview = storage.put(f"previews/{job.pk}/preview.png", b"\x89PNG")
        Job.objects.filter(pk=job.pk).update(outputs=[{"key": out, "content_type": "image/png"}], preview_key=preview)
        jobs[name] = job.pk
    old_url = alice.get(f"/api/v1/jobs/{jobs['old']}/").json()["outputs"][0]["url"]
    assert services.expire_outputs() == 1
    old, recent = job_row(jobs["old"]), job_row(jobs["recent"])
    assert old.status == "succeeded" and old.stage == "expired" and old.outputs == [] and not old.preview_key
    assert not storage.path(f"outputs/{old.pk}").exists() and not storage.path(f"previews/{old.pk}").exists()
    body = alice.get(f"/api/v1/jobs/{old.pk}/").json()
    assert body["outputs"] == [] and body["preview_url"] is None and body["stage"] == "expired"
    assert alice.get(old_url).status_code == 404
    assert recent.outputs and storage.exists(recent.outputs[0]["key"])
    assert services.expire_outputs() == 0  # idempotent
    settings.OUTPUT_TTL_SECONDS = 0  # 0 keeps outputs forever
    Job.objects.filter(pk=recent.pk).update(finished_at=timezone.now() - timedelta(days=365))
    assert services.expire_outputs() == 0 and storage.exists(recent.outputs[0]["key"])


def test_retention_is_a_beat_task(settings):
    from tasks.maintenance import retain

    entry = settings.CELERY_BEAT_SCHEDULE["retention"]
    assert entry["task"] == retain.name and entry["options"]["queue"] == "control"  # the registered task
    assert entry["schedule"] == settings.RETENTION_INTERVAL_SECONDS > 0
    assert set(retain.apply().get()) == {"outputs_expired", "checkpoints_expired", "embeddings_deleted", "jobs_purged"}


# --- a full disk ------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stage, where", [("encode", "embeddings"), ("chunk", "checkpoints"), ("decode", "outputs")])
def test_disk_full_fails_the_job_at_once_with_a_clear_error(make_user, monkeypatch, stage, where):
    """The stage tasks run here, as a worker runs them, with every write under `where` going to
    /dev/full (ENOSPC at the first flush, through the real storage code)."""
    import genserver.storage.local as storage_module
    from tasks.decode import decode
    from tasks.denoise import run_chunk
    from tasks.encode import encode

    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")  # no worker of the stack takes part
    real_mkstemp = tempfile.mkstemp

    def full_disk_mkstemp(*args, dir=None, **kwargs):
        if dir is not None and f"/{where}/" in f"{dir}/":
            return os.open("/dev/full", os.O_WRONLY), str(Path(dir) / ".tmp-never-created")
        return real_mkstemp(*args, dir=dir, **kwargs)

    job = services.submit_job(
        make_user("alice").user,
        {
            "model": "sdxl-sim",
            "prompt": f"disk full at {stage} {time.time()}",
            "width": 512,
            "height": 512,
            "num_frames": 1,
            "steps": 8,
            "guidance_scale": 5.0,
            "seed": 3,
            "num_outputs": 1,
        },
    )
    steps = {
        "encode": lambda: encode.apply(args=[str(job.pk)]).get(),
        "chunk": lambda: run_chunk.apply(args=[str(job.pk), 0]).get(),
        "decode": lambda: decode.apply(args=[str(job.pk)]).get(),
    }
    order = ["encode", "chunk", "decode"]
    for earlier in order[: order.index(stage)]:
        steps[earlier]()
    monkeypatch.setattr(storage_module.tempfile, "mkstemp", full_disk_mkstemp)
    assert steps[stage]() == "failed"  # the task returns, not retried: the worker is free for the next job
    job.refresh_from_db()
    assert job.status == "failed" and job.attempts == 1, (job.status, job.attempts, job.error[:300])
    assert job.error.startswith("storage full: could not write")
    assert os.strerror(errno.ENOSPC) in job.error.splitlines()[0]
    assert "not retried" in job.error.splitlines()[0]
    kept = [e.key for e in default_storage().list(f"checkpoints/{job.pk}")]
    assert kept == ([job.checkpoint_key] if job.checkpoint_key else [])  # at most the latest, for a retry
    assert bool(kept) == (stage == "decode")  # its denoising had ended


def test_other_storage_errors_are_still_retried(make_user):
    """Only a full disk skips the retries; a missing file or a transient error is an ordinary attempt."""
    job = make_job(
        make_user("alice").user,
        status=JobStatus.DENOISING,
        lease_owner="w1",
        lease_expires_at=timezone.now() + timedelta(seconds=30),
    )
    error = (
        "Traceback (most recent call last):\n  ...\n"
        "genserver.storage.StorageError: storage key 'checkpoints/x/step-00004.pt' does not exist"
    )
    assert services.disk_full(error) is None
    assert services.disk_full("OSError: [Errno 28] No space left on device") == "[Errno 28] No space left on device"
    assert services.fail_attempt(job.pk, "w1", error) == "retried"
    assert job_row(job.pk).status == "denoising"


@pytest.fixture
def full_tmpfs():
    """A tiny tmpfs, filled up (root and a kernel that lets this container mount one)."""
    mount = Path(tempfile.mkdtemp(prefix="genserver-full-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        with open(mount / "filler", "wb") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
    except OSError:
        pass
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
        mount.rmdir()


@pytest.mark.stack
@pytest.mark.django_db(transaction=True)
def test_disk_full_in_a_real_worker_fails_the_job_and_the_worker_goes_on(stack, api, full_tmpfs):
    """The decode worker writes the outputs of this job onto a full filesystem."""
    response = submit(api, model="wan-sim", width=832, height=480, num_frames=81, steps=30)
    job_id = response.json()["id"]
    outputs = default_storage().path(f"outputs/{job_id}")
    outputs.parent.mkdir(parents=True, exist_ok=True)
    outputs.symlink_to(full_tmpfs, target_is_directory=True)
    try:
        job = wait_for(lambda: (j := job_row(job_id)).is_terminal and j, 60, what="the job to end")
        assert job.status == "failed" and job.attempts == 1, (job.status, job.error[:300])
        assert job.error.startswith("storage full:") and os.strerror(errno.ENOSPC) in job.error
        nxt = submit(api, prompt="after the full disk").json()["id"]
        assert wait_for(lambda: (j := job_row(nxt)).is_terminal and j, 30).status == "succeeded"
    finally:
        outputs.unlink()
