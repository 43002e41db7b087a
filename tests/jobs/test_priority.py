"""Staff re-prioritise a job within its class (POST /api/v1/jobs/{id}/priority/ and the admin's action), without
workers: the bounds, who may, the states, and that the waiting broker message really moves."""

from __future__ import annotations

import json
import uuid

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from genserver.jobs import broker
from genserver.jobs.models import Job
from genserver.redis_client import client as redis_client
from tests.conftest import submit

pytestmark = [
    pytest.mark.django_db(transaction=True),  # the service publishes on commit
    pytest.mark.usefixtures("empty_broker"),
]


def move(client, job_id, body):
    data = body if isinstance(body, str) else json.dumps(body)
    return client.post(f"/api/v1/jobs/{job_id}/priority/", data=data, content_type="application/json")


def waiting_at(queue: str, job_id: str) -> list[int]:
    """The priorities at which a message of the job waits on `queue` (kombu's list per priority)."""
    r = redis_client()
    return [
        p for p, key in enumerate(broker.queue_keys(queue)) for raw in r.lrange(key, 0, -1) if job_id.encode() in raw
    ]


@pytest.fixture
def staff(make_user):
    return make_user("root", staff=True)


def test_staff_move_a_job_ahead_within_its_class_and_the_broker_order_follows(api, staff):
    first = submit(api).json()  # sdxl-sim: short, priority 1
    second = submit(api).json()
    assert first["duration_class"] == "short" and waiting_at("encode", second["id"]) == [1]
    assert api.get(f"/api/v1/jobs/{second['id']}/").json()["queue_position"] == 1
    response = move(staff, second["id"], {"priority": 0})
    assert response.status_code == 200, response.json()
    assert Job.objects.get(pk=second["id"]).priority == 0
    assert waiting_at("encode", second["id"]) == [0]  # withdrawn at 1, re-published at 0: one message
    assert waiting_at("encode", first["id"]) == [1]
    # A worker pops priority 0 first: the second job is now the first served, and the API says so.
    assert response.json()["queue_position"] == 0
    assert api.get(f"/api/v1/jobs/{first['id']}/").json()["queue_position"] == 1
    # The quote follows the new position.
    moved = api.get(f"/api/v1/jobs/{second['id']}/").json()
    assert moved["expected_start_at"] <= api.get(f"/api/v1/jobs/{first['id']}/").json()["expected_start_at"]


def test_a_waiting_chunk_is_republished_on_its_class_queue(api, staff):
    from genserver.jobs import services

    job_id = submit(api, model="wan-sim", prompt="a harbour").json()["id"]  # long, priority 8
    services.start_encoding(job_id, "encode@test")
    services.finish_encoding(job_id, "encode@test", "embeddings/x")
    queue = Job.objects.get(pk=job_id).queue
    assert waiting_at(queue, job_id) == [8]
    assert move(staff, job_id, {"priority": 6}).status_code == 200
    assert waiting_at(queue, job_id) == [6]
    assert Job.objects.get(pk=job_id).queue == queue  # the queue stays: never across classes


@pytest.mark.parametrize("priority", [4, 9, 0])
def test_a_priority_of_another_class_is_a_400_naming_the_band(api, staff, priority):
    job_id = submit(api, model="wan-sim", prompt="a harbour").json()["id"] if priority == 0 else None
    job_id = job_id or submit(api).json()["id"]
    before = Job.objects.get(pk=job_id).priority
    response = move(staff, job_id, {"priority": priority})
    assert response.status_code == 400
    assert "priority" in response.json()
    assert Job.objects.get(pk=job_id).priority == before


@pytest.mark.parametrize("body", [{}, {"priority": True}, {"priority": "first"}, {"priority": 1, "x": 1}, "[1]"])
def test_a_bad_body_is_a_400(api, staff, body):
    job_id = submit(api).json()["id"]
    response = move(staff, job_id, body)
    assert response.status_code == 400, response.json()


def test_only_staff_may_and_unknown_or_ended_jobs_are_refused(api, staff):
    job_id = submit(api).json()["id"]
    refused = move(api, job_id, {"priority": 0})  # the owner, not staff
    assert refused.status_code == 403 and refused.json()["reason"] == "staff_only"
    assert move(api, uuid.uuid4(), {"priority": 0}).status_code == 403  # no hint whether it exists
    assert Job.objects.get(pk=job_id).priority == 1
    assert move(staff, uuid.uuid4(), {"priority": 0}).status_code == 404
    api.post(f"/api/v1/jobs/{job_id}/cancel/")
    ended = move(staff, job_id, {"priority": 0})
    assert ended.status_code == 409 and ended.json()["reason"] == "finished"
    assert ended.json()["status"] == "cancelled" and Job.objects.get(pk=job_id).priority == 1


def test_the_admin_action_moves_to_the_front_of_the_class_through_the_service(api):
    video = submit(api, model="wan-sim", prompt="a harbour").json()["id"]  # long: 8
    image = submit(api).json()["id"]  # short: 1
    ended = submit(api).json()["id"]
    api.post(f"/api/v1/jobs/{ended}/cancel/")
    root = get_user_model().objects.create_superuser("admin", "admin@example.com", "pw")
    browser = Client()
    browser.force_login(root)
    response = browser.post(
        "/admin/jobs/job/", {"action": "move_to_front", "_selected_action": [video, image, ended]}, follow=True
    )
    assert response.status_code == 200
    notes = [str(m) for m in response.context["messages"]]
    assert any("Re-prioritised 2 job(s); 1 had ended" in note for note in notes), notes
    assert Job.objects.get(pk=video).priority == 6 and waiting_at("encode", video) == [6]
    assert Job.objects.get(pk=image).priority == 0 and waiting_at("encode", image) == [0]
    assert Job.objects.get(pk=ended).priority == 1 and Job.objects.get(pk=ended).status == "cancelled"
