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
from genserver.redis_client import AHEAD_KEY, client as redis_client
from tests.conftest import submit

pytestmark = [
    pytest.mark.django_db(transaction=True),  # the service publishes on commit
    pytest.mark.usefixtures("empty_broker"),
]

WORKER = "gpu0@test"


@pytest.fixture(autouse=True)
def _window_of_one(settings):
    """Window 1: alone, a user has one job published and unstarted per queue, the rest held."""
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
    ids = burst(api, 4)
    assert held(ids) == [False, True, True, True]
    assert [published(i) for i in ids] == [True, False, False, False]  # a held job has no message
    assert Job.objects.get(pk=ids[2]).status == JobStatus.QUEUED
    start(ids[0])  # it started: the oldest held job goes
    assert held(ids) == [False, False, True, True]
    assert published(ids[1])
    start(ids[1])
    assert held(ids)[2:] == [False, True]


def test_held_jobs_go_best_priority_first_and_a_held_job_just_changes_priority(api, staff_api):
    ids = burst(api, 3)
    assert held(ids) == [False, True, True]
    response = staff_api.post(f"/api/v1/jobs/{ids[2]}/priority/", data={"priority": 0}, content_type="application/json")
    assert response.status_code == 200, response.json()
    assert not published(ids[2])  # no message to move: it stays held, at its new priority
    start(ids[0])
    assert held(ids)[1:] == [True, False]  # the newer one goes first: its priority is better
    assert published(ids[2])


def test_another_user_goes_ahead_of_a_burst_and_is_neither_held_nor_counted_behind_it(api, make_user):
    ids = burst(api, 10)
    bob = make_user("bob")
    mine = [submit(bob, prompt=f"bob's {i}").json() for i in range(3)]
    # bob has fewer waiting than alice: none of his is held, however many beyond the window.
    assert [m["held"] for m in mine] == [False] * 3 and all(published(m["id"]) for m in mine)
    # And his jobs go one priority step ahead of hers (alone, hers kept their own): taken before her
    # published one, not behind it in the same first-come list.
    priorities = dict(Job.objects.filter(pk__in=[*ids, *(m["id"] for m in mine)]).values_list("pk", "priority"))
    own = priorities[Job._meta.pk.to_python(ids[0])]
    assert own > 0 and {priorities[Job._meta.pk.to_python(i)] for i in ids} == {own}
    assert all(priorities[Job._meta.pk.to_python(m["id"])] == own - 1 for m in mine)
    assert [bob.get(f"/api/v1/jobs/{m['id']}/").json()["queue_position"] for m in mine] == [0, 1, 2]
    assert api.get(f"/api/v1/jobs/{ids[0]}/").json()["queue_position"] == 3
    # A held job of alice's waits round-robin: her held jobs before it, and bob's turn for each.
    second, last = (api.get(f"/api/v1/jobs/{i}/").json() for i in (ids[1], ids[-1]))
    assert second["held"] is True and last["held"] is True
    assert second["queue_position"] == 1 + 3  # her published one and bob's three
    assert last["queue_position"] == 1 + 3 + 8  # and her eight held before it (bob holds nothing more)
    assert last["eta_seconds"] > second["eta_seconds"]


def test_a_job_placed_ahead_is_marked_until_its_first_chunk_is_claimed_and_may_cut_one_card(api, make_user):
    """The mark lets a card running another user's chunk cut it for the job's waiting message: one card per
    message, only at a better priority than that card's continuation, only once the job has waited."""
    alice_ids = burst(api, 2)
    bob = make_user("bob")
    theirs = submit(bob, prompt="one of bob's").json()
    r = redis_client()
    assert r.get(AHEAD_KEY.format(job_id=theirs["id"])) is not None
    assert r.get(AHEAD_KEY.format(job_id=alice_ids[0])) is None  # alone when she submitted: not ahead
    job = Job.objects.get(pk=theirs["id"])
    start_encoding_and_wait(theirs["id"])  # its first chunk's message now waits on its queue
    queues = [job.queue]
    assert not broker.claim_cut(queues, job.priority, "card1@test", waited=0.0)  # not better than that card's
    assert not broker.claim_cut(queues, job.priority + 1, "card1@test", waited=3600.0)  # not waited long enough
    assert broker.claim_cut(queues, job.priority + 1, "card1@test", waited=0.0)
    assert not broker.claim_cut(queues, job.priority + 1, "card2@test", waited=0.0)  # claimed: one cut per message
    assert services.claim_chunk(theirs["id"], WORKER, 0) is not None
    assert r.get(AHEAD_KEY.format(job_id=theirs["id"])) is None


def test_a_waiting_message_not_placed_ahead_cuts_nobody(api):
    ids = burst(api, 1)
    start_encoding_and_wait(ids[0])
    job = Job.objects.get(pk=ids[0])
    assert not broker.claim_cut([job.queue], job.priority + 1, "card1@test", waited=0.0)


def start_encoding_and_wait(job_id: str) -> None:
    """What the encode worker does: the job's first chunk is published and waits for a card."""
    assert services.start_encoding(job_id, "encode@test") is not None
    assert services.finish_encoding(job_id, "encode@test", f"embeddings/{job_id}")


def test_a_user_who_is_not_lighter_than_every_other_keeps_its_priority(api, make_user):
    alice_ids = burst(api, 2)  # alice: 2 unstarted (1 published, 1 held)
    bob, carol = make_user("bob"), make_user("carol")
    bobs = [submit(bob, prompt=f"bob's {i}").json()["id"] for i in range(2)]  # 0 then 1 waiting: both ahead
    carols = submit(carol, prompt="carol's").json()["id"]  # 0 waiting, fewer than alice's 2 and bob's 2: ahead
    later = submit(bob, prompt="bob's third").json()  # bob has 2 waiting, as many as alice: not ahead
    priorities = dict(Job.objects.values_list("pk", "priority"))
    own = priorities[Job._meta.pk.to_python(alice_ids[0])]
    assert [priorities[Job._meta.pk.to_python(i)] for i in [*bobs, carols]] == [own - 1] * 3
    assert later["held"] is True and priorities[Job._meta.pk.to_python(later["id"])] == own


def test_a_cancel_of_an_unstarted_window_job_releases_the_next(api):
    ids = burst(api, 2)
    assert held(ids)[1] is True
    api.post(f"/api/v1/jobs/{ids[0]}/cancel/")
    assert Job.objects.get(pk=ids[0]).status == JobStatus.CANCELLED
    assert held(ids)[1] is False and published(ids[1])


def test_a_cancelled_held_job_ends_without_a_message(api):
    ids = burst(api, 2)
    response = api.post(f"/api/v1/jobs/{ids[1]}/cancel/")
    assert response.status_code == 202
    job = Job.objects.get(pk=ids[1])
    assert job.status == JobStatus.CANCELLED and not published(ids[1])
    assert not held(ids)[0]  # the published one is untouched


def test_an_expired_window_job_releases_the_next_and_a_held_job_may_expire(api):
    ids = burst(api, 3, start_within=60)
    overdue = timezone.now() - timedelta(seconds=1)
    Job.objects.filter(pk=ids[0]).update(start_deadline=overdue)
    assert services.expire_overdue() == 1  # ids[0] (published, unstarted) ends...
    assert Job.objects.get(pk=ids[0]).status == JobStatus.EXPIRED
    assert held(ids)[1:] == [False, True]  # ...and ids[1] took its room
    Job.objects.filter(pk=ids[2]).update(start_deadline=overdue)
    assert services.expire_overdue() == 1
    assert Job.objects.get(pk=ids[2]).status == JobStatus.EXPIRED  # a held job expires too, never half-run


def test_the_reaper_releases_held_jobs_whose_owner_has_room_and_never_republishes_them(api):
    ids = burst(api, 3)
    # A worker that died between its claim and the release: the window is empty, two jobs still held.
    Job.objects.filter(pk=ids[0]).update(chunks_run=1, status=JobStatus.DENOISING, lease_owner=WORKER)
    outcomes = services.reap_stale()
    assert outcomes.get("released") == 1
    assert held(ids)[1:] == [False, True] and published(ids[1])
    assert not published(ids[2])


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
    ids = burst(api, 2)
    monkeypatch.setattr(fairness, "_first_chunk_embeddings", lambda job: f"embeddings/{job.pk}")
    start(ids[0])
    job = Job.objects.get(pk=ids[1])
    assert not job.held and job.status == JobStatus.DENOISING and job.embeddings_key
    assert ids[1] in broker.broker_job_ids({job.queue}) and ids[1] not in broker.broker_job_ids({"encode"})


def test_the_fair_picture_counts_each_users_published_unstarted_jobs_up_to_its_read_bound(
    api, make_user, settings, monkeypatch
):
    from genserver.jobs.selectors import positions

    settings.FAIR_WINDOW = 0  # nothing held: every job published
    bob = make_user("bob")
    burst(api, 4)
    burst(bob, 2)
    started = burst(bob, 1)[0]
    start(started)  # a started job is no longer counted
    picture = positions.fair_picture("short")
    assert picture.published == {api.user.pk: 4, bob.user.pk: 2} and picture.complete
    assert positions.fair_picture("long").published == {}
    monkeypatch.setattr(positions, "PUBLISHED_READ", 5)  # the read stops at 5 of the 6 rows: partial counts
    partial = positions.fair_picture("short")
    assert sum(partial.published.values()) == 5 and not partial.complete
    monkeypatch.setattr(positions, "PUBLISHED_READ", 7)
    assert positions.fair_picture("short").complete


def test_the_fair_picture_reads_the_held_tally_and_the_published_counts_in_one_statement(api, make_user):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from genserver.jobs.selectors import positions

    bob = make_user("bob")
    burst(api, 4)  # one published, three held
    burst(bob, 2)
    with CaptureQueriesContext(connection) as captured:
        picture = positions.fair_picture("short")
    assert len(captured.captured_queries) == 1
    assert sorted(picture.held, key=repr) == sorted(positions.held_rows(), key=repr) and picture.held
    assert sum(r.count for r in picture.held if r.owner_id == api.user.pk) == 3
    assert picture.published == {api.user.pk: 1, bob.user.pk: 2} and picture.complete  # bob, the lighter: none held
    assert positions.fair_picture("short", held=[]).published == picture.published  # the counts alone
