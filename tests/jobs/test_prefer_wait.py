"""`Prefer: wait=N` on POST /api/v1/jobs/: the finished job when it ends in time, else the usual 201."""

from __future__ import annotations

import json
import urllib.request

import pytest


def submit_waiting(client, prefer: str, **fields):
    body = {"model": "tiny-sd", "prompt": "a lighthouse at dusk", "steps": 4} | fields
    return client.post("/api/v1/jobs/", data=json.dumps(body), content_type="application/json", HTTP_PREFER=prefer)


def submit_over_http(live_server, token: str, prefer: str) -> tuple[int, dict, dict]:
    """As a real client does: over HTTP to the live server (its own thread and database connection)."""
    body = json.dumps({"model": "tiny-sd", "prompt": "a lighthouse at dusk", "steps": 4}).encode()
    request = urllib.request.Request(
        f"{live_server.url}/api/v1/jobs/",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json", "Prefer": prefer},
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        return answer.status, dict(answer.headers), json.loads(answer.read())


@pytest.fixture
def token(transactional_db) -> str:
    from django.contrib.auth import get_user_model

    from genserver.jobs.services import tokens

    return tokens.issue(get_user_model().objects.create_user(username="waiter"))[1]


def test_a_job_that_ends_within_the_wait_is_answered_finished(stack, live_server, token, settings):
    # A generous bound (the first job loads the models on a busy 2-core machine): a failure bound, not a pace.
    settings.PREFER_WAIT_MAX_SECONDS = 300
    code, headers, body = submit_over_http(live_server, token, "wait=300")
    assert code == 201 and headers.get("Preference-Applied") == "wait=300", (headers, body["status"])
    assert body["status"] == "succeeded" and len(body["outputs"]) == 1 and body["finished_at"]


def test_an_asked_wait_above_the_cap_is_cut_to_it(stack, live_server, token, settings):
    settings.PREFER_WAIT_MAX_SECONDS = 240
    code, headers, body = submit_over_http(live_server, token, "respond-async, wait=600")
    assert code == 201 and headers.get("Preference-Applied") == "wait=240", (headers, body["status"])
    assert body["status"] == "succeeded"


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


CARD = {"name": "card0@n1", "queues": ["short", "medium", "long"]}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "live, waits",
    [
        ([], False),  # no worker at all (admission estimates from the configured layout)
        ([CARD], False),  # a card, but no encode worker to run the queued job's next stage
        ([CARD, {"name": "encode@n1", "queues": ["encode", "control", "webhooks"]}], True),  # its encode can run
    ],
)
def test_a_wait_ends_at_once_when_no_live_worker_runs_the_jobs_next_stage(api, settings, monkeypatch, live, waits):
    from genserver import liveness
    from genserver.jobs import selectors

    settings.PREFER_WAIT_MAX_SECONDS = 60
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) >= 3:  # enough to show it waits; the job would stay queued for the whole minute
            monkeypatch.setattr(selectors.waits.time, "monotonic", lambda: float("inf"))

    monkeypatch.setattr(liveness, "payloads", lambda answer: live)  # the live workers, as every read parses them
    monkeypatch.setattr(selectors.waits.time, "sleep", sleep)
    response = submit_waiting(api, "wait=60")
    assert response.status_code == 201 and "Preference-Applied" not in response
    assert response.json()["status"] == "queued"
    assert bool(slept) is waits, slept
