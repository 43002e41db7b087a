"""Admission's headwind: better classes' recent arrivals stretch a long job's expected wait (issue 16, item 5).

A video waits for the work ahead of it and also for the images that arrive
while it waits (they preempt it at every chunk boundary). Admission divides
the work ahead by the cards left after the better classes' share, measured
over GENSERVER_HEADWIND_WINDOW seconds of accepted arrivals.
"""

from __future__ import annotations

import pytest

from genserver.jobs.models import JobStatus
from genserver.scheduling.admission import MAX_HIGHER_SHARE, Headwind, headwind
from tests.conftest import submit
from tests.support.jobs import make_job

pytestmark = pytest.mark.django_db

VIDEO_81 = {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 81, "steps": 50}


def test_the_headwind_is_the_better_classes_share_of_the_cards():
    recent = {"short": 30.0, "medium": 60.0, "long": 500.0}
    assert headwind(recent, "short", 300.0, 2.0) == Headwind(0.0, 0.0)  # nothing is better than short
    assert headwind(recent, "medium", 300.0, 2.0).higher_share == pytest.approx(30 / 300 / 2)
    assert headwind(recent, "long", 300.0, 2.0, 0.05).higher_share == pytest.approx(90 / 300 / 2)
    assert headwind({"short": 1e9}, "long", 300.0, 1.0).higher_share == MAX_HIGHER_SHARE  # finite at saturation
    assert Headwind(0.5, 0.1).stretch() == pytest.approx(1.1 / 0.5)
    with pytest.raises(ValueError):
        Headwind(1.0)


def test_recent_images_make_admission_refuse_a_video_it_would_take_on_the_work_ahead_alone(
    api, make_user, long_limit, settings
):
    first = submit(api, **VIDEO_81)
    assert first.status_code == 201, first.content
    backlog = first.json()["estimated_seconds"]  # wall seconds: the one card's work ahead of a new video
    # Images that arrived over the window and already ran: no backlog, but a share of the one card.
    # (At full scale: the test clock would make 40 images a negligible share of any window.)
    settings.HEADWIND_WINDOW_SECONDS = 30.0
    imager = make_user("imager").user
    images = [make_job(imager, status=JobStatus.SUCCEEDED, stage="done", clock_scale=1.0) for _ in range(40)]
    share = sum(j.estimated_seconds * j.clock_scale for j in images) / 30.0
    assert 0.2 < share < MAX_HIGHER_SHARE, share
    stretched = backlog / (1 - share)
    long_limit((backlog + stretched) / 2)  # enough for the work ahead, not for it with the images' share

    refused = submit(api, **VIDEO_81, prompt="behind the images")
    assert refused.status_code == 429, refused.content
    assert refused.json()["expected_wait_seconds"] == pytest.approx(stretched, abs=0.05)
    queues = {q["name"]: q for q in api.get("/api/v1/queues/").json()}
    assert queues["long"]["accepting"] is False  # the queue picture reasons as admission does

    settings.HEADWIND_WINDOW_SECONDS = 0  # off: the work ahead alone, and the same video is accepted
    accepted = submit(api, **VIDEO_81, prompt="behind the images")
    assert accepted.status_code == 201, accepted.content
    own = accepted.json()["estimated_seconds"]
    assert api.get(f"/api/v1/jobs/{accepted.json()['id']}/").json()["eta_seconds"] == pytest.approx(
        backlog + own, abs=0.01
    )
    # Its ETA reasons as admission does: with the images' share, the wait ahead of it is stretched, and so is
    # its own denoising (the images that arrive while it runs take its card at its boundaries).
    settings.HEADWIND_WINDOW_SECONDS = 30.0
    eta = api.get(f"/api/v1/jobs/{accepted.json()['id']}/").json()["eta_seconds"]
    assert eta == pytest.approx(stretched + own / (1 - share), abs=0.01)
