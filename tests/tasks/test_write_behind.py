"""Checkpoints written behind the next chunk: each boundary where the card keeps the job records the
previous chunk's checkpoint only once it is whole; a failed write fails the attempt, and the retry resumes
from the last checkpoint recorded to the same latents as a run without the fault. The denoise task runs
here, as a worker runs it, on the real storage and database (its messages are captured, not published)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from genserver.jobs import services
from genserver.jobs.models import Job, JobStage, JobStatus
from genserver.redis_client import client as redis_client
from genserver.storage import StorageError, default_storage
from genserver.storage.local import LocalStorage
from tests.support.broker import capture_sends
from workers.runtime import stages

pytestmark = pytest.mark.django_db(transaction=True)


def denoising_job(owner, prompt: str) -> Job:
    """A job past its encode, in chunks of 2 of its 8 steps, nothing waiting ahead of it on its queue."""
    job = services.submit_job(
        owner,
        {
            "model": "sdxl-sim",
            "prompt": prompt,
            "width": 256,
            "height": 256,
            "num_frames": 1,
            "steps": 8,
            "guidance_scale": 5.0,
            "seed": 11,
            "num_outputs": 1,
        },
    )
    if job.status == JobStatus.QUEUED:
        from tasks.encode import encode

        encode.apply(args=[str(job.pk)]).get()
    Job.objects.filter(pk=job.pk).update(chunk_steps=2)
    job.refresh_from_db()
    from genserver.jobs import broker

    redis_client().delete(*broker.queue_keys(job.queue))  # the card keeps the job at every boundary
    return job


def final_latents(job: Job) -> torch.Tensor:
    job.refresh_from_db()
    assert job.status == JobStatus.DECODING and job.checkpoint_step == 8, (job.status, job.error[:300])
    return stages._from_bytes(default_storage().get(job.checkpoint_key))["latents"]


def test_a_failed_write_behind_fails_the_attempt_and_the_retry_resumes_exactly(make_user, monkeypatch):
    from tasks.denoise import run_chunk

    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    owner = make_user("alice").user
    stamp = time.time()
    straight = denoising_job(owner, f"written behind {stamp}")
    faulty = denoising_job(owner, f"written behind {stamp}")  # the same prompt and seed
    assert run_chunk.apply(args=[str(straight.pk), 0]).get() == "step 8"  # kept the card for all 4 chunks
    assert ("decode", straight.pk, straight.priority) in sent
    expected = final_latents(straight)

    real_put = LocalStorage.put
    written: list[str] = []

    def failing_put(self, key: str, data: bytes) -> str:
        if key == f"checkpoints/{faulty.pk}/step-00004.pt":
            raise StorageError(f"could not write {key!r}: input/output error (injected)")
        written.append(key)
        return real_put(self, key, data)

    monkeypatch.setattr(LocalStorage, "put", failing_put)
    assert run_chunk.apply(args=[str(faulty.pk), 0]).get() == "retried"
    faulty.refresh_from_db()
    # The write of step 4 happened behind chunk 3; the boundary at step 6 found it failed.
    assert (faulty.status, faulty.stage, faulty.attempts) == (JobStatus.DENOISING, JobStage.RETRYING, 1)
    assert "step-00004.pt" in faulty.error and "injected" in faulty.error
    assert faulty.checkpoint_step == 2 and faulty.checkpoint_key == f"checkpoints/{faulty.pk}/step-00002.pt"
    assert default_storage().exists(faulty.checkpoint_key)  # the row names only a whole checkpoint
    assert f"checkpoints/{faulty.pk}/step-00006.pt" not in written  # never written past the failed one
    assert ("chunk", faulty.pk, 2, faulty.queue, faulty.priority) in sent  # the retry, from step 2

    monkeypatch.setattr(LocalStorage, "put", real_put)
    assert run_chunk.apply(args=[str(faulty.pk), 2]).get() == "step 8"
    assert torch.equal(final_latents(faulty), expected)


def test_each_kept_boundary_records_the_previous_checkpoint_whole(make_user, monkeypatch):
    """While chunk k+1 runs, chunk k's checkpoint is written and then recorded: every checkpoint the row
    named existed when it was named (read back by the database record's own transaction)."""
    from tasks.denoise import run_chunk

    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    job = denoising_job(make_user("bob").user, f"recorded whole {time.time()}")
    real_finish = services.finish_chunk
    named: list[tuple[int, bool]] = []

    def checking_finish(job_id, worker, step, checkpoint_key, *args, **kwargs):
        named.append((step, default_storage().exists(checkpoint_key)))
        return real_finish(job_id, worker, step, checkpoint_key, *args, **kwargs)

    real_put = LocalStorage.put
    writers: dict[str, str] = {}

    def noting_put(self, key: str, data: bytes) -> str:
        writers[key.rsplit("/", 1)[-1]] = threading.current_thread().name.split("_")[0]
        return real_put(self, key, data)

    monkeypatch.setattr(services, "finish_chunk", checking_finish)
    monkeypatch.setattr(LocalStorage, "put", noting_put)
    assert run_chunk.apply(args=[str(job.pk), 0]).get() == "step 8"
    assert named == [(2, True), (4, True), (6, True), (8, True)]
    # Kept at steps 2, 4 and 6: written on the worker's writer thread; at 8 the job leaves: written at once.
    main = threading.current_thread().name.split("_")[0]
    checkpoints = {k: v for k, v in writers.items() if k.startswith("step-")}
    assert checkpoints == {
        "step-00002.pt": "checkpoint-writer",
        "step-00004.pt": "checkpoint-writer",
        "step-00006.pt": "checkpoint-writer",
        "step-00008.pt": main,
    }
    job.refresh_from_db()
    assert job.steps_done == 8 and job.checkpoint_step == 8 and job.chunks_run == 4
