"""The fair window at the service level, without workers: a burst is held beyond its owner's window, and held
jobs are released (best priority, then oldest) when the owner's jobs start or end unstarted, by the reaper, and
shown with a queue position that does not put another user's job behind them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from genserver.jobs import broker, services
from genserver.jobs.models import Job, JobStatus
from genserver.jobs.services import fairness
from genserver.redis_client import client as redis_client
from genserver.scheduling.fairness import FairWindow
from tests.conftest import submit

pytestmark = pytest.mark.django_db(transaction=True)  # the service publishes on commit

WORKER = "gpu0@test"


@pytest.fixture(autouse=True)
def _empty_broker():
    def clear() -> None:
        for queue in ("encode", "short", "medium", "long", "decode", "webhooks"):
            redis_client().delete(*broker.queue_keys(queue))

    clear()
    yield
    clear()


@pytest.fixture(autouse=True)
def _window_of_one(settings):
    """Window 1: a user's burst publishes FairWindow.burst jobs (4), then holds; one published at a time after."""
    settings.FAIR_WINDOW = 1
    settings.MAX_JOBS_IN_FLIGHT = 0
    settings.SUBMIT_RATE_LIMIT = 0


def published(job_id: str) -> bool:
    """Whether a message of the job waits in the broker (encode or a denoise queue)."""
    return job_id in broker.broker_job_ids({"encode", "short", "medium", "long"})


def burst(client, n: int, **fields) -> list[str]:
    ids = []
    for i in range(n):
        response = submit(client, prompt=f"burst {i}", **fields)
        assert response.status_code == 201, response.json()
        ids.append(response.json()["id"])
    return ids


def start(job_id: str, worker: str = WORKER) -> None:
    """What a card does to start a queued job: encode it, then claim its first chunk."""
    assert services.start_encoding(job_id, "encode@test") is not None
    assert services.finish_encoding(job_id, "encode@test", f"embeddings/{job_id}")
    assert services.claim_chunk(job_id, worker, 0) is not None


def held(ids: list[str]) -> list[bool]:
    rows = dict(Job.objects.filter(pk__in=ids).values_list("pk", "held"))
    return [rows[Job._meta.pk.to_python(i)] for i in ids]


def test_a_burst_is_held_beyond_the_window_and_released_as_its_jobs_start(api):
    ids = burst(api, 7)
    window = FairWindow(1)
    assert held(ids) == [False] * (window.size * window.burst) + [True] * 3
    assert [published(i) for i in ids] == [True] * 4 + [False] * 3  # a held job has no message
    assert Job.objects.get(pk=ids[5]).status == JobStatus.QUEUED
    start(ids[0])
    start(ids[1])
    start(ids[2])
    assert held(ids)[4:] == [True, True, True]  # the window (1) still holds the fourth, unstarted
    start(ids[3])  # the last of the window started: the oldest held job goes
    assert held(ids)[4:] == [False, True, True]
    assert published(ids[4])
    start(ids[4])
    assert held(ids)[5:] == [False, True]


def test_held_jobs_go_best_priority_first_and_a_held_job_just_changes_priority(api, staff_api):
    ids = burst(api, 6)
    assert held(ids)[4:] == [True, True]
    response = staff_api.post(f"/api/v1/jobs/{ids[5]}/priority/", data={"priority": 0}, content_type="application/json")
    assert response.status_code == 200, response.json()
    assert not published(ids[5])  # no message to move: it stays held, at its new priority
    for i in ids[:4]:
        start(i)
    assert held(ids)[4:] == [True, False]  # the newer one goes first: its priority is better
    assert published(ids[5])


def test_another_user_is_not_held_behind_a_burst_and_is_not_counted_behind_it(api, make_user):
    ids = burst(api, 10)
    bob = make_user("bob")
    mine = submit(bob, prompt="bob's one").json()
    assert not mine["held"] and published(mine["id"])
    # Six of alice's are held: bob's job waits behind her four published ones, not her ten.
    assert mine["queue_position"] == 4
    # A held job of alice's waits round-robin: her held jobs before it, and bob's turn for each.
    last = api.get(f"/api/v1/jobs/{ids[-1]}/").json()
    assert last["held"] is True
    assert last["queue_position"] >= mine["queue_position"] + 5  # her 4 published + her 5 held ahead, at least
    assert last["eta_seconds"] > api.get(f"/api/v1/jobs/{ids[4]}/").json()["eta_seconds"]


def test_a_cancel_of_an_unstarted_window_job_releases_the_next(api):
    ids = burst(api, 5)
    for i in ids[:3]:
        start(i)
    assert held(ids)[4] is True
    api.post(f"/api/v1/jobs/{ids[3]}/cancel/")
    assert Job.objects.get(pk=ids[3]).status == JobStatus.CANCELLED
    assert held(ids)[4] is False and published(ids[4])


def test_a_cancelled_held_job_ends_without_a_message(api):
    ids = burst(api, 5)
    response = api.post(f"/api/v1/jobs/{ids[4]}/cancel/")
    assert response.status_code == 202
    job = Job.objects.get(pk=ids[4])
    assert job.status == JobStatus.CANCELLED and not published(ids[4])


def test_an_expired_window_job_releases_the_next_and_a_held_job_may_expire(api):
    ids = burst(api, 4) + burst(api, 2, start_within=60)
    for i in ids[:3]:
        start(i)
    overdue = timezone.now() - timedelta(seconds=1)
    Job.objects.filter(pk=ids[3]).update(start_deadline=overdue)
    assert services.expire_overdue() == 1  # ids[3] (published, unstarted) ends...
    assert Job.objects.get(pk=ids[3]).status == JobStatus.EXPIRED
    assert held(ids)[4:] == [False, True]  # ...and ids[4] took its room
    Job.objects.filter(pk=ids[5]).update(start_deadline=overdue)
    assert services.expire_overdue() == 1
    assert Job.objects.get(pk=ids[5]).status == JobStatus.EXPIRED  # a held job expires too, never half-run


def test_the_reaper_releases_held_jobs_whose_owner_has_room_and_never_republishes_them(api, settings):
    ids = burst(api, 6)
    # A worker that died between its claim and the release: the window is empty, two jobs still held.
    Job.objects.filter(pk__in=ids[:4]).update(chunks_run=1, status=JobStatus.DENOISING, lease_owner=WORKER)
    settings.LEASE_SECONDS = 0
    outcomes = services.reap_stale()
    assert outcomes.get("released") == 1
    assert held(ids)[4:] == [False, True] and published(ids[4])
    assert not published(ids[5])


def test_window_zero_holds_nothing(api, settings):
    settings.FAIR_WINDOW = 0
    ids = burst(api, 9)
    assert held(ids) == [False] * 9
    assert all(published(i) for i in ids)


def test_admission_counts_held_jobs(api):
    from genserver.jobs import selectors

    burst(api, 7)
    backlog = sum(item.remaining_seconds for item in selectors.backlog_items())
    assert backlog == pytest.approx(sum(j.remaining_seconds * j.clock_scale for j in Job.objects.all()))


def test_a_job_released_after_its_embeddings_are_stored_skips_encode(api, monkeypatch):
    ids = burst(api, 5)
    monkeypatch.setattr(fairness, "stored_embeddings_key", lambda job: f"embeddings/{job.pk}")
    for i in ids[:4]:
        start(i)
    job = Job.objects.get(pk=ids[4])
    assert not job.held and job.status == JobStatus.DENOISING and job.embeddings_key
    assert ids[4] in broker.broker_job_ids({job.queue}) and ids[4] not in broker.broker_job_ids({"encode"})
