"""7b. A failed job keeps its latest checkpoint, and the admin's retry resumes there (real stack, tiny-wan).

The fault: the job's last allowed attempt fails mid-denoise (inside its first segment), reported
through the job service as a worker reports an exception (`fail_attempt` with the holder's name,
MAX_ATTEMPTS 1 here), so the job ends `failed` with chunks done. The admin's "retry from last
checkpoint" then re-queues it; the chunks up to the kept checkpoint are not run again, and the
video is the one an uninterrupted run of the same request makes.
"""

from __future__ import annotations

import os
import signal

import pytest
from django.test import Client

from bench import chaos_probe
from genserver.jobs import services
from genserver.storage import default_storage
from tests.support.api import download, submit
from tests.support.waits import finished, job_row, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]

BODY = {
    "model": "tiny-wan",
    "prompt": "a wave retried from its checkpoint",
    "seed": 4321,
    "width": 128,
    "height": 128,
    "steps": 40,
}


def _fail_mid_denoise(stack, job_id):
    """Fail the job's attempt while its card holds it mid-denoise, as the worker reports an exception.

    The card is frozen (SIGSTOP) while the row is read and the failure recorded, so the job cannot
    finish its segment between the two; polling alone lost that race on a loaded machine.
    """
    card = stack.child("card0").process
    while True:
        row = wait_for(lambda: _held_mid_denoise(job_id), 90, what="the job held mid-denoise")
        os.killpg(card.pid, signal.SIGSTOP)
        try:
            row = job_row(job_id)
            if row.status == "denoising" and row.lease_owner and 5 <= row.checkpoint_step < row.steps:
                services.fail_attempt(job_id, row.lease_owner, "RuntimeError: injected fault mid-denoise")
                return job_row(job_id)
        finally:
            os.killpg(card.pid, signal.SIGCONT)


def _held_mid_denoise(job_id):
    row = job_row(job_id)
    if row.is_terminal:
        raise AssertionError(f"the job ended {row.status} before the fault: make it longer")
    if row.checkpoint_step >= row.steps:
        raise AssertionError(f"the job's first segment ended before the fault ({row.checkpoint_step} steps)")
    return row if row.lease_owner and row.checkpoint_step >= 5 else None


@pytest.mark.parametrize("frames", [9, 17], ids=["one-segment", "two-segments"])  # tiny-wan's segment_frames: 9
def test_a_failed_video_resumes_at_its_kept_checkpoint_when_the_admin_retries_it(stack, api, settings, frames):
    from django.contrib.auth import get_user_model

    body = BODY | {"num_frames": frames}
    job_id = submit(api, **body).json()["id"]
    settings.MAX_ATTEMPTS = 1  # this process reports the failure: it is the last attempt
    failed = _fail_mid_denoise(stack, job_id)
    assert failed.status == "failed", failed.status
    kept_step, kept_key = failed.checkpoint_step, failed.checkpoint_key
    assert 5 <= kept_step < failed.steps and failed.error.endswith("injected fault mid-denoise")

    # Its latest checkpoint stays (the worker's chunk in flight may add a later file it never
    # recorded); the earlier ones are gone.
    keys = sorted(e.key for e in default_storage().list(f"checkpoints/{job_id}"))
    assert kept_key in keys and all(k >= kept_key for k in keys), (kept_key, keys)

    # The admin's action, as staff use it.
    admin = get_user_model().objects.create_superuser(f"boss{frames}", password="pw")
    browser = Client()
    browser.force_login(admin)
    response = browser.post("/admin/jobs/job/", {"action": "retry_from_checkpoint", "_selected_action": [job_id]})
    assert response.status_code == 302
    retried = job_row(job_id)  # a worker may already be past the checkpoint: never before it
    assert retried.status in ("denoising", "decoding", "succeeded") and retried.attempts == 0
    assert retried.checkpoint_step >= kept_step and retried.steps_done >= kept_step

    job = finished(job_id)
    assert job.status == "succeeded", job.error
    chunks = chaos_probe.chunk_completions(job_id)
    assert all(n == 1 for n in chunks.values()), f"a chunk up to the checkpoint ran again: {chunks}"
    assert kept_step in chunks and max(chunks) == job.total_steps  # before the fault and after the retry
    # Once it succeeded, all its checkpoints go (the worker deletes them right after the commit).
    wait_for(lambda: not list(default_storage().list(f"checkpoints/{job_id}")), 30, what="the checkpoints gone")

    clean = finished(submit(api, **body).json()["id"])
    assert clean.status == "succeeded" and clean.attempts == 0
    resumed = [download(api, o["url"]) for o in api.get(f"/api/v1/jobs/{job_id}/").json()["outputs"]]
    uninterrupted = [download(api, o["url"]) for o in api.get(f"/api/v1/jobs/{clean.pk}/").json()["outputs"]]
    assert resumed == uninterrupted, "the resumed video differs from an uninterrupted run's"
