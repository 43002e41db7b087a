"""6. Tenancy and access: tokens everywhere but the schema and health, owners only, per-user limits.

* Every route except the schema/docs and the health probes refuses a request
  without a valid token (401), a revoked or expired one included; the admin sends
  non-staff to its login page.
* Outputs and previews are served only to the owner and staff, through
  authenticated API routes keyed by an unguessable UUID; storage has no public URL.
* Another user's job is a 404 to read, list, cancel, or fetch files from.
* Per-user limits: unfinished jobs (MAX_JOBS_IN_FLIGHT) and accepted submits per
  window (SUBMIT_RATE_LIMIT), each a 429 with Retry-After and a reason, and no row
  (the defaults of the per-user quotas: tests/jobs/test_quotas.py); GET /api/v1/usage/
  shows each user their own counts only.
* Staff actions (retry, re-prioritise, cancel anyone's job) exist only in the admin.
* What names the machines is staff's: GET /api/v1/workers/ is 403 to others, and
  /queues/ shows them the class summary without workers or nodes.
"""

from __future__ import annotations

import json
import math
import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone
from rest_framework.test import APIClient

from genserver.jobs.models import Job
from genserver.storage import default_storage
from tests.conftest import submit
from tests.support.jobs import IMAGE_REQUEST, make_job

pytestmark = pytest.mark.django_db

PUBLIC = {"api/schema/", "api/docs/", "api/redoc/", "healthz", "readyz"}


def routes(resolver=None, prefix: str = "") -> list[str]:
    """Every URL pattern of the project, as a concrete path (placeholders filled)."""
    found = []
    for entry in (resolver or get_resolver()).url_patterns:
        pattern = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            if pattern.startswith("admin/"):
                found.append("admin/")
                continue
            found += routes(entry, pattern)
        elif isinstance(entry, URLPattern):
            path = pattern.replace("<uuid:job_id>", str(uuid.uuid4())).replace("<int:index>", "0")
            found.append(path.replace("<int:token_id>", "1"))
    return found


def test_every_route_but_schema_and_health_needs_a_token():
    anonymous, bad_token = APIClient(), APIClient(HTTP_AUTHORIZATION="Token not-a-token")
    checked = 0
    refused_paths = set()
    for path in routes():
        if path in PUBLIC:
            accept = "application/json" if path == "api/schema/" else "text/html"
            response = anonymous.get("/" + path, HTTP_ACCEPT=accept)
            assert response.status_code in (200, 503), (path, response.status_code)  # /readyz may say 503
            continue
        if path in ("", "login/", "logout/"):  # the web page: Django's session login, not tokens
            if path == "":
                response = anonymous.get("/")
                assert response.status_code == 302 and response["Location"].startswith("/login/")
            continue
        if path == "metrics":  # staff session or the metrics bearer token (tests/metrics/test_access.py)
            assert anonymous.get("/metrics").status_code in (401, 403)
            continue
        if path == "admin/":
            response = anonymous.get("/admin/jobs/job/")
            assert response.status_code == 302 and "/admin/login/" in response["Location"]
            continue
        for client in (anonymous, bad_token):
            for method in ("get", "post"):
                response = getattr(client, method)("/" + path)
                assert response.status_code == 401, (method, path, response.status_code)
                # The OpenAI-shaped API (/v1/) answers in OpenAI's error shape; the rest in DRF's.
                assert ("error" if path.startswith("v1/") else "detail") in response.json(), (method, path)
                assert response.has_header("WWW-Authenticate"), (method, path)
                checked += 1
                refused_paths.add(path)
    assert "api/v1/usage/" in refused_paths  # a user's quota and counts are theirs alone
    assert checked >= 8 * 4


def test_workers_are_staff_only_and_queues_show_others_a_summary(make_user):
    alice, staff = make_user("alice"), make_user("root", staff=True)
    for method in ("get", "post"):
        assert getattr(alice, method)("/api/v1/workers/").status_code == 403
    assert staff.get("/api/v1/workers/").status_code == 200
    named = {"workers", "live_workers", "cards_by_node", "broker_messages"}
    assert all(not named & set(q) for q in alice.get("/api/v1/queues/").json())
    assert all({"workers", "cards_by_node"} <= set(q) for q in staff.get("/api/v1/queues/").json())


def test_schema_and_health_answer_without_a_token():
    anonymous = Client()
    assert anonymous.get("/api/schema/", HTTP_ACCEPT="application/json").status_code == 200
    assert anonymous.get("/healthz").json() == {"status": "ok"}


def _finished_job(owner) -> Job:
    """A succeeded job with an output and a preview in storage (as decode leaves it)."""
    job = make_job(owner, prompt="mine", status="succeeded", stage="done")
    storage = default_storage()
    out = storage.put(f"outputs/{job.pk}/0.png", b"\x89PNG output")
    preview = storage.put(f"previews/{job.pk}/preview.png", b"\x89PNG preview")
    Job.objects.filter(pk=job.pk).update(outputs=[{"key": out, "content_type": "image/png"}], preview_key=preview)
    job.refresh_from_db()
    return job


def _read(response) -> bytes:
    return b"".join(response.streaming_content) if response.streaming else response.content


def test_outputs_and_previews_are_served_to_the_owner_and_staff_only(make_user):
    alice, bob, staff = make_user("alice"), make_user("bob"), make_user("root", staff=True)
    job = _finished_job(alice.user)
    body = alice.get(f"/api/v1/jobs/{job.pk}/").json()
    output_url, preview_url = body["outputs"][0]["url"], body["preview_url"]
    assert f"/api/v1/jobs/{job.pk}/" in output_url and f"/api/v1/jobs/{job.pk}/" in preview_url
    for url, content in ((output_url, b"\x89PNG output"), (preview_url, b"\x89PNG preview")):
        assert _read(alice.get(url)) == content
        assert _read(staff.get(url)) == content
        assert bob.get(url).status_code == 404  # not 403: another user's job does not exist for them
        assert APIClient().get(url).status_code == 401
    # The files have no other URL: nothing serves the storage directory.
    for guess in (
        f"/storage/outputs/{job.pk}/0.png",
        f"/media/outputs/{job.pk}/0.png",
        f"/outputs/{job.pk}/0.png",
        f"/static/outputs/{job.pk}/0.png",
        f"/static/../storage/outputs/{job.pk}/0.png",
        f"/api/v1/outputs/{job.pk}/0.png",
    ):
        assert Client().get(guess).status_code == 404, guess
        assert alice.get(guess).status_code == 404, guess
    assert uuid.UUID(str(job.pk)).version == 4  # ids are random, not sequential


def test_another_users_job_is_404_to_read_list_cancel_and_fetch(make_user):
    alice, bob = make_user("alice"), make_user("bob")
    job = _finished_job(alice.user)
    queued = submit(alice).json()["id"]
    for job_id in (job.pk, queued):
        assert bob.get(f"/api/v1/jobs/{job_id}/").status_code == 404
        assert bob.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 404
        assert bob.get(f"/api/v1/jobs/{job_id}/outputs/0/").status_code == 404
        assert bob.get(f"/api/v1/jobs/{job_id}/preview/").status_code == 404
    assert bob.get("/api/v1/jobs/").json()["count"] == 0
    assert bob.get("/api/v1/jobs/?status=queued").json()["count"] == 0
    assert Job.objects.get(pk=queued).status == "queued" and not Job.objects.get(pk=queued).cancel_requested
    # Usage is each user's own: bob's shows none of alice's jobs.
    usage = bob.get("/api/v1/usage/").json()
    assert usage["user"] == "bob" and usage["jobs_in_flight"]["used"] == 0
    assert usage["submits_per_minute"]["used"] == 0 and usage["card_seconds_per_day"]["used"] == 0


def test_jobs_in_flight_per_user_are_limited_with_429_and_retry_after(make_user, settings):
    settings.MAX_JOBS_IN_FLIGHT = 2
    alice, bob = make_user("alice"), make_user("bob")
    first, _ = submit(alice).json()["id"], submit(alice).json()["id"]
    refused = submit(alice, prompt="a third")
    assert refused.status_code == 429, refused.content
    assert int(refused["Retry-After"]) >= 1
    body = refused.json()
    assert body["reason"] == "too_many_in_flight" and body["limit"] == 2 and body["in_flight"] == 2
    assert "at most 2" in body["detail"]
    assert Job.objects.filter(owner=alice.user).count() == 2
    assert submit(bob).status_code == 201  # the limit is per user
    alice.post(f"/api/v1/jobs/{first}/cancel/")  # a finished job frees its place
    assert submit(alice, prompt="a third, later").status_code == 201


def test_a_cancelled_job_leaves_the_in_flight_count_at_once(make_user, settings):
    settings.MAX_JOBS_IN_FLIGHT = 1
    alice = make_user("alice")
    running = submit(alice, model="wan-sim").json()["id"]
    # A worker holds it: the cancel is answered 202 while the card finishes its step.
    Job.objects.filter(pk=running).update(
        status="denoising",
        stage="denoising",
        lease_owner="card0:1",
        lease_expires_at=timezone.now() + timedelta(seconds=60),
    )
    assert alice.post(f"/api/v1/jobs/{running}/cancel/").status_code == 202
    assert Job.objects.get(pk=running).status == "denoising"
    assert submit(alice, prompt="right after the cancel").status_code == 201


def test_in_flight_retry_after_is_when_the_users_first_job_is_expected_to_end(make_user, settings):
    settings.MAX_JOBS_IN_FLIGHT = 2
    alice, bob = make_user("alice"), make_user("bob")
    # Bob's video is ahead of Alice's two; her third job, an image, is refused for her jobs in flight:
    # she may retry when her first video is expected to end (not after the image class's wait, ~0).
    submit(bob, model="wan-sim")
    jobs = [submit(alice, model="wan-sim", prompt=f"clip {i}").json()["id"] for i in range(2)]
    refused = submit(alice, prompt="an image")
    assert refused.status_code == 429, refused.content
    etas = [alice.get(f"/api/v1/jobs/{job}/").json()["eta_seconds"] for job in jobs]
    assert min(etas) > 1  # behind Bob's video: a figure that tells the two answers apart
    assert int(refused["Retry-After"]) == refused.json()["retry_after"] == max(1, math.ceil(min(etas)))


def test_submit_rate_per_user_is_limited_with_429_and_retry_after(make_user, settings):
    settings.SUBMIT_RATE_LIMIT, settings.SUBMIT_RATE_WINDOW = 3, 60.0
    alice, bob = make_user("alice"), make_user("bob")
    for i in range(3):
        assert submit(alice, prompt=f"job {i}").status_code == 201
    refused = submit(alice, prompt="too fast")
    assert refused.status_code == 429, refused.content
    assert 1 <= int(refused["Retry-After"]) <= 60
    body = refused.json()
    assert body["reason"] == "rate_limited" and body["limit"] == 3 and body["retry_after"] >= 1
    assert Job.objects.filter(owner=alice.user).count() == 3
    assert alice.get("/api/v1/jobs/").status_code == 200  # reads are not throttled
    assert submit(bob).status_code == 201
    # Once the oldest submits leave the window, the user may submit again.
    from datetime import timedelta

    from django.utils import timezone

    Job.objects.filter(owner=alice.user).update(created_at=timezone.now() - timedelta(seconds=61))
    assert submit(alice, prompt="later").status_code == 201


def test_in_flight_limit_holds_under_concurrent_submits(make_user, settings):
    """The limit is checked inside the submit transaction with the user's row locked."""
    from django.db import connection

    from genserver.jobs import services

    settings.MAX_JOBS_IN_FLIGHT = 1
    owner = make_user("racer").user
    data = dict(IMAGE_REQUEST)
    with connection.execute_wrapper(_record_sql) as _:
        _SQL.clear()
        services.submit_job(owner, data)
    if connection.vendor == "postgresql":
        assert any("FOR UPDATE" in sql for sql in _SQL), _SQL
    with pytest.raises(services.InFlightLimitReached):
        services.submit_job(owner, data)
    assert Job.objects.filter(owner=owner).count() == 1


_SQL: list[str] = []


def _record_sql(execute, sql, params, many, context):
    _SQL.append(sql)
    return execute(sql, params, many, context)


def test_staff_actions_live_in_the_admin_only(make_user):
    """The API's one staff action is re-prioritising (a 403 for everyone else, the job's owner included); no
    retry or other staff action; the admin's need a staff login."""
    api_routes = [p for p in routes() if p.startswith("api/v1/")]
    names = {p.split("/")[-2] for p in api_routes}
    assert not names & {"retry", "reprioritise", "admin", "requeue"}, api_routes
    staff = make_user("root", staff=True)
    alice = make_user("alice")
    job_id = submit(alice).json()["id"]
    for verb in ("retry", "reprioritise"):
        assert staff.post(f"/api/v1/jobs/{job_id}/{verb}/").status_code == 404
    refused = alice.post(f"/api/v1/jobs/{job_id}/priority/", {"priority": 0}, format="json")
    assert refused.status_code == 403 and Job.objects.get(pk=job_id).priority != 0
    # The admin's actions need a staff session: a plain user is sent to the login page.
    from django.contrib.auth import get_user_model

    plain = get_user_model().objects.create_user("mallory", password="pw")
    browser = Client()
    browser.force_login(plain)
    response = browser.post("/admin/jobs/job/", {"action": "retry_from_checkpoint", "_selected_action": [job_id]})
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert Job.objects.get(pk=job_id).status == "queued"


def test_every_token_route_refuses_revoked_and_expired_tokens():
    """The routes a token opens shut the moment it is revoked or expires (tests/jobs/test_tokens.py: the rest)."""
    from django.contrib.auth import get_user_model

    from genserver.jobs.models import ApiToken
    from genserver.jobs.services import tokens

    user = get_user_model().objects.create_user("carol")
    revoked, revoked_key = tokens.issue(user)
    expired, expired_key = tokens.issue(user)
    tokens.revoke(revoked)
    ApiToken.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    checked = 0
    for path in routes():
        if not (path.startswith("api/v1/") or path.startswith("v1/")):
            continue
        for key in (revoked_key, expired_key):
            for keyword in ("Token", "Bearer"):
                response = APIClient(HTTP_AUTHORIZATION=f"{keyword} {key}").get("/" + path)
                assert response.status_code == 401, (path, keyword, response.status_code)
                checked += 1
    assert checked >= 14 * 4


def test_token_header_variants_do_not_authenticate():
    for header in ("Token", "Token ", "Bearer abc", "Token a b", "token " + "0" * 40, "Basic Zm9vOmJhcg=="):
        response = APIClient(HTTP_AUTHORIZATION=header).get("/api/v1/jobs/")
        assert response.status_code == 401, header
        assert json.loads(response.content)["detail"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("empty_broker")
def test_concurrent_submits_of_one_user_count_their_limit_one_at_a_time(make_user, settings):
    """Four threads submit for the same user at once, with one job in flight allowed: exactly one is recorded.
    PostgreSQL holds them on the user's row; SQLite on its write lock, which every transaction takes first."""
    import threading

    from django.db import connection

    from genserver.jobs import services

    settings.MAX_JOBS_IN_FLIGHT = 1
    settings.SUBMIT_RATE_LIMIT = 0
    owner = make_user("racer").user
    data = dict(IMAGE_REQUEST)
    start = threading.Barrier(4)
    outcomes: list[str] = []

    def submit_one() -> None:
        try:
            start.wait(30)
            services.submit_job(owner, data)
            outcomes.append("recorded")
        except services.InFlightLimitReached:
            outcomes.append("refused")
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            outcomes.append(repr(error))
        finally:
            connection.close()

    threads = [threading.Thread(target=submit_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(outcomes) == ["recorded", "refused", "refused", "refused"]
    assert Job.objects.filter(owner=owner).count() == 1
