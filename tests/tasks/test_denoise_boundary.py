"""The denoise task's chunk boundaries where the card keeps the job, run here as a worker runs them (real
storage, database and Redis; its messages captured): one statement on the job's row per boundary, the step time
learned and the checkpoint's fsync done off the boundary, and a checkpoint lost before its fsync resumed from."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from genserver.jobs import broker, flags, services
from genserver.jobs.models import Job, JobStatus
from genserver.redis_client import CORRECTION_KEY, client as redis_client
from tests.support.broker import capture_sends

pytestmark = pytest.mark.django_db(transaction=True)


def statements_for_a_job_of(steps: int, owner, sent: list) -> int:
    """Run a tiny-sd job of `steps` one-step chunks on this card, nothing waiting beside it (so it keeps the
    card at every boundary but the last); the statements on the job tables its denoise task made."""
    from tasks import denoise

    job = job_with_one_step_chunks(owner, steps)
    sent.clear()
    with CaptureQueriesContext(connection) as statements:
        assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == f"step {steps}"
    denoise._off_the_boundary.submit(lambda: None).result()  # what the boundaries left to the worker's thread
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.checkpoint_step, row.chunks_run) == (JobStatus.DECODING, steps, steps)
    assert sent == [("decode", job.pk, row.priority, row.model)]  # no chunk message: every chunk ran here
    return sum("jobs_job" in q["sql"] for q in statements.captured_queries)


def test_each_kept_boundary_is_one_statement_and_the_step_time_is_learned(make_user, monkeypatch):
    from tasks import denoise

    monkeypatch.setattr(denoise, "HEARTBEAT_EVERY_SECONDS", 1e9)  # only the boundaries renew the lease here
    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    redis_client().delete(CORRECTION_KEY)
    owner = make_user("kept").user
    six, twelve = statements_for_a_job_of(6, owner, sent), statements_for_a_job_of(12, owner, sent)
    assert twelve - six == 6  # one compare-and-set per kept boundary (a locked read and a save were two)
    assert redis_client().hlen(CORRECTION_KEY) == 1  # tiny-sd's 64² shape learned its step time


def job_with_one_step_chunks(owner, steps: int, prompt: str = "") -> Job:
    """A tiny-sd job encoded here, its denoise about to start, a boundary after every step."""
    from tasks.encode import encode

    prompt = prompt or f"boundary {time.time()}"
    request = {"model": "tiny-sd", "prompt": prompt, "width": 64, "height": 64, "num_frames": 1}
    job = services.submit_job(owner, request | {"steps": steps, "guidance_scale": 5.0, "seed": 3, "num_outputs": 1})
    encode.apply(args=[str(job.pk)]).get()
    Job.objects.filter(pk=job.pk).update(chunk_steps=1)
    redis_client().delete(*broker.queue_keys(job.queue))
    return job


def spy_on_chunks(monkeypatch) -> tuple[list[int], list[float]]:
    """The steps at which the denoise task wrote a checkpoint, and every chunk's seconds."""
    from tasks import denoise

    saved_at: list[int] = []
    seconds: list[float] = []
    run, save = denoise.stages.run_merged_chunk, denoise.stages.save_chunk_end

    def running(*args, **kwargs):
        results = run(*args, **kwargs)
        seconds.extend(r.seconds for r in results)
        return results

    def saving(family, store, state, result, synced=True):
        saved_at.append(state.step)
        return save(family, store, state, result, synced=synced)

    monkeypatch.setattr(denoise.stages, "run_merged_chunk", running)
    monkeypatch.setattr(denoise.stages, "save_chunk_end", saving)
    return saved_at, seconds


def kept_then_fault(kept: int, error: str):
    """A stand-in for broker.should_yield: nothing waits at the first `kept` boundaries, then `error` is raised."""
    boundaries = iter([False] * kept)

    def should_yield(*args, **kwargs):
        try:
            return next(boundaries)
        except StopIteration:
            raise RuntimeError(error) from None

    return should_yield


def test_a_checkpoint_interval_writes_at_kept_boundaries_only_when_due_and_always_at_a_yield(
    make_user, monkeypatch, settings
):
    from tasks import denoise

    settings.CHECKPOINT_EVERY_SECONDS = 1e6  # never due on time: only a yield and the last step write
    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    saved_at, seconds = spy_on_chunks(monkeypatch)
    owner = make_user("interval").user
    beats, heartbeat = [], services.heartbeat

    def beating(job_id, worker, steps_done=None, **kwargs):
        beats.append((steps_done, kwargs.get("chunk_starts", False)))
        return heartbeat(job_id, worker, steps_done, **kwargs)

    monkeypatch.setattr(denoise.services, "heartbeat", beating)

    job = job_with_one_step_chunks(owner, 6)
    sent.clear()
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "step 6"
    row = Job.objects.get(pk=job.pk)
    assert saved_at == [6]  # five kept boundaries wrote nothing
    # ... and each recorded its progress and the next chunk's start, which the queue picture reads.
    assert [step for step, starts in beats if starts] == [1, 2, 3, 4, 5]
    assert (row.status, row.checkpoint_step, row.chunks_run) == (JobStatus.DECODING, 6, 1)
    assert row.card_seconds == pytest.approx(sum(seconds))  # the unrecorded chunks' seconds were carried
    assert sent == [("decode", job.pk, row.priority, row.model)]

    # A card that yields writes the checkpoint there, whatever the interval: its continuation resumes from it.
    boundaries = iter([False, False, True])  # better work waits at the third boundary
    monkeypatch.setattr(denoise.broker, "should_yield", lambda *args, **kwargs: next(boundaries))
    job = job_with_one_step_chunks(owner, 6)
    saved_at.clear(), sent.clear()
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "step 3"
    row = Job.objects.get(pk=job.pk)
    assert saved_at == [3] and (row.checkpoint_step, row.steps_done) == (3, 3)
    assert sent == [("chunk", job.pk, 3, row.queue, row.priority, row.model)]
    monkeypatch.setattr(denoise.broker, "should_yield", lambda *args, **kwargs: False)
    assert denoise.run_chunk.apply(args=[str(job.pk), 3]).get() == "step 6"
    assert saved_at == [3, 6] and Job.objects.get(pk=job.pk).status == JobStatus.DECODING


def test_without_an_interval_every_boundary_writes(make_user, monkeypatch, settings):
    from tasks import denoise

    settings.CHECKPOINT_EVERY_SECONDS = 0.0
    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    saved_at, _ = spy_on_chunks(monkeypatch)
    job = job_with_one_step_chunks(make_user("every").user, 4)
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "step 4"
    assert saved_at == [1, 2, 3, 4]


def test_a_fault_between_checkpoints_redoes_the_unsaved_chunks_from_the_last_one(make_user, monkeypatch, settings):
    from tasks import denoise

    settings.CHECKPOINT_EVERY_SECONDS = 1e6
    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    saved_at, _ = spy_on_chunks(monkeypatch)
    monkeypatch.setattr(denoise.broker, "should_yield", kept_then_fault(3, "injected fault at a kept boundary"))
    job = job_with_one_step_chunks(make_user("fault").user, 6)
    sent.clear()
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "retried"
    row = Job.objects.get(pk=job.pk)
    assert saved_at == [] and (row.status, row.checkpoint_step, row.attempts) == (JobStatus.DENOISING, 0, 1)
    assert sent == [
        ("chunk", job.pk, 0, row.queue, row.priority, row.model)
    ]  # retried from the last checkpoint: the start

    monkeypatch.setattr(denoise.broker, "should_yield", lambda *args, **kwargs: False)
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "step 6"
    assert saved_at == [6] and Job.objects.get(pk=job.pk).status == JobStatus.DECODING


def test_a_cancel_between_checkpoints_bills_the_chunks_run_since_the_last(make_user, monkeypatch, settings):
    from tasks import denoise

    settings.CHECKPOINT_EVERY_SECONDS = 1e6
    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    saved_at, seconds = spy_on_chunks(monkeypatch)
    job = job_with_one_step_chunks(make_user("cancel").user, 6)
    boundaries = iter([False, False])

    def cancelled_at_the_third_boundary(*args, **kwargs):
        try:
            return next(boundaries)
        except StopIteration:
            flags.raise_cancel(job.pk)  # as the API's cancel flags it
            return False

    monkeypatch.setattr(denoise.broker, "should_yield", cancelled_at_the_third_boundary)
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "cancelled"
    row = Job.objects.get(pk=job.pk)
    assert saved_at == [] and row.status == JobStatus.CANCELLED and row.checkpoint_step == 0
    assert row.card_seconds == pytest.approx(sum(seconds)) and row.card_seconds > 0  # three chunks, none recorded


def _step_of(key: str) -> int:
    return int(key.rsplit("step-", 1)[1].removesuffix(".pt"))


def spy_on_checkpoint_files(monkeypatch) -> list[tuple]:
    """("put", step, durable) / ("sync", step, thread) / ("delete", step, thread) for the checkpoints, in order."""
    import threading

    from genserver.storage import LocalStorage

    log: list[tuple] = []
    put, sync, delete = LocalStorage.put, LocalStorage.sync, LocalStorage.delete_prefix

    def putting(self, key, data, durable=True):
        if key.startswith("checkpoints/"):
            log.append(("put", _step_of(key), durable))
        return put(self, key, data, durable)

    def syncing(self, key):
        log.append(("sync", _step_of(key), threading.current_thread().name))
        return sync(self, key)

    def deleting(self, prefix):
        if prefix.startswith("checkpoints/") and "step-" in prefix:
            log.append(("delete", _step_of(prefix), threading.current_thread().name))
        return delete(self, prefix)

    monkeypatch.setattr(LocalStorage, "put", putting)
    monkeypatch.setattr(LocalStorage, "sync", syncing)
    monkeypatch.setattr(LocalStorage, "delete_prefix", deleting)
    return log


def test_a_kept_boundary_leaves_the_fsync_to_the_background_and_deletes_the_older_only_after_it(make_user, monkeypatch):
    from tasks import denoise

    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    log = spy_on_checkpoint_files(monkeypatch)
    job = job_with_one_step_chunks(make_user("synced-behind").user, 6)
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "step 6"
    denoise._off_the_boundary.submit(lambda: None).result()
    # Kept boundaries write without the fsync; the job's last step syncs before it records (its decode reads it).
    assert [e[1:] for e in log if e[0] == "put"] == [
        (1, False),
        (2, False),
        (3, False),
        (4, False),
        (5, False),
        (6, True),
    ]
    background = [e for e in log if e[0] != "put"]
    assert {thread.split("_")[0] for *_, thread in background} == {"off-the-boundary"}
    assert [step for kind, step, _ in background if kind == "sync"] == [1, 2, 3, 4, 5]
    assert sorted(step for kind, step, _ in background if kind == "delete") == [1, 2, 3, 4, 5]
    for kind, step, _ in background:  # each checkpoint goes only once the next one is on the disk
        if kind == "delete" and step < 5:
            assert background.index(("sync", step + 1, _)) < background.index((kind, step, _))


def test_a_failed_fsync_fails_the_attempt_at_the_next_boundary_and_keeps_the_older_checkpoint(make_user, monkeypatch):
    from genserver.storage import LocalStorage, StorageError
    from tasks import denoise

    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    sync = LocalStorage.sync

    def failing_at_step_2(self, key):
        if _step_of(key) == 2:
            raise StorageError(f"could not sync {key!r}: Input/output error")
        return sync(self, key)

    monkeypatch.setattr(LocalStorage, "sync", failing_at_step_2)
    job = job_with_one_step_chunks(make_user("sync-fails").user, 6)
    sent.clear()
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "retried"
    denoise._off_the_boundary.submit(lambda: None).result()
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.checkpoint_step, row.attempts) == (JobStatus.DENOISING, 2, 1)
    assert "Input/output error" in row.error
    store = denoise.storage()
    assert store.exists(row.checkpoint_key) and store.exists(row.checkpoint_key.replace("step-00002", "step-00001"))
    assert sent == [("chunk", job.pk, 2, row.queue, row.priority, row.model)]  # retried from step 2: still whole
    monkeypatch.setattr(LocalStorage, "sync", sync)
    assert denoise.run_chunk.apply(args=[str(job.pk), 2]).get() == "step 6"


def test_a_checkpoint_lost_before_its_fsync_resumes_from_the_one_before_with_the_same_pixels(make_user, monkeypatch):
    """A power loss after a kept boundary recorded its checkpoint, before the background thread synced it: the
    file is empty (what a lost delayed write leaves), the one before it is there. The retry resumes from that one,
    the row going back a step, and ends on the same latents as a run that lost nothing."""
    from tasks import denoise
    from workers.runtime import blob

    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    owner = make_user("power-loss").user
    store = denoise.storage()

    def final_latents(job: Job) -> dict:
        return blob.loads(store.get(Job.objects.get(pk=job.pk).checkpoint_key))

    prompt = f"power loss {time.time()}"
    reference = job_with_one_step_chunks(owner, 6, prompt)
    assert denoise.run_chunk.apply(args=[str(reference.pk), 0]).get() == "step 6"

    job = job_with_one_step_chunks(owner, 6, prompt)
    sync_off_the_boundary, never_ran = denoise._sync_off_the_boundary, []

    def power_lost_before_the_sync_of_step_2(store, key, older):
        if key.endswith("step-00002.pt"):
            never_ran.append(key)
            return Future()  # neither the sync nor the deletion of step 1 after it
        return sync_off_the_boundary(store, key, older)

    monkeypatch.setattr(denoise, "_sync_off_the_boundary", power_lost_before_the_sync_of_step_2)
    monkeypatch.setattr(denoise.broker, "should_yield", kept_then_fault(2, "the machine lost power"))
    sent.clear()
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "retried"
    row = Job.objects.get(pk=job.pk)
    assert row.checkpoint_step == 2 and never_ran == [row.checkpoint_key], row.error
    store.path(row.checkpoint_key).write_bytes(b"")  # what the power loss left of the unsynced write

    monkeypatch.undo()
    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    assert denoise.run_chunk.apply(args=[str(job.pk), 2]).get() == "step 6"
    denoise._off_the_boundary.submit(lambda: None).result()
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.checkpoint_step) == (JobStatus.DECODING, 6)
    mine, theirs = final_latents(job), final_latents(reference)
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        if hasattr(value, "shape"):
            assert (mine[name] == value).all(), name
