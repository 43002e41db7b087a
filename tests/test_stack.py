"""End to end on the real parts: the API in this process, real Celery workers and beat on a real Redis.

The test layout (tests/settings.py) has one card taking every class, an
encode worker and a decode worker; the simulated clock runs at 1/500.
"""

from __future__ import annotations

import io
import math
import threading
import time

import pytest
from PIL import Image

from genserver.storage import default_storage
from tests.support.api import submit
from tests.support.waits import finished, job_row, settled, wait_for, workers_idle
from tests.test_stack_merging import card_paused

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]

LONG_VIDEO = {"model": "wan-sim", "width": 1280, "height": 720, "num_frames": 81}  # 2,960 s of work → 6 s
VIDEO = {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 81}  # 665 s of work → 1.3 s; two fit


def watch_statuses(job_id, stop: threading.Event, seen: list[str]) -> None:
    """Record every status the job passes through (polling the database, as a client polls the API)."""
    from django.db import connection

    try:
        while not stop.is_set():
            status = job_row(job_id).status
            if not seen or seen[-1] != status:
                seen.append(status)
            if status in ("succeeded", "failed", "cancelled"):
                return
            time.sleep(0.005)
    finally:
        connection.close()


def test_tiny_model_job_goes_through_every_stage_to_a_png(storage_backend, stack, api):
    """On each storage backend (`storage_backend`: the stack's workers store there too)."""
    response = submit(api, model="tiny-sd", prompt="a red fox in the snow", preview_every=2, steps=10)
    assert response.status_code == 201, response.content
    job_id = response.json()["id"]
    seen: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_statuses, args=(job_id, stop, seen))
    watcher.start()
    job = finished(job_id)  # JOB_SECONDS: on s3 it is the first job of a freshly rebooted stack (cold loads)
    stop.set()
    watcher.join()
    if seen[-1] != job.status:  # the watcher stopped before its next poll
        seen.append(job.status)
    assert job.status == "succeeded", job.error
    order = ["queued", "encoding", "denoising", "decoding", "succeeded"]
    assert [s for s in order if s in seen] == seen[: len([s for s in order if s in seen])]
    assert {"denoising", "decoding", "succeeded"} <= set(seen), seen
    body = api.get(f"/api/v1/jobs/{job_id}/").json()
    assert body["progress"] == {"step": 10, "total_steps": 10}
    assert body["started_at"] and body["finished_at"] and body["preview_url"]
    assert body["eta_seconds"] is None and body["queue_position"] is None
    png = b"".join(api.get(body["outputs"][0]["url"]).streaming_content)
    image = Image.open(io.BytesIO(png))
    assert png.startswith(b"\x89PNG") and image.size == (64, 64)
    preview = b"".join(api.get(body["preview_url"]).streaming_content)
    assert preview.startswith(b"\x89PNG")
    # The decode worker drops them once the job's success is recorded (services._common.after_end), so a client can
    # see `succeeded` a moment before they are gone: on s3 (the moto server) that moment was long enough to fail here.
    wait_for(lambda: not list(default_storage().list(f"checkpoints/{job_id}")), 30, what="the checkpoints deleted")
    assert default_storage().exists(job_row(job_id).outputs[0]["key"])
    if storage_backend == "s3":  # the workers wrote to the object store, not to the local directory
        from django.conf import settings

        assert not (settings.STORAGE_DIR / "outputs" / str(job_id)).exists()
    # Retention, as beat runs it, clears the job's files in that store once their TTLs have passed.
    from datetime import timedelta

    from django.utils import timezone

    from genserver.jobs import services

    job = job_row(job_id)
    written = [job.embeddings_key, job.preview_key, *(out["key"] for out in job.outputs)]
    assert all(default_storage().exists(key) for key in written), written
    swept = services.retain(timezone.now() + timedelta(days=8))  # past OUTPUT_TTL (7 d) and EMBEDDINGS_TTL
    assert swept["outputs_expired"] >= 1 and swept["embeddings_deleted"] >= 1, swept
    assert not any(default_storage().exists(key) for key in written)
    assert api.get(body["outputs"][0]["url"]).status_code == 404


def test_cancel_while_queued_never_starts(stack, api):
    running = submit(api, **VIDEO).json()["id"]
    wait_for(lambda: job_row(running).started_at, 30, what="the first video to start")
    queued = submit(api, **VIDEO, prompt="second").json()["id"]
    response = api.post(f"/api/v1/jobs/{queued}/cancel/")
    assert response.status_code == 202 and response.json()["cancel_requested"] is True
    assert finished(queued, timeout=5).status == "cancelled"  # at once, or when its encode step returns
    api.post(f"/api/v1/jobs/{running}/cancel/")
    finished(running)
    settled(["encode", job_row(queued).queue])  # its messages are consumed and find it terminal
    job = job_row(queued)
    assert job.status == "cancelled" and job.started_at is None and job.steps_done == 0 and not job.outputs


def test_cancel_while_running_stops_within_a_step_and_skips_decode(stack, api):
    # 59 s of work per step → 118 ms; a preview every step records the step reached as it happens.
    job_id = submit(api, **LONG_VIDEO, steps=100, preview_every=1).json()["id"]
    wait_for(lambda: job_row(job_id).preview_step >= 2, 30, what="two steps")
    assert api.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 202
    flagged_by = job_row(job_id).preview_step  # the cancel flag was set before this step was recorded
    job = finished(job_id, timeout=30)
    assert job.status == "cancelled"
    # The flag is checked before every step: once it is set, only the step then running completes
    # (its preview recorded, or about to be), never the rest of a chunk.
    assert job.preview_step <= flagged_by + 1, (job.preview_step, flagged_by)
    assert job.steps_done < job.steps and not job.outputs
    # The card is free again: the next job runs.
    nxt = submit(api).json()["id"]
    assert finished(nxt, timeout=30).status == "succeeded"


def test_a_job_teaches_its_models_stage_seconds_and_the_next_eta_counts_them(stack, api):
    """Encode hop, dispatch hop (the card was idle), chunk boundaries, a simulated step's overhead and decode,
    learned from real workers."""
    from genserver.jobs.selectors.positions import QueueSnapshot, stage_seconds

    # The dispatch hop is learned only where the first chunk finds its card idle: a task an earlier test left
    # running (its row gone with that test's database) must end first.
    workers_idle()
    first = submit(api, prompt="the first of its model", width=512, height=512, steps=20).json()
    assert finished(first["id"]).status == "succeeded"
    model = first["model"]

    stage_names = ("lead-in", "hop", "boundary", "step", "tail")

    def all_five() -> dict[str, float] | None:
        learned = stage_seconds()
        return learned if all(f"{model}:{k}" in learned for k in stage_names) else None

    learned = wait_for(all_five, 30, what="the five stage seconds learned (boundaries off the critical path)")
    assert all(learned[f"{model}:{k}"] > 0 for k in ("lead-in", "hop", "boundary", "tail")), learned
    assert learned[f"{model}:step"] >= 0, learned  # a simulated step past its sleep (0 if the machine kept up)
    with card_paused(stack):  # the next one is encoded and waits for the card: its ETA is its own and the stages
        second = submit(api, prompt="the second", width=512, height=512, steps=20).json()["id"]
        wait_for(lambda: job_row(second).stage == "waiting", 30, what="the second encoded and waiting")
        job = job_row(second)

        def settled_eta() -> tuple[float, dict[str, float]] | None:
            """The ETA and the stage seconds it read, once no late record of the first job's moves them."""
            learned = stage_seconds()
            eta = QueueSnapshot.load().eta_seconds(job)
            return (eta, learned) if eta is not None and stage_seconds() == learned else None

        eta, learned = wait_for(settled_eta, 30, what="an ETA on stage seconds that hold still")
    own = job.estimated_seconds * job.clock_scale
    chunks = math.ceil(job.total_steps / job.chunk_steps)
    stages = (
        learned[f"{model}:hop"]
        + job.total_steps * learned[f"{model}:step"]
        + chunks * learned[f"{model}:boundary"]
        + learned[f"{model}:tail"]
    )
    assert eta == pytest.approx(own + stages, abs=2e-3)  # encoded: no lead-in left; the card is free: no wait
    assert finished(second).status == "succeeded"


def test_short_job_behind_long_jobs_runs_at_the_next_chunk_boundary(stack, api):
    first = submit(api, **VIDEO).json()["id"]
    wait_for(lambda: job_row(first).started_at, 30, what="the first video to start")
    second = submit(api, **VIDEO, prompt="another").json()["id"]
    short = submit(api, prompt="a quick draft", width=512, height=512, steps=20).json()["id"]
    assert finished(short, timeout=30).status == "succeeded"
    a, b, s = finished(first), finished(second), job_row(short)
    assert a.status == b.status == "succeeded"
    assert s.finished_at < a.finished_at, "the short job waited for the whole video"
    assert s.started_at < b.started_at, "the short job waited behind a video submitted before it"
    assert a.chunks_run > 1 and a.chunk_steps < a.steps  # the video really was chunked


def test_overload_refuses_video_while_accepting_images(stack, api):
    accepted = submit(api, **LONG_VIDEO)
    assert accepted.status_code == 201
    refused = submit(api, **LONG_VIDEO, prompt="one too many")
    assert refused.status_code == 429, refused.content
    assert int(refused["Retry-After"]) >= 1
    body = refused.json()
    assert body["reason"] == "overloaded" and body["duration_class"] == "long" and "long" in body["detail"]
    image = submit(api, prompt="still welcome")
    assert image.status_code == 201
    from genserver.jobs.models import Job

    assert Job.objects.count() == 2  # the refused request left no row
    api.post(f"/api/v1/jobs/{accepted.json()['id']}/cancel/")
    assert finished(image.json()["id"]).status == "succeeded"


def test_worker_killed_mid_job_resumes_from_its_checkpoint(storage_backend, stack, api):
    """On each storage backend: the restarted worker reads the checkpoint back from the store."""
    job_id = submit(api, **LONG_VIDEO, steps=60).json()["id"]
    wait_for(lambda: job_row(job_id).checkpoint_step >= 10, 30, what="ten checkpointed steps")
    stack.kill("card0")
    at_kill = job_row(job_id)
    assert default_storage().exists(at_kill.checkpoint_key), "the checkpoint to resume from is in the store"
    stack.wait_ready()  # the launcher's supervisor restarts the card's worker
    job = finished(job_id, timeout=60)
    assert job.status == "succeeded", job.error
    # Killed mid-chunk: the lease expires and the reaper retries (one attempt). Killed in the
    # instant between chunks: the message is lost and the reaper re-publishes it (no attempt).
    assert job.attempts <= 1 and (job.attempts == 0 or "lease" in job.error)
    chunks = -(-job.steps // job.chunk_steps)
    assert job.chunks_run <= chunks + 1, "more than the interrupted chunk was redone"
    assert at_kill.checkpoint_step >= 10 and len(job.outputs) == 1


def test_poison_job_fails_after_max_attempts_and_the_worker_serves_others(stack, api):
    job_id = submit(api, model="faulty-sim", prompt="crash").json()["id"]
    job = finished(job_id, timeout=30)
    assert job.status == "failed"
    assert job.attempts == 3 and "simulated out-of-memory at step 3" in job.error
    assert api.get(f"/api/v1/jobs/{job_id}/").json()["error"].startswith("gave up after 3 attempts")
    assert finished(submit(api).json()["id"]).status == "succeeded"
