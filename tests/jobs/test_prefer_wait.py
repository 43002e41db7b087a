"""`Prefer: wait=N` on POST /api/v1/jobs/: the finished job when it ends in time, else the usual 201."""
from __future__ import annotations

import json

import pytest


def submit_waiting(client, prefer: str, **fields):
    body = {"model": "tiny-sd", "prompt": "a lighthouse at dusk", "steps": 4} | fields
    return client.post("/api/v1/jobs/", data=json.dumps(body), content_type="application/json", HTTP_PREFER=prefer)


def test_a_job_that_ends_within_the_wait_is_answered_finished(stack, api):
    response = submit_waiting(api, "wait=60")
    assert response.status_code == 201, response.content
    assert response["Preference-Applied"] == "wait=60"
    body = response.json()
    assert body["status"] == "succeeded" and len(body["outputs"]) == 1 and body["finished_at"]


def test_an_asked_wait_above_the_cap_is_cut_to_it(stack, api, settings):
    settings.PREFER_WAIT_MAX_SECONDS = 30
    response = submit_waiting(api, "respond-async, wait=600")
    assert response.status_code == 201, response.content
    assert response["Preference-Applied"] == "wait=30"
    assert response.json()["status"] == "succeeded"


@pytest.mark.django_db
def test_a_job_still_running_after_the_wait_gets_the_usual_201(api, settings):
    settings.PREFER_WAIT_MAX_SECONDS = 1  # no workers here: the job stays queued for the whole wait
    response = submit_waiting(api, "wait=5")
    assert response.status_code == 201, response.content
    assert "Preference-Applied" not in response
    assert response.json()["status"] == "queued"


@pytest.mark.django_db
@pytest.mark.parametrize("prefer", ["wait=0", "wait=soon", "handling=strict", ""])
def test_no_usable_wait_answers_at_once_as_without_the_header(api, prefer):
    response = submit_waiting(api, prefer)
    assert response.status_code == 201, response.content
    assert "Preference-Applied" not in response and response.json()["status"] == "queued"


@pytest.mark.django_db
def test_waits_are_off_when_the_cap_is_zero(api, settings):
    settings.PREFER_WAIT_MAX_SECONDS = 0
    response = submit_waiting(api, "wait=10")
    assert response.status_code == 201 and "Preference-Applied" not in response
