"""The API contract without workers: validation, auth, isolation, models, queues, schema."""

from __future__ import annotations

import json

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from genserver.jobs.models import Job
from tests.conftest import submit

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "fields, bad_field",
    [
        ({"model": "no-such-model"}, "model"),
        ({"width": 4096}, "width"),
        ({"height": 100}, "height"),  # not a multiple of 16
        ({"steps": 0}, "steps"),
        ({"steps": -3}, "steps"),
        ({"steps": 1000}, "steps"),
        ({"steps": "many"}, "steps"),
        ({"width": True}, "width"),
        ({"guidance_scale": "NaN"}, "guidance_scale"),
        ({"guidance_scale": -1}, "guidance_scale"),
        ({"num_outputs": 5}, "num_outputs"),
        ({"num_frames": 81}, "num_frames"),  # an image model
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * 5000}, "prompt"),
        ({"seed": -1}, "seed"),
        ({"preview_every": 500}, "preview_every"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_invalid_request_is_400_with_field_errors_and_no_row(api, fields, bad_field):
    response = submit(api, **fields)
    assert response.status_code == 400, response.content
    assert bad_field in response.json(), response.json()
    assert Job.objects.count() == 0


@pytest.mark.parametrize(
    "field, value, kind",
    [
        ("prompt", 12345, "a number"),
        ("prompt", True, "a boolean"),
        ("prompt", ["a", "fox"], "an array"),
        ("prompt", {"text": "a fox"}, "an object"),
        ("negative_prompt", 7, "a number"),
        ("model", 1.5, "a number"),
        ("lane", 1, "a number"),
        ("webhook_url", 80, "a number"),
        ("webhook_events", [1], "a number"),
    ],
)
def test_string_fields_must_be_json_strings(api, field, value, kind):
    body = {"model": "sdxl-sim", "prompt": "a fox"} | {field: value}
    if field == "webhook_events":
        body["webhook_url"] = "https://example.com/hook"
    response = api.post("/api/v1/jobs/", data=json.dumps(body), content_type="application/json")
    assert response.status_code == 400, response.content
    message = json.dumps(response.json()[field])
    assert "must be a string" in message.lower() and kind in message, message
    assert Job.objects.count() == 0


def test_num_outputs_is_bounded_by_the_models_max_batch(api):
    """faulty-sim (tests/registry-extra.toml) leaves max_batch at its default, 1; sdxl-sim has 4."""
    response = submit(api, model="faulty-sim", num_outputs=2)
    assert response.status_code == 400, response.content
    assert response.json()["num_outputs"] == ["At most 1 output for faulty-sim (its max_batch); ask for fewer."]
    assert Job.objects.count() == 0
    assert submit(api, model="sdxl-sim", num_outputs=4).status_code == 201
    response = submit(api, model="sdxl-sim", num_outputs=5)
    assert response.status_code == 400 and "At most 4 outputs for sdxl-sim" in response.json()["num_outputs"][0]
    models = {m["name"]: m for m in api.get("/api/v1/models/").json()}
    assert models["faulty-sim"]["limits"]["max_outputs"] == 1 and models["sdxl-sim"]["limits"]["max_outputs"] == 4


def test_schema_bounds_num_outputs_by_the_largest_max_batch(api):
    from genserver import deployment

    components = api.get("/api/schema/", HTTP_ACCEPT="application/json").json()["components"]["schemas"]
    largest = max(deployment.registry().get(n).max_batch for n in deployment.registry().names())
    for body, field in (("JobCreate", "num_outputs"), ("ImageGenerationRequest", "n")):
        bounds = components[body]["properties"][field]
        assert (bounds["type"], bounds["minimum"], bounds["maximum"]) == ("integer", 1, largest), bounds


def test_missing_prompt_and_model_are_named(api):
    response = api.post("/api/v1/jobs/", data="{}", content_type="application/json")
    assert response.status_code == 400
    assert {"model", "prompt"} <= set(response.json())


def test_video_frames_must_fit_the_vae(api):
    response = submit(api, model="wan-sim", num_frames=80)
    assert response.status_code == 400 and "num_frames" in response.json()
    assert Job.objects.count() == 0


def test_body_that_is_not_an_object_is_400(api):
    response = api.post("/api/v1/jobs/", data="[1, 2]", content_type="application/json")
    assert response.status_code == 400
    response = api.post("/api/v1/jobs/", data="{not json", content_type="application/json")
    assert response.status_code == 400
    assert Job.objects.count() == 0


def test_submit_fills_defaults_and_estimates(api):
    response = submit(api, width=512, height=512, steps=20)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["status"] == "queued" and body["duration_class"] == "short"
    assert body["progress"] == {"step": 0, "total_steps": 20}
    job = Job.objects.get(pk=body["id"])
    assert round(job.estimated_seconds, 1) == 0.2  # the seed's SDXL 512² · 20 steps row
    assert job.guidance_scale == 5.0 and 0 <= job.seed < 2**32
    assert body["queue_position"] == 0 and body["eta_seconds"] is not None


def test_token_auth_and_issue_token_command(capsys):
    anonymous = APIClient()
    assert anonymous.get("/api/v1/jobs/").status_code == 401
    assert anonymous.post("/api/v1/jobs/", {}, format="json").status_code == 401
    call_command("issue_token", "bob")
    token = capsys.readouterr().out.strip()
    call_command("issue_token", "bob")
    second = capsys.readouterr().out.strip()
    assert second != token  # a new token each time (only hashes are kept); both work
    for key in (token, second):
        authed = APIClient(HTTP_AUTHORIZATION=f"Token {key}")
        assert authed.get("/api/v1/jobs/").status_code == 200
    assert APIClient(HTTP_AUTHORIZATION="Token nope").get("/api/v1/jobs/").status_code == 401


def test_users_see_only_their_jobs_and_staff_see_all(make_user):
    alice, bob, staff = make_user("alice"), make_user("bob"), make_user("root", staff=True)
    job_id = submit(alice).json()["id"]
    assert bob.get(f"/api/v1/jobs/{job_id}/").status_code == 404
    assert bob.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 404
    assert bob.get(f"/api/v1/jobs/{job_id}/outputs/0/").status_code == 404
    assert bob.get("/api/v1/jobs/").json()["count"] == 0
    assert alice.get("/api/v1/jobs/").json()["count"] == 1
    assert staff.get(f"/api/v1/jobs/{job_id}/").status_code == 200
    assert Job.objects.get(pk=job_id).status == "queued"


def test_list_is_newest_first_and_filters_by_status(api):
    first = submit(api).json()["id"]
    second = submit(api).json()["id"]
    ids = [j["id"] for j in api.get("/api/v1/jobs/").json()["results"]]
    assert ids == [second, first]
    api.post(f"/api/v1/jobs/{first}/cancel/")
    cancelled = api.get("/api/v1/jobs/?status=cancelled").json()["results"]
    assert [j["id"] for j in cancelled] == [first]
    assert api.get("/api/v1/jobs/?status=bogus").status_code == 400


def test_cancel_queued_job_is_immediate_and_idempotent(api):
    job_id = submit(api).json()["id"]
    first = api.post(f"/api/v1/jobs/{job_id}/cancel/")
    again = api.post(f"/api/v1/jobs/{job_id}/cancel/")
    assert first.status_code == again.status_code == 202
    assert again.json()["status"] == "cancelled"
    assert api.get(f"/api/v1/jobs/{job_id}/").json()["queue_position"] is None


def test_models_endpoint_lists_the_registry(api):
    models = {m["name"]: m for m in api.get("/api/v1/models/").json()}
    assert {"sdxl-sim", "flux-sim", "wan-sim", "tiny-sd"} <= set(models)
    assert models["wan-sim"]["kind"] == "video" and models["wan-sim"]["limits"]["max_frames"] >= 81
    assert models["tiny-sd"]["defaults"]["steps"] > 0


def test_queues_endpoint_reports_each_class(api, staff_api):
    video = submit(api, model="wan-sim").json()
    queues = {q["name"]: q for q in api.get("/api/v1/queues/").json()}
    assert set(queues) == {"short", "medium", "long"}
    # The backlog is on the clock of the job's estimate (wall seconds, 665 s of work × the time scale).
    assert queues["long"]["depth"] == 1
    assert queues["long"]["backlog_seconds"] == pytest.approx(video["estimated_seconds"], rel=1e-3)
    assert queues["short"]["accepting"] is True
    staff = {q["name"]: q for q in staff_api.get("/api/v1/queues/").json()}
    assert staff["short"]["workers"] == ["card0"] and staff["long"]["depth"] == 1


def test_a_user_sees_the_class_summary_and_staff_the_workers(api, staff_api):
    from genserver.jobs.selectors import QUEUE_SUMMARY_FIELDS

    mine = api.get("/api/v1/queues/").json()
    staff = staff_api.get("/api/v1/queues/").json()
    assert [set(q) for q in mine] == [set(QUEUE_SUMMARY_FIELDS)] * 3  # no workers, nodes or broker depths
    assert all({"workers", "cards_by_node"} <= set(q) for q in staff)
    for summary, full in zip(mine, staff, strict=True):
        assert summary == {k: full[k] for k in QUEUE_SUMMARY_FIELDS}
    refused = api.get("/api/v1/workers/")
    assert refused.status_code == 403 and refused.json()["reason"] == "staff_only", refused.json()
    assert "/api/v1/queues/" in refused.json()["detail"]
    assert APIClient().get("/api/v1/workers/").status_code == 401
    answer = staff_api.get("/api/v1/workers/")
    assert answer.status_code == 200 and {"workers", "nodes"} <= set(answer.json())


def test_schema_and_docs_answer_without_auth():
    client = APIClient()
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert schema.status_code == 200
    assert "/api/v1/jobs/" in json.loads(schema.content)["paths"]
    assert client.get("/api/docs/").status_code == 200


def test_a_lane_routes_to_the_card_group_and_is_ignored_where_none_serves_it(api, monkeypatch):
    from genserver import deployment
    from genserver.scheduling.pools import default_layout

    pooled = default_layout(num_gpus=8, group_cards=4)  # group0 = cards 0-3 on the interactive lane
    monkeypatch.setattr(deployment, "layout", lambda: pooled)
    lane = submit(api, model="wan-sim", lane="interactive").json()
    plain = submit(api, model="wan-sim").json()
    assert (lane["queue"], plain["queue"]) == ("long@interactive", "long")
    assert Job.objects.get(pk=lane["id"]).queue == "long@interactive"
    # Alone on its workers, each waits for nothing; the group runs the job 4 × 0.88 = 3.52× faster.
    assert lane["eta_seconds"] == pytest.approx(plain["eta_seconds"] / 3.52, rel=1e-2)
    # ... and its chunks are CHUNK_SECONDS of the group's time: 3.52× the steps of a card's.
    from django.conf import settings

    from genserver.scheduling.chunking import steps_per_chunk

    image = Job.objects.get(pk=submit(api, width=1024, height=1024, steps=100, lane="interactive").json()["id"])
    step = image.estimated_seconds / image.steps
    assert image.chunk_steps == steps_per_chunk(settings.CHUNK_SECONDS, step / 3.52)
    assert image.chunk_steps > steps_per_chunk(settings.CHUNK_SECONDS, step)
    # A layout without the lane: the job goes to its class queue, as without a lane.
    monkeypatch.setattr(deployment, "layout", lambda: default_layout(num_gpus=4))
    assert submit(api, lane="interactive").json()["queue"] == "short"
    bad = submit(api, lane="Not a lane!")
    assert bad.status_code == 400 and "lane" in bad.json()


def test_a_jobs_get_reads_its_owner_in_the_jobs_own_statement(make_user):
    """Clients poll this route: the owner the answer names comes with the job, not from a statement of its own,
    for the owner and for staff reading another's job."""
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    alice, staff = make_user("alice"), make_user("root", staff=True)
    job_id = submit(alice).json()["id"]
    users = get_user_model()._meta.db_table
    for client in (alice, staff):
        with CaptureQueriesContext(connection) as reads:
            answer = client.get(f"/api/v1/jobs/{job_id}/")
        assert answer.status_code == 200 and answer.json()["owner"] == "alice"
        assert not [q["sql"] for q in reads.captured_queries if q["sql"].startswith(f'SELECT "{users}"')]
