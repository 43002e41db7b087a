"""One clock: under GENSERVER_TIME_SCALE ≠ 1 every figure the service shows and decides on is wall seconds.

The tests run at a time scale of 0.002 (tests/settings.py): a simulated job's
work counts its modelled seconds × 0.002 in its estimate, its ETA, the queue
backlog, the expected wait admission compares with the class limit, and
Retry-After. (The duration class is the size of the work in the cost model's
seconds: a video stays long work at any time scale.)
"""

from __future__ import annotations

import math

import pytest
from django.conf import settings

from genserver.jobs.models import Job
from tests.conftest import submit

pytestmark = pytest.mark.django_db

VIDEO_241 = {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 241, "steps": 50}  # 1,995 s of work
VIDEO_81 = {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 81, "steps": 50}  # 665 s of work


def test_the_time_scale_applies_to_estimates_queues_admission_and_retry_after(api, long_limit):
    scale = settings.TIME_SCALE
    assert scale != 1.0
    # The README's demo: a 241-frame video, then an 81-frame one. With a 1,800 s wall limit the second
    # waits ~4 s of wall time and is accepted (counting modelled seconds, 1,995 s > 1,800 s refused it).
    long_limit(1800.0)
    first = submit(api, **VIDEO_241)
    assert first.status_code == 201, first.content
    first = first.json()
    row = Job.objects.get(pk=first["id"])
    assert row.clock_scale == scale
    assert first["estimated_seconds"] == pytest.approx(row.estimated_seconds * scale, rel=1e-3)
    second = submit(api, **VIDEO_81, prompt="the second clip")
    assert second.status_code == 201, second.content
    second = second.json()

    # The queue figures are the same clock as the estimates: the backlog is the two estimates, the
    # wait of a new long job is that backlog over the one card, and the second job's ETA is both.
    queues = {q["name"]: q for q in api.get("/api/v1/queues/").json()}
    backlog = first["estimated_seconds"] + second["estimated_seconds"]
    assert queues["long"]["backlog_seconds"] == pytest.approx(backlog, rel=1e-3)
    assert queues["long"]["expected_wait_seconds"] == pytest.approx(backlog, rel=1e-3)
    assert queues["long"]["accepting"] is True
    eta = api.get(f"/api/v1/jobs/{second['id']}/").json()["eta_seconds"]
    assert eta == pytest.approx(backlog, rel=1e-3)

    # A limit below that wall-clock wait refuses, and Retry-After is on the same clock.
    long_limit(round(backlog / 2, 3))
    refused = submit(api, **VIDEO_81, prompt="one too many")
    assert refused.status_code == 429, refused.content
    body = refused.json()
    assert body["expected_wait_seconds"] == pytest.approx(backlog, abs=0.05)  # the body shows 0.1 s
    assert body["limit_seconds"] == pytest.approx(backlog / 2, abs=0.05)
    assert int(refused["Retry-After"]) == body["retry_after"] == math.ceil(backlog - round(backlog / 2, 3))
