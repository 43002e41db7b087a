"""Django admin for jobs: staff only, filters and search answer, actions go through the job service."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from genserver.jobs.models import Job

pytestmark = pytest.mark.django_db


def submit(api, **fields):
    body = {"model": "sdxl-sim", "prompt": "a lighthouse"} | fields
    return api.post("/api/v1/jobs/", data=json.dumps(body), content_type="application/json").json()["id"]


@pytest.fixture
def admin_client():
    user = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


def test_admin_lists_filters_and_searches_jobs(admin_client, api):
    submit(api, prompt="a red fox")
    submit(api, model="wan-sim", prompt="a blue whale")
    assert admin_client.get("/admin/jobs/job/").status_code == 200
    filtered = admin_client.get("/admin/jobs/job/?duration_class__exact=long&status__exact=queued")
    assert [j.model for j in filtered.context["cl"].result_list] == ["wan-sim"]
    found = admin_client.get("/admin/jobs/job/?q=fox")
    assert [j.model for j in found.context["cl"].result_list] == ["sdxl-sim"]


def test_admin_cancel_action_cancels_through_the_service(admin_client, api):
    job_id = submit(api)
    response = admin_client.post("/admin/jobs/job/", {"action": "cancel_jobs", "_selected_action": [job_id]})
    assert response.status_code == 302
    assert Job.objects.get(pk=job_id).status == "cancelled"


def test_admin_is_staff_only(api):
    submit(api)
    user = get_user_model().objects.create_user("mallory", password="pw")
    client = Client()
    client.force_login(user)
    assert client.get("/admin/jobs/job/").status_code == 302  # sent to the login page
    assert Job.objects.get().status == "queued"
