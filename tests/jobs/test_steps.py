"""POST /api/v1/jobs/{id}/steps/ without workers: validation, ownership, states, admission, the transitions."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from genserver.jobs import services
from genserver.jobs.models import Job, JobStatus
from genserver.redis_client import STEPS_KEY, client as redis_client
from tests.conftest import submit
from tests.support.broker import capture_sends

pytestmark = pytest.mark.django_db(transaction=True)  # the service publishes on commit

SNAPSHOT_FIELDS = (
    "status",
    "stage",
    "steps",
    "steps_requested",
    "estimated_seconds",
    "priority",
    "chunk_steps",
    "checkpoint_step",
    "lease_owner",
)


def change(client, job_id, body) -> object:
    data = body if isinstance(body, str) else json.dumps(body)
    return client.post(f"/api/v1/jobs/{job_id}/steps/", data=data, content_type="application/json")


def snapshot(job_id) -> tuple:
    job = Job.objects.get(pk=job_id)
    return tuple(getattr(job, f) for f in SNAPSHOT_FIELDS)


@pytest.fixture
def sent(monkeypatch):
    """The messages the job service publishes (no broker needed): [(task, args...)]."""
    return capture_sends(monkeypatch, "send_chunk", "send_decode", "send_encode")


def denoising(job_id, *, done: int, held_by: str = "") -> Job:
    """Put a submitted job where a worker would have it: `done` steps checkpointed, held or waiting."""
    fields = dict(
        status=JobStatus.DENOISING,
        stage="denoising" if held_by else "waiting",
        checkpoint_step=done,
        steps_done=done,
        checkpoint_key=f"checkpoints/{job_id}/step-{done:05d}.pt" if done else "",
        embeddings_key="embeddings/x.pt",
        lease_owner=held_by,
        lease_expires_at=timezone.now() + timedelta(seconds=60) if held_by else None,
    )
    Job.objects.filter(pk=job_id).update(**fields)
    return Job.objects.get(pk=job_id)


@pytest.mark.parametrize(
    "body, bad_field",
    [
        ({"steps": "many"}, "steps"),
        ({"steps": True}, "steps"),
        ({"steps": 0}, "steps"),
        ({"steps": -4}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"steps": 101}, "steps"),  # sdxl-sim's max_steps is 100
        ({"steps": None}, "steps"),
        ({}, "steps"),
        ({"steps": 10, "guidance_scale": 3}, "guidance_scale"),
        ("[1, 2]", "non_field_errors"),
    ],
)
def test_a_bad_body_is_400_with_field_errors_and_changes_nothing(api, body, bad_field):
    job_id = submit(api, steps=20).json()["id"]
    before = snapshot(job_id)
    response = change(api, job_id, body)
    assert response.status_code == 400, response.content
    assert bad_field in response.json(), response.json()
    assert snapshot(job_id) == before


def test_not_json_is_refused(api):
    job_id = submit(api, steps=20).json()["id"]
    response = api.post(
        f"/api/v1/jobs/{job_id}/steps/", data="steps=5", content_type="application/x-www-form-urlencoded"
    )
    assert response.status_code == 415


def test_another_users_job_or_an_unknown_id_is_404_and_anonymous_is_401(make_user):
    alice, bob = make_user("alice"), make_user("bob")
    job_id = submit(alice, steps=20).json()["id"]
    before = snapshot(job_id)
    assert change(bob, job_id, {"steps": 10}).status_code == 404
    assert change(alice, "00000000-0000-0000-0000-000000000000", {"steps": 10}).status_code == 404
    assert change(APIClient(), job_id, {"steps": 10}).status_code == 401
    assert snapshot(job_id) == before


def test_a_queued_job_takes_the_new_total_and_keeps_the_asked_one(api, sent):
    body = submit(api, steps=20).json()
    sent.clear()  # its encode message
    cost = Job.objects.get(pk=body["id"]).estimated_seconds
    response = change(api, body["id"], {"steps": 30})
    assert response.status_code == 202, response.content
    after = response.json()
    assert after["steps"] == 30 and after["steps_requested"] == 20 and after["status"] == "queued"
    assert after["progress"] == {"step": 0, "total_steps": 30}
    assert Job.objects.get(pk=body["id"]).estimated_seconds == pytest.approx(cost * 1.5)
    assert body["steps_requested"] == 20  # before any change: the same as steps
    # Again, fewer: still the submit's total is kept.
    again = change(api, body["id"], {"steps": 8}).json()
    assert again["steps"] == 8 and again["steps_requested"] == 20
    assert Job.objects.get(pk=body["id"]).estimated_seconds == pytest.approx(cost * 0.4)
    assert redis_client().get(STEPS_KEY.format(job_id=body["id"])) == b"8"
    assert sent == []  # nothing new: its encode message is still the one queued
    assert change(api, body["id"], {"steps": 8}).status_code == 202  # the same total: nothing to do


@pytest.mark.parametrize("status", ["decoding", "succeeded", "failed", "cancelled"])
def test_too_late_is_409_with_the_reason_and_changes_nothing(api, status):
    job_id = submit(api, steps=20).json()["id"]
    Job.objects.filter(pk=job_id).update(status=status)
    before = snapshot(job_id)
    response = change(api, job_id, {"steps": 30})
    assert response.status_code == 409, response.content
    body = response.json()
    assert body["reason"] == ("too_late" if status == "decoding" else "finished") and body["status"] == status
    assert "detail" in body
    assert snapshot(job_id) == before


def test_a_job_being_cancelled_is_409(api):
    job_id = submit(api, steps=20).json()["id"]
    denoising(job_id, done=3, held_by="card0:1")
    api.post(f"/api/v1/jobs/{job_id}/cancel/")  # held: the worker ends it; for now it is cancelling
    before = snapshot(job_id)
    response = change(api, job_id, {"steps": 5})
    assert response.status_code == 409 and response.json()["reason"] == "cancelling"
    assert snapshot(job_id) == before


def test_extending_over_the_class_limit_is_429_with_retry_after_and_changes_nothing(api, sent):
    # ~2,960 s of video work: accepted alone; 20 % more would wait behind the job's own work (> 1,800 s).
    job_id = submit(api, model="wan-sim", width=1280, height=720, steps=50).json()["id"]
    sent.clear()  # its encode message
    before = snapshot(job_id)
    response = change(api, job_id, {"steps": 60})
    assert response.status_code == 429, response.content
    body = response.json()
    assert body["reason"] == "overloaded" and body["duration_class"] == "long"
    assert int(response["Retry-After"]) == body["retry_after"] >= 1
    assert body["expected_wait_seconds"] > body["limit_seconds"]
    assert snapshot(job_id) == before
    assert redis_client().get(STEPS_KEY.format(job_id=job_id)) is None and sent == []
    # Fewer steps are never refused.
    assert change(api, job_id, {"steps": 40}).status_code == 202


def test_a_waiting_job_asked_for_no_more_than_its_steps_done_goes_to_decode(api, sent):
    job_id = submit(api, steps=20).json()["id"]
    sent.clear()  # its encode message
    job = denoising(job_id, done=6)
    response = change(api, job_id, {"steps": 4})
    assert response.status_code == 202, response.content
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.stage, job.steps, job.steps_requested, job.steps_done) == ("decoding", "waiting", 6, 20, 6)
    assert sent == [("decode", job.pk, job.priority, job.model)]
    assert response.json()["progress"] == {"step": 6, "total_steps": 6}
    # Its pending chunk message finds it decoding and does nothing; a repeat is now too late.
    assert services.claim_chunk(job_id, "card0:1", 6) is None
    assert change(api, job_id, {"steps": 3}).status_code == 409


def test_a_waiting_job_given_more_steps_continues_with_them(api, sent):
    job_id = submit(api, model="flux-sim", steps=20).json()["id"]
    sent.clear()  # its encode message
    denoising(job_id, done=5)
    before = Job.objects.get(pk=job_id)
    assert change(api, job_id, {"steps": 12}).status_code == 202
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.steps, job.steps_requested, job.checkpoint_step) == ("denoising", 12, 20, 5)
    assert job.estimated_seconds == pytest.approx(before.estimated_seconds * 12 / 20)
    if job.priority != before.priority:  # re-published at its new priority; the older message is a harmless duplicate
        assert sent == [("chunk", job.pk, 5, job.queue, job.priority, job.model)]
    claimed = services.claim_chunk(job_id, "card0:1", 5)
    assert claimed is not None and claimed.steps == 12
    assert services.claim_chunk(job_id, "card0:2", 5) is None  # the duplicate


def test_a_held_job_is_told_through_redis_and_released_by_its_worker(api, sent):
    job_id = submit(api, steps=20).json()["id"]
    sent.clear()  # its encode message
    denoising(job_id, done=4, held_by="card0:1")
    assert change(api, job_id, {"steps": 5}).status_code == 202
    job = Job.objects.get(pk=job_id)
    # Still held and denoising: the worker decides at its next step.
    assert (job.status, job.lease_owner, job.steps) == ("denoising", "card0:1", 5)
    assert redis_client().get(STEPS_KEY.format(job_id=job_id)) == b"5"
    # It had done 7 by then: it saves step 7 and stops there; the job decodes that (steps = 7).
    assert not services.release_for_new_total(job_id, "card0:other", 7, "checkpoints/x/step-00007.pt")
    assert services.release_for_new_total(job_id, "card0:1", 7, f"checkpoints/{job_id}/step-00007.pt")
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.steps, job.steps_done, job.checkpoint_step, job.lease_owner) == ("decoding", 7, 7, 7, "")
    assert job.steps_requested == 20 and sent == [("decode", job.pk, job.priority, job.model)]
    assert not services.release_for_new_total(job_id, "card0:1", 7, "")  # a repeat does nothing


def test_a_held_job_given_more_steps_is_republished_from_where_its_worker_stopped(api, sent):
    job_id = submit(api, steps=20).json()["id"]
    sent.clear()  # its encode message
    denoising(job_id, done=4, held_by="card0:1")
    assert change(api, job_id, {"steps": 30}).status_code == 202
    assert services.release_for_new_total(job_id, "card0:1", 6, f"checkpoints/{job_id}/step-00006.pt")
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.stage, job.steps, job.checkpoint_step, job.lease_owner) == (
        "denoising",
        "waiting",
        30,
        6,
        "",
    )
    assert sent == [("chunk", job.pk, 6, job.queue, job.priority, job.model)]
    # Stopped before any new step (no checkpoint): continues from the recorded one.
    denoising(job_id, done=6, held_by="card0:2")
    Job.objects.filter(pk=job_id).update(steps=40)
    assert services.release_for_new_total(job_id, "card0:2", 6, "")
    assert Job.objects.get(pk=job_id).checkpoint_step == 6 and sent[-1][:3] == ("chunk", job.pk, 6)


def test_a_chunk_that_ran_past_a_lowered_total_ends_the_job_at_its_steps(api, sent):
    """The worker missed the Redis flag (or finished its chunk first): finish_chunk applies the DB's total."""
    job_id = submit(api, steps=20).json()["id"]
    sent.clear()  # its encode message
    denoising(job_id, done=4, held_by="card0:1")
    assert change(api, job_id, {"steps": 5}).status_code == 202
    assert services.finish_chunk(job_id, "card0:1", 8, f"checkpoints/{job_id}/step-00008.pt", None, keep_lease=True)
    job = Job.objects.get(pk=job_id)
    assert (job.status, job.steps, job.steps_done, job.lease_owner) == ("decoding", 8, 8, "")
    assert sent == [("decode", job.pk, job.priority, job.model)]


def test_the_endpoint_is_in_the_schema():
    schema = json.loads(APIClient().get("/api/schema/", HTTP_ACCEPT="application/json").content)
    operation = schema["paths"]["/api/v1/jobs/{job_id}/steps/"]["post"]
    assert {"202", "400", "404", "409", "429"} <= set(operation["responses"])
    assert "steps_requested" in schema["components"]["schemas"]["Job"]["properties"]


def test_a_long_video_made_in_segments_cannot_change_its_steps(api):
    job_id = submit(api, model="wan-sim", steps=20).json()["id"]
    Job.objects.filter(pk=job_id).update(segment_count=3)
    before = snapshot(job_id)
    response = change(api, job_id, {"steps": 10})
    assert response.status_code == 409 and response.json()["reason"] == "segmented"
    assert snapshot(job_id) == before
