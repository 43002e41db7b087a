"""A chunk boundary where the card keeps the job (services.finish_chunk with `claimed`): one conditional UPDATE
that records what the locked path records, and every boundary where more happens goes the locked way."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from genserver.jobs import services
from genserver.jobs.models import Job, JobSegment, JobStatus
from tests.support.broker import capture_sends
from tests.support.jobs import make_job

pytestmark = pytest.mark.django_db(transaction=True)  # the service publishes on commit

CARD = "card0@test:1"
# What a boundary records; the checkpoint key differs by job and is compared by its step.
RECORDED = (
    "status",
    "stage",
    "checkpoint_step",
    "steps_done",
    "measured_step_seconds",
    "chunks_run",
    "card_seconds",
    "priority",
    "lease_owner",
    "steps",
)


@pytest.fixture
def sent(monkeypatch):
    return capture_sends(monkeypatch, "send_chunk", "send_decode", send_segment_decode=lambda *a: ("segment",))


def claimed_by_the_card(owner, request: dict | None = None, done: int = 4) -> Job:
    """A job this card claimed, `done` steps checkpointed, its lease running: the row the worker holds."""
    return make_job(
        owner,
        request,
        status=JobStatus.DENOISING,
        stage="denoising",
        embeddings_key="embeddings/x.pt",
        checkpoint_step=done,
        steps_done=done,
        checkpoint_key="checkpoints/x/step-00004.pt",
        lease_owner=CARD,
        lease_expires_at=timezone.now() + timedelta(seconds=0.5),  # the tests' lease is 3 s
        card_seconds=1.5,
        chunks_run=1,
    )


def kept(job: Job, step: int, claimed: Job | None) -> bool:
    key = f"checkpoints/{job.pk}/step-{step:05d}.pt"
    return services.finish_chunk(job.pk, CARD, step, key, 0.05, keep_lease=True, chunk_seconds=0.2, claimed=claimed)


def recorded(job: Job) -> tuple:
    row = Job.objects.get(pk=job.pk)
    assert row.checkpoint_key.endswith(f"step-{row.checkpoint_step:05d}.pt")
    return tuple(getattr(row, field) for field in RECORDED)


def test_a_kept_boundary_is_one_update_and_records_what_the_locked_path_does(django_user_model, sent):
    owner = django_user_model.objects.create_user("kept")
    fast, locked = claimed_by_the_card(owner), claimed_by_the_card(owner)
    with CaptureQueriesContext(connection) as statements:
        assert kept(fast, 8, claimed=fast)
    assert kept(locked, 8, claimed=None)
    on_jobs = [q["sql"] for q in statements.captured_queries if "jobs_job" in q["sql"]]
    assert len(on_jobs) == 1 and on_jobs[0].startswith("UPDATE"), on_jobs
    assert recorded(fast) == recorded(locked)
    row = Job.objects.get(pk=fast.pk)
    assert (row.checkpoint_step, row.chunks_run, row.lease_owner) == (8, 2, CARD)
    assert row.card_seconds == pytest.approx(1.7)
    assert row.lease_expires_at > fast.lease_expires_at  # renewed, as the locked path renews it
    assert sent == []  # the card runs the next chunk itself


def test_a_step_already_recorded_or_a_lost_lease_records_nothing(django_user_model, sent):
    job = claimed_by_the_card(django_user_model.objects.create_user("late"))
    assert not kept(job, 4, claimed=job)  # a redelivered boundary: that step is already there
    Job.objects.filter(pk=job.pk).update(lease_owner="card1@test:1")  # the reaper gave the job away
    assert not kept(job, 8, claimed=job)
    row = Job.objects.get(pk=job.pk)
    assert (row.checkpoint_step, row.chunks_run, row.lease_owner) == (4, 1, "card1@test:1")


def test_a_cancel_asked_meanwhile_ends_the_job_at_the_boundary(django_user_model, sent):
    job = claimed_by_the_card(django_user_model.objects.create_user("cancel"))
    Job.objects.filter(pk=job.pk).update(cancel_requested=True)  # the row's flag (its Redis twin missed)
    assert kept(job, 8, claimed=job)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.lease_owner, row.checkpoint_step) == (JobStatus.CANCELLED, "", 8)


def test_a_total_lowered_meanwhile_ends_the_job_at_its_steps(django_user_model, sent):
    job = claimed_by_the_card(django_user_model.objects.create_user("lowered"))
    Job.objects.filter(pk=job.pk).update(steps=6)  # POST /steps/ while the chunk ran; the card runs 20
    assert kept(job, 8, claimed=job)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.steps, row.lease_owner) == (JobStatus.DECODING, 8, "")
    assert sent == [("decode", job.pk, row.priority, row.model)]


def test_the_last_step_publishes_the_decode(django_user_model, sent):
    job = claimed_by_the_card(django_user_model.objects.create_user("last"))
    assert kept(job, 20, claimed=job)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.lease_owner) == (JobStatus.DECODING, "")
    assert sent == [("decode", job.pk, row.priority, row.model)]


def test_a_segments_end_publishes_its_decode(django_user_model, sent):
    video = {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 241, "steps": 20, "seed": 9}
    job = claimed_by_the_card(django_user_model.objects.create_user("segments"), video)
    assert job.segment_count == 3
    assert kept(job, 10, claimed=job) and not JobSegment.objects.filter(job=job).exists()
    assert kept(job, 20, claimed=job)  # segment 0's last step: its decode overlaps the next segment
    assert JobSegment.objects.get(job=job, index=0).checkpoint_key.endswith("step-00020.pt")
    assert sent == [("segment",)]
    assert Job.objects.get(pk=job.pk).lease_owner == CARD


def test_a_yield_is_one_update_and_records_and_publishes_what_the_locked_path_does(django_user_model, sent):
    owner = django_user_model.objects.create_user("yielded")
    fast, locked = claimed_by_the_card(owner), claimed_by_the_card(owner)
    for job, claimed in ((fast, fast), (locked, None)):
        key = f"checkpoints/{job.pk}/step-00008.pt"
        with CaptureQueriesContext(connection) as statements:
            assert services.finish_chunk(job.pk, CARD, 8, key, None, chunk_seconds=0.2, claimed=claimed)
        writes = [q["sql"] for q in statements.captured_queries if q["sql"].startswith('UPDATE "jobs_job"')]
        assert len(writes) == 1, writes
        assert ('"model" = ' in writes[0]) == (claimed is None)  # the compare-and-set, or the locked row's save
    assert recorded(fast) == recorded(locked)
    row = Job.objects.get(pk=fast.pk)
    assert (row.lease_owner, row.lease_expires_at, row.stage, row.measured_step_seconds) == ("", None, "waiting", None)
    assert sorted(map(str, sent)) == sorted(
        str(("chunk", job.pk, 8, job.queue, Job.objects.get(pk=job.pk).priority, job.model)) for job in (fast, locked)
    )


def test_a_cards_statements_are_compiled_once_on_this_database():
    """A boundary, a heartbeat, the first step's start, and an encode's or a decode's take and finish bind their
    values into SQL compiled at its first use (Django compiling the guard and the chunk's fields was half of a kept
    boundary's record): a shape change that made one of them compile at every call (a value derived from a named
    one, a field type the stand-ins cannot take, a JSON value the driver wraps) shows up here."""
    from genserver.jobs.services import transitions

    names = ("KEPT_CHUNK", "YIELDED_CHUNK", "LAST_CHUNK", "FIRST_STEP")
    names += ("START_ENCODING", "FINISH_ENCODING", "START_DECODING", "FINISH_DECODING")
    statements = {name: getattr(transitions, f"_{name}") for name in names}
    statements |= {f"heartbeat {shape}": beat for shape, beat in transitions._HEARTBEATS.items()}
    assert [name for name, statement in statements.items() if not statement.compiled()] == []
