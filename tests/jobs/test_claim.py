"""A chunk's claim (services.claim_chunk): one UPDATE … RETURNING that takes the job and hands back its row as
a re-read would, or takes nothing; and the first chunk's fair-window follow-ups still run."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from genserver.jobs import services
from genserver.jobs.models import Job, JobStage, JobStatus
from genserver.redis_client import LEAD_IN, STAGE_SECONDS_KEY, client as redis_client
from tests.support.broker import capture_sends
from tests.support.jobs import make_job

pytestmark = pytest.mark.django_db(transaction=True)  # the claim's follow-ups run on commit

CARD = "card0@test:1"


def waiting_to_denoise(owner, **fields) -> Job:
    waiting = {"status": JobStatus.DENOISING, "stage": JobStage.WAITING, "embeddings_key": "embeddings/x.pt"}
    return make_job(owner, **(waiting | fields))


def test_a_claim_is_one_statement_on_the_job_and_returns_the_row_a_read_gives(django_user_model):
    job = waiting_to_denoise(django_user_model.objects.create_user("claims"), webhook_events=["succeeded"])
    with transaction.atomic():  # its follow-ups (events, the fair window) run on commit, after the capture
        with CaptureQueriesContext(connection) as statements:
            claimed = services.claim_chunk(job.pk, CARD, 0)
    on_the_job = [q["sql"] for q in statements.captured_queries if "jobs_job" in q["sql"]]
    assert len(on_the_job) == 1 and on_the_job[0].startswith("UPDATE") and "RETURNING" in on_the_job[0], on_the_job
    read = Job.objects.get(pk=job.pk)
    assert claimed is not None and claimed.pk == job.pk
    # Every column as the ORM reads it: UUIDs, datetimes, JSON and booleans come back typed, not as raw text.
    for field in Job._meta.concrete_fields:
        assert getattr(claimed, field.attname) == getattr(read, field.attname), field.name
    assert (read.stage, read.lease_owner, read.chunks_run) == (JobStage.DENOISING, CARD, 1)
    assert read.lease_expires_at > timezone.now() and claimed.webhook_events == ["succeeded"]


@pytest.mark.parametrize(
    "change",
    [
        {"lease_owner": "card1@test:1", "lease_expires_at": timezone.now() + timedelta(hours=1)},  # held elsewhere
        {"checkpoint_step": 4},  # this chunk already ran
        {"cancel_requested": True},
        {"held": True},  # its owner's fair window holds it
        {"status": JobStatus.SUCCEEDED},
    ],
    ids=["leased", "ran", "cancel", "held", "ended"],
)
def test_a_claim_that_must_not_take_the_job_changes_nothing(django_user_model, change):
    job = waiting_to_denoise(django_user_model.objects.create_user("refused"), **change)
    before = {f.attname: getattr(Job.objects.get(pk=job.pk), f.attname) for f in Job._meta.concrete_fields}
    assert services.claim_chunk(job.pk, CARD, 0) is None
    after = Job.objects.get(pk=job.pk)
    assert {f.attname: getattr(after, f.attname) for f in Job._meta.concrete_fields} == before


def test_an_expired_lease_is_taken_over(django_user_model):
    job = waiting_to_denoise(
        django_user_model.objects.create_user("takeover"),
        lease_owner="card1@test:1",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
        chunks_run=3,
    )
    claimed = services.claim_chunk(job.pk, CARD, 0)
    assert claimed is not None and (claimed.lease_owner, claimed.chunks_run) == (CARD, 4)


def test_a_first_claim_releases_the_owners_next_held_job(django_user_model, monkeypatch):
    """The first chunk leaves its owner's fair window: the claim's follow-up publishes the next held job."""
    released = []
    monkeypatch.setattr(services.fairness, "release_held", lambda owner, queue: released.append((owner, queue)))
    job = waiting_to_denoise(django_user_model.objects.create_user("window"))
    services.claim_chunk(job.pk, CARD, 0)
    assert released == [(job.owner_id, job.queue)]
    # A later chunk of the same job is not its start: nothing more to release.
    Job.objects.filter(pk=job.pk).update(lease_owner="", checkpoint_step=2)
    services.claim_chunk(job.pk, CARD, 2)
    assert released == [(job.owner_id, job.queue)]


def test_an_encode_claim_is_one_statement_and_a_retried_encode_is_taken_again(django_user_model):
    owner = django_user_model.objects.create_user("encodes")
    job = make_job(owner, status=JobStatus.QUEUED, stage=JobStage.WAITING)
    with transaction.atomic():
        with CaptureQueriesContext(connection) as statements:
            taken = services.start_encoding(job.pk, CARD)
    on_the_job = [q["sql"] for q in statements.captured_queries if "jobs_job" in q["sql"]]
    assert len(on_the_job) == 1 and "RETURNING" in on_the_job[0], on_the_job
    read = Job.objects.get(pk=job.pk)
    assert taken is not None and (read.status, read.lease_owner) == (JobStatus.ENCODING, CARD)
    assert all(getattr(taken, f.attname) == getattr(read, f.attname) for f in Job._meta.concrete_fields)
    # Its worker died: once the lease is over, the redelivered encode takes it again (from encoding).
    Job.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    again = services.start_encoding(job.pk, "card1@test:1")
    assert again is not None and again.lease_owner == "card1@test:1"
    # A cancel asked meanwhile: not taken.
    other = make_job(owner, status=JobStatus.QUEUED, stage=JobStage.WAITING, cancel_requested=True)
    assert services.start_encoding(other.pk, CARD) is None
    assert Job.objects.get(pk=other.pk).lease_owner == ""


def test_a_release_that_fails_is_logged_and_the_claim_stands(django_user_model, monkeypatch, caplog):
    """The reaper releases what a failed release left held: the card's claim does not fail for it."""

    def broken(owner, queue):
        raise RuntimeError("database went away")

    monkeypatch.setattr(services.fairness, "release_held", broken)
    job = waiting_to_denoise(django_user_model.objects.create_user("broken-release"))
    assert services.claim_chunk(job.pk, CARD, 0) is not None
    assert Job.objects.get(pk=job.pk).lease_owner == CARD
    assert "background work broken(" in caplog.text and "database went away" in caplog.text


def test_an_encode_finished_by_its_claimer_is_one_statement_then_its_chunk_is_published_first(
    django_user_model, monkeypatch
):
    """The encode task passes the row it claimed: the finish is one compare-and-set, and the chunk's publish is the
    first thing after it commits (the log line, the event and the lead-in learned come after)."""
    order: list[tuple] = capture_sends(monkeypatch, "send_chunk")
    monkeypatch.setattr(services.observe, "_report", lambda *args: order.append(("report",)))
    monkeypatch.setattr(services.transitions.events, "publish", lambda job_id, kind: order.append(("event", kind)))
    redis_client().delete(STAGE_SECONDS_KEY)
    job = make_job(django_user_model.objects.create_user("encoded"), status=JobStatus.QUEUED, stage=JobStage.QUEUED)
    Job.objects.filter(pk=job.pk).update(published_at=timezone.now() - timedelta(seconds=2))
    claimed = services.start_encoding(job.pk, CARD)
    order.clear()
    with transaction.atomic():
        with CaptureQueriesContext(connection) as statements:
            assert services.finish_encoding(job.pk, CARD, "embeddings/y.pt", claimed=claimed)
        assert order == []  # nothing is published before the row commits
    on_the_job = [q["sql"] for q in statements.captured_queries if "jobs_job" in q["sql"]]
    assert len(on_the_job) == 1 and on_the_job[0].startswith("UPDATE") and "RETURNING" in on_the_job[0], on_the_job
    assert order[0] == ("chunk", job.pk, 0, job.queue, job.priority, job.model) and ("event", "waiting") in order[1:]
    read = Job.objects.get(pk=job.pk)
    assert (read.status, read.stage, read.embeddings_key, read.lease_owner) == (
        JobStatus.DENOISING,
        JobStage.WAITING,
        "embeddings/y.pt",
        "",
    )
    assert read.published_at > claimed.published_at  # its chunk's publish, which the queue picture counts from
    learned = float(redis_client().hget(STAGE_SECONDS_KEY, f"{job.model}:{LEAD_IN}"))
    assert learned == pytest.approx((read.published_at - claimed.published_at).total_seconds())


def test_an_encode_cancelled_while_it_ran_ends_cancelled_without_its_chunk(django_user_model, monkeypatch):
    sent = capture_sends(monkeypatch, "send_chunk")
    job = make_job(django_user_model.objects.create_user("cancelled"), status=JobStatus.QUEUED, stage=JobStage.QUEUED)
    claimed = services.start_encoding(job.pk, CARD)
    Job.objects.filter(pk=job.pk).update(cancel_requested=True)
    assert services.finish_encoding(job.pk, CARD, "embeddings/z.pt", claimed=claimed)
    assert Job.objects.get(pk=job.pk).status == JobStatus.CANCELLED and sent == []
    # Another worker's lease (the reaper gave the encode away): nothing changes.
    other = make_job(job.owner, status=JobStatus.QUEUED, stage=JobStage.QUEUED)
    claimed = services.start_encoding(other.pk, CARD)
    Job.objects.filter(pk=other.pk).update(lease_owner="card1@test:1")
    assert not services.finish_encoding(other.pk, CARD, "embeddings/z.pt", claimed=claimed)
    assert Job.objects.get(pk=other.pk).status == JobStatus.ENCODING and sent == []


def test_the_claim_is_compiled_once_and_binds_each_calls_values(django_user_model, monkeypatch):
    """The claim's SQL is Django's, compiled once per process: later claims compile nothing and bind their own
    job, card, step and clock (a job whose expired lease another card held is taken; a wrong step is not)."""
    from genserver.jobs.services import _common, transitions

    owner = django_user_model.objects.create_user("compiled")
    assert transitions._CLAIM_CHUNK.compiled()
    monkeypatch.setattr(_common, "_update_returning_sql", lambda *a: pytest.fail("a kept claim compiled again"))
    lapsed = waiting_to_denoise(
        owner, lease_owner="card1@test:1", lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    later = waiting_to_denoise(owner, checkpoint_step=3)
    claimed = services.claim_chunk(lapsed.pk, CARD, 0)
    assert claimed is not None and (claimed.pk, claimed.lease_owner, claimed.chunks_run) == (lapsed.pk, CARD, 1)
    assert claimed.lease_expires_at > timezone.now() and claimed.chunk_started_at <= timezone.now()
    assert services.claim_chunk(later.pk, "card2@test:1", 0) is None  # its step is 3
    taken = services.claim_chunk(later.pk, "card2@test:1", 3)
    assert taken is not None and taken.lease_owner == "card2@test:1"
    assert Job.objects.get(pk=lapsed.pk).lease_owner == CARD  # the other job untouched by the later binds


def test_a_shape_with_a_value_derived_from_a_named_one_is_compiled_at_every_call(django_user_model):
    """A value `build` computes from a named one (here `now` less a second) would be frozen into a kept statement:
    the two stand-in compilations tell, and nothing is kept; the update still runs, compiled each time."""
    from django.db.models import Q

    from genserver.jobs.services._common import CompiledUpdate

    derived = CompiledUpdate(
        lambda v: (Q(lease_expires_at__lt=v["now"] - timedelta(seconds=1)), {"lease_owner": v["worker"]}),
        {"now": "lease_expires_at", "worker": "lease_owner"},
    )
    assert not derived.compiled()
    job = waiting_to_denoise(
        django_user_model.objects.create_user("derived"), lease_owner="x", lease_expires_at=timezone.now()
    )
    assert derived(job.pk, now=timezone.now() + timedelta(seconds=5), worker=CARD).lease_owner == CARD
    assert derived(job.pk, now=timezone.now() - timedelta(hours=1), worker="y") is None
