"""Quotas per user or group (issue 17, item 2): each limit's refusal, the usage endpoint, settlement, the admin.

Every refusal is checked for its status, reason, message, Retry-After and that no
row was written; the REST submit and the OpenAI endpoint apply the same quota.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from genserver.jobs import events, selectors, services
from genserver.jobs.models import Job, Quota
from tests.support.api import submit

pytestmark = pytest.mark.django_db


def openai_post(client, body):
    return client.post("/v1/images/generations", data=json.dumps(body), content_type="application/json")


def charge(job_id) -> float:
    return Job.objects.get(pk=job_id).charged_card_seconds


# --- The effective quota ------------------------------------------------------------------------------
def test_the_defaults_come_from_settings(make_user, settings):
    settings.MAX_JOBS_IN_FLIGHT, settings.SUBMIT_RATE_LIMIT, settings.QUOTA_CARD_SECONDS_PER_DAY = 7, 9, 120.0
    quota = selectors.effective_quota(make_user("alice").user)
    assert (quota.source, quota.max_jobs_in_flight, quota.submits_per_minute, quota.card_seconds_per_day) == (
        "default",
        7,
        9,
        120.0,
    )
    assert quota.allows_model("wan-sim") and quota.allows_lane("interactive")


def test_own_row_wins_else_the_most_generous_of_the_groups(make_user, settings):
    settings.MAX_JOBS_IN_FLIGHT = 5
    alice = make_user("alice").user
    small, large = Group.objects.create(name="small"), Group.objects.create(name="large")
    alice.groups.add(small, large)
    Quota.objects.create(group=small, max_jobs_in_flight=2, submits_per_minute=0, allowed_models=["sdxl-sim"])
    Quota.objects.create(group=large, max_jobs_in_flight=3, submits_per_minute=10, allowed_models=["wan-sim"])
    quota = selectors.effective_quota(alice)
    assert quota.source == "groups: large, small"
    assert quota.max_jobs_in_flight == 3  # the larger number
    assert quota.submits_per_minute == 0  # no limit beats any number
    assert quota.card_seconds_per_day == settings.QUOTA_CARD_SECONDS_PER_DAY  # blank: the default
    assert quota.models == ("sdxl-sim", "wan-sim")  # the union
    Quota.objects.create(user=alice, max_jobs_in_flight=1)
    own = selectors.effective_quota(alice)
    # The user's own row wins whole: its blank limits are the defaults, not the groups'.
    assert (own.source, own.max_jobs_in_flight, own.submits_per_minute, own.models) == (
        "user",
        1,
        settings.SUBMIT_RATE_LIMIT,
        (),
    )


# --- Models and lanes: 403 naming the allowed ones ----------------------------------------------------
def test_a_model_not_allowed_is_a_403_naming_the_allowed_ones(make_user):
    alice = make_user("alice")
    Quota.objects.create(user=alice.user, allowed_models=["sdxl-sim", "flux-sim"])
    refused = submit(alice, model="wan-sim")
    assert refused.status_code == 403, refused.content
    body = refused.json()
    assert body["reason"] == "model_not_allowed" and body["allowed"] == ["flux-sim", "sdxl-sim"]
    assert "wan-sim" in body["detail"] and "flux-sim, sdxl-sim" in body["detail"]
    assert not refused.has_header("Retry-After")
    assert not Job.objects.exists()
    assert submit(alice, model="sdxl-sim").status_code == 201


def test_a_lane_not_allowed_is_a_403_and_no_lane_is_always_allowed(make_user):
    alice = make_user("alice")
    Quota.objects.create(user=alice.user, allowed_lanes=["batch"])
    refused = submit(alice, lane="interactive")
    assert refused.status_code == 403, refused.content
    body = refused.json()
    assert body["reason"] == "lane_not_allowed" and body["allowed"] == ["batch"]
    assert "'interactive'" in body["detail"] and "batch" in body["detail"]
    assert not Job.objects.exists()
    assert submit(alice).status_code == 201
    assert submit(alice, lane="batch").status_code == 201


def test_the_openai_endpoint_refuses_a_model_not_allowed_in_its_error_shape(make_user):
    alice = make_user("alice")
    Quota.objects.create(user=alice.user, allowed_models=["sdxl-sim"])
    refused = openai_post(alice, {"model": "tiny-sd", "prompt": "a fox"})
    assert refused.status_code == 403, refused.content
    error = refused.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("permission_error", "model_not_allowed", "model")
    assert "sdxl-sim" in error["message"]
    assert not Job.objects.exists()


# --- Jobs in flight (the existing behaviour, now per user) --------------------------------------------
def test_jobs_in_flight_from_the_users_quota(make_user, settings):
    settings.MAX_JOBS_IN_FLIGHT = 10
    alice, bob = make_user("alice"), make_user("bob")
    Quota.objects.create(user=alice.user, max_jobs_in_flight=1)
    assert submit(alice).status_code == 201
    refused = submit(alice, prompt="a second")
    assert refused.status_code == 429, refused.content
    body = refused.json()
    assert body["reason"] == "too_many_in_flight" and body["limit"] == 1 and body["used"] == body["in_flight"] == 1
    assert "at most 1" in body["detail"]
    assert int(refused["Retry-After"]) == body["retry_after"] >= 1
    assert Job.objects.filter(owner=alice.user).count() == 1
    for _ in range(2):
        assert submit(bob).status_code == 201  # bob has the default (10)


def test_a_quota_of_zero_is_no_limit(make_user, settings):
    settings.MAX_JOBS_IN_FLIGHT = 1
    alice = make_user("alice")
    Quota.objects.create(user=alice.user, max_jobs_in_flight=0)
    for i in range(3):
        assert submit(alice, prompt=f"job {i}").status_code == 201


def test_a_lowered_limit_reports_every_job_in_flight_not_only_those_counted_up_to_it(make_user, settings):
    settings.MAX_JOBS_IN_FLIGHT = 0
    alice = make_user("alice")
    for i in range(3):
        assert submit(alice, prompt=f"job {i}").status_code == 201
    Quota.objects.create(user=alice.user, max_jobs_in_flight=2)
    body = submit(alice, prompt="one more").json()
    assert body["reason"] == "too_many_in_flight" and body["limit"] == 2 and body["in_flight"] == 3


def test_the_limit_counts_agree_with_the_usage_read_no_further_than_each_limit_and_not_at_all_unlimited(
    make_user, django_assert_num_queries
):
    alice = make_user("alice")
    ids = [submit(alice, prompt=f"job {i}").json()["id"] for i in range(5)]
    Job.objects.filter(pk=ids[0]).update(status="succeeded", card_seconds=0.5)
    Job.objects.filter(pk=ids[1]).update(cancel_requested=True)
    Job.objects.filter(pk=ids[2]).update(created_at=timezone.now() - timedelta(hours=1))  # out of the window
    now = timezone.now()
    usage = selectors.usage_of(alice.user, now)
    assert (usage.in_flight, usage.submits_in_window) == (3, 4)

    def counts(in_flight: int, per_minute: int, per_day: float) -> selectors.LimitCounts:
        quota = selectors.EffectiveQuota("test", in_flight, per_minute, per_day)
        return selectors.limit_counts(alice.user, quota, now)

    generous = counts(100, 100, 1e9)
    assert (generous.in_flight, generous.submits_in_window) == (usage.in_flight, usage.submits_in_window)
    assert generous.card_seconds_today == pytest.approx(usage.card_seconds_today)
    capped = counts(2, 3, 1e9)
    assert (capped.in_flight, capped.submits_in_window) == (2, 3)  # enough to refuse, and no more read
    with django_assert_num_queries(0):
        assert counts(0, 0, 0) == selectors.LimitCounts(None, None, None)
    only_rate = counts(0, 10, 0)
    assert (only_rate.in_flight, only_rate.submits_in_window, only_rate.card_seconds_today) == (None, 4, None)


# --- Submits per minute --------------------------------------------------------------------------------
def test_submits_per_minute_refused_until_the_window_frees_a_place(make_user, settings):
    settings.SUBMIT_RATE_WINDOW = 60.0
    alice = make_user("alice")
    Quota.objects.create(user=alice.user, submits_per_minute=2)
    first = submit(alice, prompt="one").json()["id"]
    submit(alice, prompt="two")
    oldest = timezone.now() - timedelta(seconds=45)
    Job.objects.filter(pk=first).update(created_at=oldest)  # the first is 45 s old: a place frees in ~15 s
    refused = submit(alice, prompt="three")
    assert refused.status_code == 429, refused.content
    body = refused.json()
    assert body["reason"] == "rate_limited" and body["limit"] == 2 and body["used"] == 2
    assert body["window_seconds"] == 60.0
    assert 1 <= int(refused["Retry-After"]) <= 15
    resets_at = datetime.fromisoformat(body["resets_at"].replace("Z", "+00:00"))
    assert abs((resets_at - (oldest + timedelta(seconds=60))).total_seconds()) < 0.01
    assert "at most 2 jobs per 60 s" in body["detail"]
    assert Job.objects.filter(owner=alice.user).count() == 2
    Job.objects.filter(pk=first).update(created_at=timezone.now() - timedelta(seconds=61))
    assert submit(alice, prompt="three, later").status_code == 201


def test_the_openai_endpoint_applies_the_submit_rate(make_user):
    alice = make_user("alice")
    Quota.objects.create(user=alice.user, submits_per_minute=1)
    assert submit(alice).status_code == 201
    refused = openai_post(alice, {"model": "tiny-sd", "prompt": "a fox"})
    assert refused.status_code == 429, refused.content
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limited")
    assert int(refused["Retry-After"]) >= 1
    assert Job.objects.count() == 1


def test_a_refused_submit_does_not_count(make_user):
    alice = make_user("alice")
    Quota.objects.create(user=alice.user, submits_per_minute=1, allowed_models=["sdxl-sim"])
    assert submit(alice, model="wan-sim").status_code == 403
    assert submit(alice, prompt="p" * 30000).status_code == 400
    assert submit(alice).status_code == 201  # neither refusal used the minute's one place


# --- Card-seconds per day ------------------------------------------------------------------------------
def test_card_seconds_per_day_are_charged_the_estimate_and_refused_until_midnight(make_user):
    alice = make_user("alice")
    job = submit(alice).json()
    row = Job.objects.get(pk=job["id"])
    estimate = row.estimated_seconds * row.clock_scale
    assert row.charged_card_seconds == pytest.approx(estimate) and estimate > 0
    Quota.objects.create(user=alice.user, card_seconds_per_day=estimate * 1.5)  # room for half a job more
    refused = submit(alice, prompt="a second")
    assert refused.status_code == 429, refused.content
    body = refused.json()
    assert body["reason"] == "card_seconds_per_day"
    assert body["limit"] == pytest.approx(estimate * 1.5) and body["used"] == pytest.approx(estimate, abs=1e-3)
    midnight = (timezone.now().astimezone(UTC) + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    assert datetime.fromisoformat(body["resets_at"].replace("Z", "+00:00")) == midnight
    wait = int(refused["Retry-After"])
    assert wait == body["retry_after"] and abs(wait - (midnight - timezone.now()).total_seconds()) <= 2
    assert "00:00 UTC" in body["detail"] and "fewer steps" in body["detail"]
    assert Job.objects.filter(owner=alice.user).count() == 1
    # Yesterday's charges do not count today.
    Job.objects.filter(owner=alice.user).update(created_at=midnight - timedelta(days=1, seconds=1))
    assert submit(alice, prompt="the next day").status_code == 201


def test_a_job_bigger_than_the_whole_daily_quota_is_a_403(make_user):
    alice = make_user("alice")
    Quota.objects.create(user=alice.user, card_seconds_per_day=0.001)
    refused = submit(alice, model="wan-sim")
    assert refused.status_code == 403, refused.content
    body = refused.json()
    assert body["reason"] == "exceeds_daily_quota" and "fewer steps" in body["detail"]
    assert not Job.objects.exists()


def test_the_openai_endpoint_applies_card_seconds_per_day(make_user):
    alice = make_user("alice")
    first = submit(alice, model="sdxl-sim", width=64, height=64).json()["id"]
    Quota.objects.create(user=alice.user, card_seconds_per_day=charge(first) + 1e-9)
    refused = openai_post(alice, {"model": "sdxl-sim", "prompt": "a fox", "size": "64x64"})
    assert refused.status_code == 429, refused.content
    assert refused.json()["error"]["code"] == "card_seconds_per_day"
    assert int(refused["Retry-After"]) >= 1
    assert Job.objects.count() == 1


def test_settlement_replaces_the_estimate_with_the_measured_time_when_the_job_ends(make_user):
    """The job service's end (after_end) settles: here a chunk recorded 0.25 s on a card, then a cancel."""
    alice = make_user("alice")
    job_id = submit(alice).json()["id"]
    Job.objects.filter(pk=job_id).update(status="denoising", stage="waiting")
    assert services.claim_chunk(job_id, "card0@test:1", 0) is not None
    assert services.finish_chunk(job_id, "card0@test:1", 1, "checkpoints/x/step-00001.pt", None, chunk_seconds=0.25)
    row = Job.objects.get(pk=job_id)
    assert row.card_seconds == pytest.approx(0.25)
    assert row.charged_card_seconds == pytest.approx(row.estimated_seconds * row.clock_scale)  # still the estimate
    services.cancel_job(row)
    row.refresh_from_db()
    assert row.status == "cancelled" and row.charged_card_seconds == pytest.approx(0.25)
    assert selectors.usage_of(alice.user).card_seconds_today == pytest.approx(0.25)


@pytest.fixture
def published(monkeypatch) -> list[tuple[str, str]]:
    """The job events published, instead of rendered: a worker renders them on its event thread (its own read of the
    row, under the job's lock), which a count of the transition's statements leaves apart."""
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(events, "publish_soon", lambda job_id, kind: seen.append((str(job_id), kind)))
    return seen


def _claimed_job(make_user) -> str:
    """A new job of a new user, denoising on card0 (claimed)."""
    job_id = submit(make_user("alice")).json()["id"]
    Job.objects.filter(pk=job_id).update(status="denoising", stage="waiting")
    assert services.claim_chunk(job_id, "card0@test:1", 0) is not None
    return job_id


def _naming(job_id: str, statements: CaptureQueriesContext) -> list[str]:
    """The captured statements that name the job (its key as PostgreSQL or SQLite writes it)."""
    return [q["sql"] for q in statements.captured_queries if job_id in q["sql"] or job_id.replace("-", "") in q["sql"]]


def test_a_decode_settles_the_charge_in_its_own_statement_and_reads_the_row_no_more(make_user, published):
    """The decode worker's end: the success's UPDATE … RETURNING settles the charge, and after_end takes the row it
    returned (status, checkpoint, webhook, owner and queue) instead of a settle and three re-reads."""
    job_id = _claimed_job(make_user)
    total = Job.objects.get(pk=job_id).steps
    assert services.finish_chunk(job_id, "card0@test:1", total, "checkpoints/x/step-00001.pt", None, chunk_seconds=0.5)
    assert services.start_decoding(job_id, "decode@test:1") is not None
    with CaptureQueriesContext(connection) as statements:
        assert services.finish_decoding(job_id, "decode@test:1", [])
    row = Job.objects.get(pk=job_id)
    assert row.status == "succeeded" and row.charged_card_seconds == pytest.approx(0.5)
    of_the_job = _naming(job_id, statements)
    assert len(of_the_job) == 1 and of_the_job[0].lstrip().upper().startswith("UPDATE"), of_the_job
    assert published == [(job_id, "succeeded")]


def test_a_cancel_the_card_sees_settles_the_charge_with_its_unrecorded_chunks_in_one_statement(make_user, published):
    """The card stopped at a cancel flag after 0.25 s recorded and 0.5 s since (a checkpoint interval's unrecorded
    chunks): the cancel's UPDATE bills the 0.5 s and settles the charge to both (its right-hand sides read the row
    as it was, so the settle adds the 0.5 s itself); after it only after_end's work, none of it on the row."""
    job_id = _claimed_job(make_user)
    assert services.finish_chunk(
        job_id, "card0@test:1", 1, "checkpoints/x/step-00001.pt", None, chunk_seconds=0.25, keep_lease=True
    )
    with CaptureQueriesContext(connection) as statements:
        assert services.finish_cancelled(job_id, "card0@test:1", chunk_seconds=0.5)
    row = Job.objects.get(pk=job_id)
    assert row.status == "cancelled" and row.card_seconds == pytest.approx(0.75)
    assert row.charged_card_seconds == pytest.approx(0.75)
    of_the_job = _naming(job_id, statements)
    assert [q.lstrip().split()[0].upper() for q in of_the_job] == ["SELECT", "UPDATE"], of_the_job  # its status before
    assert published == [(job_id, "cancelled")]
    assert not services.finish_cancelled(job_id, "card0@test:1")  # ended: nothing more to do, nothing billed twice
    assert Job.objects.get(pk=job_id).card_seconds == pytest.approx(0.75)


def test_a_chunk_without_its_own_time_counts_its_step_time(make_user):
    alice = make_user("alice")
    job_id = submit(alice).json()["id"]
    Job.objects.filter(pk=job_id).update(status="denoising", stage="waiting")
    services.claim_chunk(job_id, "card0@test:1", 0)
    services.finish_chunk(job_id, "card0@test:1", 4, "checkpoints/x/step-00004.pt", 0.5)
    assert Job.objects.get(pk=job_id).card_seconds == pytest.approx(2.0)  # 4 steps × 0.5 s


# --- GET /api/v1/usage/ -------------------------------------------------------------------------------
def test_usage_shows_the_users_own_counts_and_what_remains(make_user, settings):
    settings.SUBMIT_RATE_WINDOW = 60.0
    alice, bob = make_user("alice"), make_user("bob")
    Quota.objects.create(
        user=alice.user,
        max_jobs_in_flight=5,
        submits_per_minute=4,
        card_seconds_per_day=100.0,
        allowed_models=["sdxl-sim", "wan-sim"],
        allowed_lanes=["interactive"],
    )
    ids = [submit(alice, prompt=f"job {i}").json()["id"] for i in range(2)]
    submit(bob)
    alice.post(f"/api/v1/jobs/{ids[0]}/cancel/")
    body = alice.get("/api/v1/usage/").json()
    assert body["user"] == "alice" and body["quota"] == "user"
    assert body["jobs_in_flight"] == {"limit": 5.0, "used": 1.0, "remaining": 4.0, "resets_at": None}
    rate = body["submits_per_minute"]
    assert (rate["limit"], rate["used"], rate["remaining"], rate["window_seconds"]) == (4, 2, 2, 60.0)
    oldest = Job.objects.filter(owner=alice.user).order_by("created_at").first().created_at
    assert datetime.fromisoformat(rate["resets_at"].replace("Z", "+00:00")) == oldest + timedelta(seconds=60)
    day = body["card_seconds_per_day"]
    charged = sum(charge(i) for i in ids)  # the cancelled job settled at 0 (it never ran)
    assert charge(ids[0]) == 0 and day["used"] == pytest.approx(charged, abs=1e-3)
    assert day["remaining"] == pytest.approx(100.0 - charged, abs=1e-3)
    assert datetime.fromisoformat(day["resets_at"].replace("Z", "+00:00")) == selectors.next_utc_midnight(
        timezone.now()
    )
    assert body["allowed_models"] == ["sdxl-sim", "wan-sim"] and body["allowed_lanes"] == ["interactive"]
    # Bob's usage is his own, with the defaults (no card-seconds limit: null).
    other = bob.get("/api/v1/usage/").json()
    assert other["quota"] == "default" and other["jobs_in_flight"]["used"] == 1
    assert other["card_seconds_per_day"]["limit"] is None and other["card_seconds_per_day"]["remaining"] is None
    assert other["allowed_lanes"] is None and "tiny-sd" in other["allowed_models"]


def test_usage_needs_a_token():
    from rest_framework.test import APIClient

    assert APIClient().get("/api/v1/usage/").status_code == 401


def test_usage_is_in_the_schema(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    usage = schema["paths"]["/api/v1/usage/"]["get"]
    assert usage["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/Usage")
    assert "403" in schema["paths"]["/api/v1/jobs/"]["post"]["responses"]


# --- The admin -----------------------------------------------------------------------------------------
@pytest.fixture
def admin_client():
    user = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


def test_staff_edit_quotas_in_the_admin(admin_client, make_user):
    alice = make_user("alice")
    form = {
        "user": alice.user.pk,
        "max_jobs_in_flight": "1",
        "submits_per_minute": "",
        "card_seconds_per_day": "",
        "allowed_models": '["sdxl-sim"]',
        "allowed_lanes": "[]",
    }
    response = admin_client.post("/admin/jobs/quota/add/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    quota = Quota.objects.get(user=alice.user)
    assert (quota.max_jobs_in_flight, quota.submits_per_minute, quota.allowed_models) == (1, None, ["sdxl-sim"])
    assert submit(alice, model="wan-sim").status_code == 403
    # An unknown model and a row for nobody are refused with a message.
    bad = admin_client.post(f"/admin/jobs/quota/{quota.pk}/change/", form | {"allowed_models": '["nope"]'})
    assert bad.status_code == 200 and "Unknown model(s) nope" in bad.content.decode()
    nobody = admin_client.post("/admin/jobs/quota/add/", form | {"user": ""})
    assert nobody.status_code == 200 and "Choose a user or a group" in nobody.content.decode()
    changed = admin_client.post(f"/admin/jobs/quota/{quota.pk}/change/", form | {"allowed_models": "[]"})
    assert changed.status_code == 302
    assert submit(alice, model="wan-sim").status_code == 201


def test_staff_see_everyones_usage_in_the_admin_read_only(admin_client, make_user):
    alice, bob = make_user("alice"), make_user("bob")
    Quota.objects.create(user=alice.user, max_jobs_in_flight=3)
    submit(alice)
    submit(alice, prompt="two")
    submit(bob)
    page = admin_client.get("/admin/jobs/userusage/")
    assert page.status_code == 200
    rows = {u.username: u for u in page.context["cl"].result_list}
    assert set(rows) >= {"alice", "bob", "root"}
    assert (rows["alice"].in_flight, rows["alice"].submits, rows["bob"].in_flight) == (2, 2, 1)
    text = page.content.decode()
    assert "2 / 3" in text  # alice's in flight against her own quota
    assert admin_client.get(f"/admin/jobs/userusage/{alice.user.pk}/change/").status_code == 200  # a read-only view
    assert admin_client.post("/admin/jobs/userusage/add/", {}).status_code == 403
    plain = Client()
    plain.force_login(bob.user)
    assert plain.get("/admin/jobs/userusage/").status_code == 302  # non-staff: the login page


# --- Concurrency: the limits are checked with the owner's row locked ------------------------------------
def test_quota_limits_are_checked_inside_the_submit_transaction(make_user):
    alice = make_user("alice").user
    Quota.objects.create(user=alice, submits_per_minute=1)
    data = {
        "model": "sdxl-sim",
        "prompt": "p",
        "width": 512,
        "height": 512,
        "num_frames": 1,
        "steps": 20,
        "guidance_scale": 5.0,
        "seed": 1,
        "num_outputs": 1,
    }
    services.submit_job(alice, data)
    with pytest.raises(services.QuotaExceeded) as refused:
        services.submit_job(alice, data)
    assert refused.value.reason == "rate_limited" and math.isfinite(refused.value.retry_after_seconds)
    assert Job.objects.filter(owner=alice).count() == 1


def test_an_idempotent_retry_is_not_refused_by_the_quota(make_user):
    alice = make_user("alice")
    Quota.objects.create(user=alice.user, submits_per_minute=1, max_jobs_in_flight=1)
    body = json.dumps({"model": "sdxl-sim", "prompt": "once"})
    first = alice.post("/api/v1/jobs/", data=body, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k1")
    again = alice.post("/api/v1/jobs/", data=body, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k1")
    assert (first.status_code, again.status_code) == (201, 200), again.content
    assert again.json()["id"] == first.json()["id"] and again["Idempotent-Replayed"] == "true"
    assert submit(alice, prompt="a new one").status_code == 429
