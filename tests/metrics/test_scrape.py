"""GET /metrics on the real stack: counters and histograms move by what a few jobs did, and who may scrape."""

from __future__ import annotations

import math

import pytest
from django.conf import settings
from django.test import override_settings

from tests.support.api import submit
from tests.support.waits import finished, wait_for

from .scrapes import moved, scrape, value

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]


@pytest.fixture
def ops(make_user):
    """A staff member signed in with a session (what a person scraping from the browser has)."""
    client = make_user("ops", staff=True)
    client.force_login(client.user)
    return client


def test_metrics_move_by_what_the_jobs_did(stack, ops, api):
    before = scrape(ops)

    # 1. Two tiny-sd jobs, one after the other (so neither is merged and each chunk reports its step time).
    jobs = []
    for seed in (1, 2):
        response = submit(api, model="tiny-sd", prompt="a lighthouse, metrics", steps=4, seed=seed)
        assert response.status_code == 201, response.json()
        job = finished(response.json()["id"])
        assert job.status == "succeeded", job.error
        jobs.append(job)
    cls, model = jobs[0].duration_class, "tiny-sd"
    chunks = sum(j.chunks_run for j in jobs)

    def worker_side_recorded():
        # The workers observe these after the job has moved on, so a job seen `succeeded` is no sign of them: the
        # decode worker the delay right after its last transition commits; the card its last chunk's step time,
        # checkpoint bytes and boundary only after that chunk's commit published the decode (tasks/denoise.py),
        # and the wait on its event thread, behind the job's events. Wait for them all, not a sleep.
        now = scrape(ops)
        card = ("genserver_step_seconds", "genserver_checkpoint_bytes", "genserver_chunk_boundary_seconds")
        return (
            all(
                moved(before, now, f"{histogram}_count", **{"class": cls}) >= 2
                for histogram in ("genserver_job_delay_seconds", "genserver_job_wait_seconds")
            )
            and all(moved(before, now, f"{histogram}_count", model=model) >= chunks for histogram in card)
            and now
        )

    after = wait_for(worker_side_recorded, what="the workers' observations of both jobs")
    assert moved(before, after, "genserver_submits_total", **{"class": cls, "outcome": "accepted", "reason": ""}) == 2
    assert moved(before, after, "genserver_jobs", status="succeeded") == 2
    for histogram in ("genserver_job_wait_seconds", "genserver_job_delay_seconds"):
        assert moved(before, after, f"{histogram}_count", **{"class": cls}) == 2, histogram
        assert moved(before, after, f"{histogram}_bucket", **{"class": cls, "le": "+Inf"}) == 2, histogram
    assert moved(before, after, "genserver_decode_seconds_count", model=model) == 2
    assert moved(before, after, "genserver_decode_seconds_sum", model=model) > 0
    for histogram in ("genserver_step_seconds", "genserver_checkpoint_bytes", "genserver_chunk_boundary_seconds"):
        assert moved(before, after, f"{histogram}_count", model=model) == chunks, histogram
    assert moved(before, after, "genserver_checkpoint_bytes_sum", model=model) > 1000 * chunks  # latents, not bytes
    lookups = sum(moved(before, after, "genserver_embedding_cache_total", result=r) for r in ("hit", "miss"))
    assert lookups == 2  # one text-encoder lookup per job (the prompt is the same: the second may hit)
    assert moved(before, after, "genserver_http_requests_total", method="POST", view="job-list", status="201") == 2
    assert moved(before, after, "genserver_http_request_seconds_count", method="POST", view="job-list") == 2

    # 2. A refusal by reason: a user at the in-flight limit, while a long simulated video runs.
    with override_settings(MAX_JOBS_IN_FLIGHT=1):
        video = submit(api, model="wan-sim", prompt="waves at night")
        assert video.status_code == 201, video.json()
        refused = submit(api, model="tiny-sd", prompt="one too many", steps=4)
        assert refused.status_code == 429, refused.json()
    assert api.post(f"/api/v1/jobs/{video.json()['id']}/cancel/").status_code in (200, 202)
    assert finished(video.json()["id"]).status == "cancelled"
    last = scrape(ops)
    video_class = finished(video.json()["id"]).duration_class
    assert (
        moved(after, last, "genserver_submits_total", **{"class": cls, "outcome": "refused", "reason": "in_flight"})
        == 1
    )
    assert (
        moved(after, last, "genserver_submits_total", **{"class": video_class, "outcome": "accepted", "reason": ""})
        == 1
    )
    assert moved(after, last, "genserver_jobs", status="cancelled") == 1
    assert moved(after, last, "genserver_http_requests_total", method="POST", view="job-list", status="429") == 1

    # 3. The scrape-time picture: every class, the live workers and their cards.
    for name in ("short", "medium", "long"):
        assert value(last, "genserver_queue_depth", **{"class": name}) == 0
        assert value(last, "genserver_queue_backlog_seconds", **{"class": name}) == 0
        wait = value(last, "genserver_admission_expected_wait_seconds", **{"class": name})
        assert wait == 0 or math.isinf(wait) or wait > 0
    live = {labels: v for (name, labels), v in last.items() if name == "genserver_live_workers"}
    assert sum(live.values()) == len(stack.names)
    assert sum(v for (name, _), v in last.items() if name == "genserver_live_cards") >= 1  # card0
    (settings.DATA_DIR / "metrics-scrape.txt").write_bytes(ops.get("/metrics").content)  # the README's excerpt
