"""Quotas through the whole stack: a job's measured card time is settled into the day's usage when it ends."""

from __future__ import annotations

import pytest

from genserver.jobs import services
from genserver.jobs.models import Quota
from genserver.jobs.services.quotas import charge_of
from tests.support.api import submit
from tests.support.waits import finished, job_row, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]


def test_a_jobs_measured_card_time_is_settled_into_the_days_usage(stack, api):
    response = submit(api, model="tiny-sd", prompt="a red fox", width=64, height=64, steps=6)
    assert response.status_code == 201, response.json()
    job_id = response.json()["id"]
    job = finished(job_id)
    assert job.status == "succeeded", job.error
    estimate = job.estimated_seconds * job.clock_scale
    # Each recorded chunk added its measured seconds on the card; the day's usage counts them from the
    # moment the job ended, and the job service then writes them down as the job's charge.
    assert job.card_seconds > 0 and job.card_seconds != pytest.approx(estimate, rel=1e-9)
    usage = api.get("/api/v1/usage/").json()["card_seconds_per_day"]
    assert usage["used"] == pytest.approx(job.card_seconds, abs=1e-3)
    wait_for(lambda: job_row(job_id).charged_card_seconds == job.card_seconds, 30, what="the charge settled")

    # The settled time is what the quota counts: with the day's quota just above it, a new job's
    # estimate no longer fits and the submit is refused until midnight UTC, recording nothing.
    # The quota is the new job's charge as admission reckons it now, plus half the settled time: it fits an
    # empty day, not this one. (Not from the first job's estimate: the step-time correction learned from the
    # first job, and from earlier tests of the session, moves the next estimate, once by more than half.)
    shape = ("model", "width", "height", "num_frames", "steps", "guidance_scale", "num_outputs")
    next_estimate = services.estimate({name: getattr(job, name) for name in shape})
    charge = charge_of(next_estimate.seconds, next_estimate.clock_scale)
    Quota.objects.create(user=api.user, card_seconds_per_day=charge + job.card_seconds / 2)
    refused = submit(api, model="tiny-sd", prompt="one more", width=64, height=64, steps=6)
    assert refused.status_code == 429, refused.json()
    body = refused.json()
    assert body["reason"] == "card_seconds_per_day" and int(refused["Retry-After"]) >= 1
    assert body["used"] == pytest.approx(job.card_seconds, abs=1e-3)
    assert api.get("/api/v1/jobs/").json()["count"] == 1
