"""The quote at submit and the start deadline, without workers: the 201's quote, a refusal with the quote,
and a job that missed its start ending `expired` (the sweeper, a worker's claim), never once it started."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from genserver.jobs import broker, selectors, services
from genserver.jobs.models import TERMINAL, Job, JobStage, JobStatus
from tests.conftest import submit
from tests.support.broker import capture_sends

pytestmark = [
    pytest.mark.django_db(transaction=True),  # the service publishes on commit
    pytest.mark.usefixtures("empty_broker"),
]

# wan-sim's default video: 665 s of modelled work, 1.33 s on the test clock (0.002); the long class's
# limit is 3.6 s there, so two queued ones make the next one wait 2.7 s and still be admitted.
VIDEO = {"model": "wan-sim", "prompt": "a slow pan over a harbour"}


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_every_201_carries_a_quote_with_the_etas_numbers(api):
    first = submit(api, **VIDEO)
    assert first.status_code == 201
    before = timezone.now()
    response = submit(api, **VIDEO)
    after = timezone.now()
    assert response.status_code == 201
    body = response.json()
    start, finish = at(body["expected_start_at"]), at(body["expected_finish_at"])
    assert body["expected_start_at"].endswith("Z")  # ISO-8601 UTC, like created_at
    # finish = the snapshot's time + eta_seconds; start = finish - the job's own work: the ETA's numbers.
    assert before <= finish - timedelta(seconds=body["eta_seconds"]) <= after
    assert (finish - start).total_seconds() == pytest.approx(body["estimated_seconds"], abs=0.002)
    # It waits behind the first video: its start is that one's work later than its own snapshot's time.
    ahead = first.json()["estimated_seconds"]
    assert (start - (finish - timedelta(seconds=body["eta_seconds"]))).total_seconds() == pytest.approx(
        ahead, abs=0.002
    )
    # The job detail while queued answers the same quote from its own snapshot (the queue did not move).
    detail = api.get(f"/api/v1/jobs/{body['id']}/").json()
    assert (at(detail["expected_finish_at"]) - at(detail["expected_start_at"])).total_seconds() == pytest.approx(
        body["estimated_seconds"], abs=0.002
    )
    assert detail["start_deadline"] is None


def test_a_quote_later_than_start_within_is_a_429_with_the_quote_and_records_nothing(api):
    submit(api, **VIDEO)
    submit(api, **VIDEO)
    count = Job.objects.count()
    before = timezone.now()
    refused = submit(api, **VIDEO, start_within=1)
    after = timezone.now()
    assert refused.status_code == 429, refused.json()
    body = refused.json()
    assert body["reason"] == "start_deadline" and body["start_within"] == 1
    assert "start_within" in body["detail"] and "raise start_within" in body["detail"]
    wait = 2 * 665.44 * 0.002  # the two videos ahead, on one card
    start, finish = at(body["expected_start_at"]), at(body["expected_finish_at"])
    assert before + timedelta(seconds=wait - 0.01) <= start <= after + timedelta(seconds=wait + 0.01)
    assert (finish - start).total_seconds() == pytest.approx(665.44 * 0.002, abs=0.002)
    assert refused["Retry-After"] == str(body["retry_after"]) == str(math.ceil(wait - 1))
    assert Job.objects.count() == count  # nothing recorded
    # A start_within the quote meets is accepted, and records its deadline.
    accepted = submit(api, **VIDEO, start_within=math.ceil(wait) + 1)
    assert accepted.status_code == 201, accepted.json()
    job = Job.objects.get(pk=accepted.json()["id"])
    assert job.start_deadline is not None and accepted.json()["start_deadline"]


@pytest.mark.parametrize("value", [0, -5, 7 * 24 * 3600 + 1, True, "soon", 1.5])
def test_start_within_must_be_a_whole_number_of_seconds_in_bounds(api, value):
    response = submit(api, start_within=value)
    assert response.status_code == 400
    assert "start_within" in response.json()
    assert not Job.objects.exists()


def test_the_sweeper_expires_an_overdue_queued_job_and_withdraws_its_message(api, monkeypatch):
    sends = capture_sends(monkeypatch, "send_webhook")
    job_id = submit(api, start_within=60, webhook_url="http://127.0.0.1:9/hook").json()["id"]
    keep = submit(api, start_within=60).json()["id"]  # not overdue: stays
    plain = submit(api).json()["id"]  # no deadline: stays
    assert job_id in broker.broker_job_ids(["encode"])
    Job.objects.filter(pk=job_id).update(start_deadline=timezone.now() - timedelta(seconds=1))
    assert services.expire_overdue() == 1
    job = Job.objects.get(pk=job_id)
    assert job.status == JobStatus.EXPIRED and job.stage == JobStage.EXPIRED and job.is_terminal
    assert "start deadline passed" in job.error and "start_within" in job.error
    assert job.finished_at is not None and job.started_at is None and job.steps_done == 0
    assert job_id not in broker.broker_job_ids(["encode"])  # its waiting message is gone
    assert {Job.objects.get(pk=pk).status for pk in (keep, plain)} == {JobStatus.QUEUED}
    assert ("webhook", job.pk, "expired") in [call[:3] for call in sends]  # a terminal event, by default
    assert services.expire_overdue() == 0  # once
    shown = api.get(f"/api/v1/jobs/{job_id}/").json()
    assert shown["status"] == "expired" and shown["expected_start_at"] is None and shown["eta_seconds"] is None
    assert [j["id"] for j in api.get("/api/v1/jobs/?status=expired").json()["results"]] == [job_id]


def test_a_worker_that_takes_an_overdue_job_ends_it_instead_of_running_it(api):
    encode_first = submit(api, start_within=60).json()["id"]
    Job.objects.filter(pk=encode_first).update(start_deadline=timezone.now() - timedelta(seconds=1))
    assert services.start_encoding(encode_first, "encode@test") is None
    assert Job.objects.get(pk=encode_first).status == JobStatus.EXPIRED

    # Encoded in time, then waiting for a card past its deadline: the chunk's claim ends it.
    job_id = submit(api, start_within=60).json()["id"]
    assert services.start_encoding(job_id, "encode@test") is not None
    assert services.finish_encoding(job_id, "encode@test", "embeddings/x")
    Job.objects.filter(pk=job_id).update(start_deadline=timezone.now() - timedelta(seconds=1))
    assert services.claim_chunk(job_id, "card0@test", 0) is None
    job = Job.objects.get(pk=job_id)
    assert job.status == JobStatus.EXPIRED and job.lease_owner == "" and job.chunks_run == 0


def test_a_job_that_started_never_expires(api):
    job_id = submit(api, start_within=60).json()["id"]
    services.start_encoding(job_id, "encode@test")
    services.finish_encoding(job_id, "encode@test", "embeddings/x")
    assert services.claim_chunk(job_id, "card0@test", 0) is not None
    services.record_first_step(job_id, timezone.now())  # its first step: started_at
    Job.objects.filter(pk=job_id).update(start_deadline=timezone.now() - timedelta(seconds=1))
    # Held: neither the sweeper nor another claim may touch it.
    assert services.expire_overdue() == 0
    # Released between chunks (a failed attempt): still not expired, and its next chunk runs.
    assert services.fail_attempt(job_id, "card0@test", "boom") == services.Outcome.RETRIED
    assert services.expire_overdue() == 0
    assert services.claim_chunk(job_id, "card0@test", 0) is not None
    assert Job.objects.get(pk=job_id).status == JobStatus.DENOISING


def test_a_held_encode_is_not_expired_under_the_worker(api):
    job_id = submit(api, start_within=60).json()["id"]
    assert services.start_encoding(job_id, "encode@test") is not None
    Job.objects.filter(pk=job_id).update(start_deadline=timezone.now() - timedelta(seconds=1))
    assert services.expire_overdue() == 0  # the encoder holds it
    assert services.finish_encoding(job_id, "encode@test", "embeddings/x")
    assert services.expire_overdue() == 1  # waiting for a card, unheld, never started: now it expires
    assert Job.objects.get(pk=job_id).status == JobStatus.EXPIRED


def test_expired_is_terminal_everywhere():
    assert JobStatus.EXPIRED in TERMINAL
    from genserver import webhooks
    from genserver.jobs.events import TERMINAL_EVENTS
    from genserver.jobs.models import DEFAULT_WEBHOOK_EVENTS, WEBHOOK_EVENTS

    assert "expired" in TERMINAL_EVENTS and "expired" in webhooks.EVENTS
    assert "expired" in WEBHOOK_EVENTS and "expired" in DEFAULT_WEBHOOK_EVENTS


def test_the_quote_is_none_while_no_card_serves_the_queue(api, monkeypatch):
    job_id = submit(api).json()["id"]
    from genserver.scheduling.pools import PoolLayout

    snapshot = selectors.QueueSnapshot(
        selectors.waiting_groups(), selectors.running_jobs(), PoolLayout((), complete=False)
    )
    assert snapshot.quote(Job.objects.get(pk=job_id)) == (None, None)
