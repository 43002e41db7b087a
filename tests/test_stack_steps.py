"""Changing the step count midway through the real stack: real workers, tiny real models, the simulated backend."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from tests.support.api import download, submit
from tests.support.waits import finished, job_row, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]


def change(api, job_id, steps: int):
    return api.post(f"/api/v1/jobs/{job_id}/steps/", data=json.dumps({"steps": steps}), content_type="application/json")


def test_tiny_sd_stopped_early_decodes_what_it_has(stack, api):
    job_id = submit(api, model="tiny-sd", prompt="stop me early", steps=40, width=256, height=256).json()["id"]
    seen = wait_for(lambda: (j := job_row(job_id)).steps_done >= 3 and j, 90, what="three steps")
    response = change(api, job_id, seen.steps_done)  # no more than done: stop at the next step
    assert response.status_code == 202, response.content
    job = finished(job_id)
    assert job.status == "succeeded", job.error
    assert seen.steps_done <= job.steps_done < 40
    assert job.steps == job.steps_done and job.steps_requested == 40
    body = api.get(f"/api/v1/jobs/{job_id}/").json()
    assert body["progress"] == {"step": job.steps_done, "total_steps": job.steps_done}
    assert body["steps"] == job.steps_done and body["steps_requested"] == 40
    (output,) = body["outputs"]
    image = Image.open(io.BytesIO(download(api, output["url"])))
    assert output["content_type"] == "image/png" and image.size == (256, 256)


def test_tiny_sd_extended_runs_the_new_total(stack, api):
    job_id = submit(api, model="tiny-sd", prompt="keep going", steps=40, width=256, height=256).json()["id"]
    wait_for(lambda: job_row(job_id).steps_done >= 2, 90, what="two steps")
    response = change(api, job_id, 50)
    assert response.status_code == 202, response.content
    assert response.json()["steps"] == 50 and response.json()["steps_requested"] == 40
    job = finished(job_id)
    assert job.status == "succeeded", (
        job.error,
        job.steps,
        job.steps_done,
        job.checkpoint_step,
        job.chunks_run,
        job.chunk_steps,
        job.stage,
        job.estimated_seconds,
    )
    assert job.steps == job.steps_done == job.checkpoint_step == 50 and job.steps_requested == 40
    outputs = api.get(f"/api/v1/jobs/{job_id}/").json()["outputs"]
    assert download(api, outputs[0]["url"]).startswith(b"\x89PNG")
    assert change(api, job_id, 45).status_code == 409  # finished


def test_simulated_job_stopped_early_and_another_extended(stack, api):
    body = {"model": "wan-sim", "prompt": "a simulated video"}
    stopped = submit(api, steps=50, **body).json()["id"]
    seen = wait_for(lambda: (j := job_row(stopped)).steps_done >= 4 and j, 90, what="four simulated steps")
    # Submitted once the first holds the card, the second waits behind its continuations (priority 6 before
    # a new long job's 7): submitted together, the shorter (20 steps: priority 7 against 8) could take the
    # card first when both were encoded in one batch, and be done before it is extended.
    extended = submit(api, steps=20, **body).json()["id"]
    wait_for(lambda: job_row(extended).status == "denoising", 90, what="the second encoded, waiting for the card")
    response = change(api, extended, 30)
    assert response.status_code == 202, response.content
    assert change(api, stopped, seen.steps_done).status_code == 202
    first, second = finished(stopped), finished(extended)
    assert first.status == second.status == "succeeded", (first.error, second.error)
    assert first.steps == first.steps_done < 50 and first.steps_requested == 50
    assert second.steps == second.steps_done == 30 and second.steps_requested == 20
    for job in (first, second):
        outputs = api.get(f"/api/v1/jobs/{job.pk}/").json()["outputs"]
        assert outputs and download(api, outputs[0]["url"]).startswith(b"\x89PNG")


def test_a_member_of_a_merged_batch_stops_early_and_its_partner_goes_on(stack, api):
    from tests.test_stack_merging import card_paused, waiting

    shape = {"model": "tiny-sd", "width": 256, "height": 256, "steps": 40}
    with card_paused(stack):
        ids = [submit(api, prompt=p, seed=s, **shape).json()["id"] for p, s in (("a red fox", 1), ("a boat", 2))]
        wait_for(lambda: waiting(ids), 60, what="both jobs encoded and waiting")
    seen = wait_for(lambda: (j := job_row(ids[0])).steps_done >= 2 and j, 90, what="the batch to start")
    assert change(api, ids[0], seen.steps_done).status_code == 202
    stopped, partner = finished(ids[0]), finished(ids[1])
    assert stopped.status == partner.status == "succeeded", (stopped.error, partner.error)
    assert stopped.steps == stopped.steps_done < 40 and stopped.steps_requested == 40
    assert partner.steps == partner.steps_done == 40 and partner.steps_requested is None
