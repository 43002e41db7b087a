"""An Idempotency-Key makes a retried submit return the same job instead of a second one."""

from __future__ import annotations

import json

import pytest

from genserver.jobs.models import Job

pytestmark = pytest.mark.django_db


def post(client, key: str | None, **fields):
    body = {"model": "sdxl-sim", "prompt": "a lighthouse"} | fields
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key else {}
    return client.post("/api/v1/jobs/", data=json.dumps(body), content_type="application/json", **headers)


def test_retry_with_the_same_key_returns_the_same_job(api):
    first = post(api, "retry-1")
    again = post(api, "retry-1")  # no seed given: the retry's drawn seed must not count
    assert first.status_code == 201 and again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert first.json()["id"] == again.json()["id"] and Job.objects.count() == 1


def test_the_same_key_for_a_different_request_is_refused(api):
    assert post(api, "k", prompt="a fox").status_code == 201
    conflict = post(api, "k", prompt="a whale")
    assert conflict.status_code == 422 and conflict.json()["reason"] == "idempotency_conflict"
    assert Job.objects.count() == 1


def test_keys_are_per_user_and_requests_without_a_key_are_independent(make_user):
    alice, bob = make_user("alice"), make_user("bob")
    assert post(alice, "shared").json()["id"] != post(bob, "shared").json()["id"]
    assert post(alice, None).json()["id"] != post(alice, None).json()["id"]
    assert Job.objects.count() == 4


def test_a_refused_submit_keeps_the_key_free(api):
    too_long = {"model": "wan-sim", "width": 1280, "height": 720}
    assert post(api, "v1", **too_long).status_code == 201
    assert post(api, "v2", **too_long).status_code == 429  # the long class is full: no row
    api.post(f"/api/v1/jobs/{Job.objects.get().pk}/cancel/")
    assert post(api, "v2", **too_long).status_code == 201  # the retry after Retry-After is a new job


def test_overlong_key_is_a_400(api):
    assert post(api, "x" * 201).status_code == 400 and Job.objects.count() == 0
