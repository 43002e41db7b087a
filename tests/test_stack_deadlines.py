"""Start deadlines and re-prioritising through the whole stack (real workers and beat).

card0, the only card, stops consuming its queues (tests/test_stack_merging.py's `card_paused`) while it
still heartbeats: the quote at submit counts it, so a `start_within` job is admitted, and then cannot start.
"""

from __future__ import annotations

import json

import pytest

from genserver.jobs.models import Job
from tests.support.api import submit
from tests.support.waits import finished, job_row, wait_for
from tests.test_stack_merging import card_paused, waiting

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]


def test_a_job_that_cannot_start_by_its_deadline_ends_expired_and_never_runs(stack, api):
    with card_paused(stack):
        response = submit(api, prompt="a lighthouse, quickly", steps=4, start_within=1)
        assert response.status_code == 201, response.json()
        quoted = response.json()
        assert quoted["expected_start_at"] and quoted["expected_finish_at"] and quoted["start_deadline"]
        job = finished(quoted["id"], timeout=60)  # beat's sweeper (or the claim of a late message) ends it
    assert job.status == "expired" and job.stage == "expired", job.error
    assert "start deadline passed" in job.error
    shown = api.get(f"/api/v1/jobs/{job.pk}/").json()
    assert shown["status"] == "expired" and shown["error"] == job.error and shown["eta_seconds"] is None

    # card0 takes work again: a plain job runs to the end, and the expired one stayed untouched (never half-run).
    after = finished(submit(api, prompt="after the pause", steps=4).json()["id"])
    assert after.status == "succeeded", after.error
    job = job_row(job.pk)
    assert job.status == "expired" and job.started_at is None
    assert job.steps_done == 0 and job.chunks_run == 0 and job.checkpoint_step == 0 and not job.outputs


def test_a_job_moved_to_the_front_of_its_class_starts_first(stack, api, make_user):
    staff = make_user("root", staff=True)
    shape = {"model": "sdxl-sim"}  # short, priority 1
    with card_paused(stack):
        first, second = (submit(api, prompt=p, **shape).json()["id"] for p in ("first in", "moved ahead"))
        wait_for(lambda: waiting([first, second]), 60, what="both jobs encoded and waiting for the card")
        assert job_row(first).priority == job_row(second).priority == 1
        moved = staff.post(
            f"/api/v1/jobs/{second}/priority/", data=json.dumps({"priority": 0}), content_type="application/json"
        )
        assert moved.status_code == 200 and moved.json()["queue_position"] == 0
    jobs = [finished(pk) for pk in (first, second)]
    assert [j.status for j in jobs] == ["succeeded", "succeeded"], [j.error for j in jobs]
    assert jobs[1].started_at < jobs[0].started_at  # the card took the re-published message first
    assert Job.objects.get(pk=second).duration_class == "short"
