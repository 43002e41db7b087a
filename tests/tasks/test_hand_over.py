"""The path from a card's chunk boundary to its next step when it yields to better work (the hand-over), and from
a claim to a job's first step: a yield, and a job's last step, record the chunk in one statement; the card's
background work waits through the hand-over; and a job's first step begins with no write before it (its start is
written beside it)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from genserver.jobs import events, services
from genserver.jobs.models import Job, JobStage, JobStatus
from genserver.jobs.services import transitions
from tests.support.broker import capture_sends
from tests.tasks.test_denoise_boundary import job_with_one_step_chunks

pytestmark = pytest.mark.django_db(transaction=True)

ROW = ("status", "stage", "lease_owner", "lease_expires_at", "checkpoint_step", "steps_done", "chunks_run", "priority")


def run_from_step_0(job: Job, monkeypatch, *, yields: bool, ends_at: int) -> tuple[list[str], dict]:
    """Run the job's one-step chunks on a card that finds better work waiting at its first boundary (`yields`) or
    nothing (it runs on to the job's end), until the task ends at `ends_at`: the first word of each of the task's
    statements on the job table, and the row it left."""
    from tasks import denoise

    monkeypatch.setattr(denoise, "HEARTBEAT_EVERY_SECONDS", 1e9)  # no renewal: a first model load may take seconds
    monkeypatch.setattr(denoise.broker, "should_yield", lambda *args, **kwargs: yields)
    # The job's events are rendered on a worker's own thread, not here: their reads (which vary with what the
    # queue picture has cached) are not the task's statements.
    monkeypatch.setattr(events, "in_background", lambda work, *args: None)
    with CaptureQueriesContext(connection) as statements:
        outcome = denoise.run_chunk.apply(args=[str(job.pk), 0], kwargs={"model": job.model}).get()
    assert outcome == f"step {ends_at}"
    denoise._off_the_boundary.submit(lambda: None).result()
    row = Job.objects.values(*ROW, "checkpoint_key", "published_at", "card_seconds", "measured_step_seconds").get(
        pk=job.pk
    )
    return [q["sql"].split()[0] for q in statements.captured_queries if "jobs_job" in q["sql"]], row


def test_a_yield_is_one_statement_that_leaves_the_row_and_the_message_of_the_locked_path(make_user, monkeypatch):
    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    owner = make_user("yields").user
    one = job_with_one_step_chunks(owner, 6)
    sent.clear()
    alone, alone_row = run_from_step_0(one, monkeypatch, yields=True, ends_at=1)
    alone_sent = list(sent)

    monkeypatch.setattr(transitions, "_record_chunk_alone", lambda *args, **kwargs: False)  # the locked path
    other = job_with_one_step_chunks(owner, 6)
    sent.clear()
    locked, locked_row = run_from_step_0(other, monkeypatch, yields=True, ends_at=1)

    # The claim, its merge partners' read, then the chunk's record with the lease let go; the locked path reads
    # the row first.
    assert alone == ["UPDATE", "SELECT", "UPDATE"] and locked == ["UPDATE", "SELECT", "SELECT", "UPDATE"]
    for row in (alone_row, locked_row):
        assert (row["status"], row["stage"], row["lease_owner"], row["lease_expires_at"]) == (
            JobStatus.DENOISING,
            JobStage.WAITING,
            "",
            None,
        )
        assert row["published_at"] is not None and row["card_seconds"] > 0 and row["measured_step_seconds"] > 0
    assert [alone_row[f] for f in ROW] == [locked_row[f] for f in ROW]
    keys = alone_row["checkpoint_key"].replace(str(one.pk), ""), locked_row["checkpoint_key"].replace(str(other.pk), "")
    assert keys[0] == keys[1]
    assert alone_sent == [("chunk", one.pk, 1, one.queue, alone_row["priority"], one.model)]
    assert sent == [("chunk", other.pk, 1, other.queue, locked_row["priority"], other.model)]


def test_a_last_step_is_one_statement_that_leaves_the_row_and_the_decode_message_of_the_locked_path(
    make_user, monkeypatch
):
    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    owner = make_user("last-step").user
    found: dict[str, tuple[list[str], dict]] = {}
    for path in ("alone", "locked"):
        if path == "locked":
            monkeypatch.setattr(transitions, "_record_last_chunk", lambda *args, **kwargs: False)
        job = job_with_one_step_chunks(owner, 2)
        sent.clear()
        found[path] = _, row = run_from_step_0(job, monkeypatch, yields=False, ends_at=2)
        # At the priority the row holds at its last step (the kept boundary before it set it).
        assert sent == [("decode", job.pk, row["priority"], job.model)]
    (alone, alone_row), (locked, locked_row) = found["alone"], found["locked"]
    # The claim, its merge partners' read, the kept boundary at step 1, the last step's record; the locked path
    # reads the row before it.
    assert alone == ["UPDATE", "SELECT", "UPDATE", "UPDATE"] and locked == [
        "UPDATE",
        "SELECT",
        "UPDATE",
        "SELECT",
        "UPDATE",
    ]
    assert [alone_row[f] for f in ROW] == [locked_row[f] for f in ROW]
    assert (alone_row["status"], alone_row["stage"], alone_row["lease_owner"]) == (
        JobStatus.DECODING,
        JobStage.WAITING,
        "",
    )
    assert alone_row["published_at"] is not None and alone_row["card_seconds"] > 0


def test_a_yield_of_a_job_asked_to_cancel_takes_the_locked_path_and_ends_it(make_user, monkeypatch):
    from tasks import denoise

    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    job = job_with_one_step_chunks(make_user("yield-cancel").user, 6)
    run = denoise.stages.run_merged_chunk

    def cancelled_during_the_chunk(*args, **kwargs):
        Job.objects.filter(pk=job.pk).update(cancel_requested=True)  # asked after the claim read the flags
        return run(*args, **kwargs)

    monkeypatch.setattr(denoise.stages, "run_merged_chunk", cancelled_during_the_chunk)
    sent.clear()
    _, row = run_from_step_0(job, monkeypatch, yields=True, ends_at=1)
    assert row["status"] == JobStatus.CANCELLED and sent == []  # the compare-and-set did not apply: the locked path


def test_the_card_holds_its_background_work_through_a_hand_over_and_not_after_a_kept_run(make_user, monkeypatch):
    from tasks import denoise

    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    ends: list[str] = []
    monkeypatch.setattr(events, "card_handing_over", lambda: ends.append("handing over"))
    stepping = events.card_stepping
    monkeypatch.setattr(events, "card_stepping", lambda: (ends.append("stepping"), stepping())[1])
    owner = make_user("hand-over").user

    job = job_with_one_step_chunks(owner, 6)
    monkeypatch.setattr(denoise.broker, "should_yield", lambda *args, **kwargs: True)
    assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == "step 1"
    assert ends[-1] == "handing over"  # the task's end: the card goes on to the waiting message

    monkeypatch.setattr(denoise.broker, "should_yield", lambda *args, **kwargs: False)
    assert denoise.run_chunk.apply(args=[str(job.pk), 1]).get() == "step 6"
    assert ends[-1] == "stepping"  # it ran to the job's end: nothing was waiting for the card
    events.card_stepping()


def test_a_first_step_begins_with_no_write_after_the_claim_and_its_start_is_recorded_before_the_chunk(
    make_user, monkeypatch
):
    from tasks import denoise

    monkeypatch.setattr(denoise, "HEARTBEAT_EVERY_SECONDS", 1e9)  # no renewal: a first model load may take seconds
    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    job = job_with_one_step_chunks(make_user("first-step").user, 2)
    run = denoise.stages.run_merged_chunk
    seen: dict[str, object] = {}

    def running(family, store, states, **kwargs):
        should_stop = kwargs["should_stop"]

        def asking(state, step):
            answer = should_stop(state, step)
            seen.setdefault("first step", len(statements.captured_queries))  # the step begins after this
            return answer

        return run(family, store, states, **kwargs | {"should_stop": asking})

    finish = services.finish_chunk

    def finishing(job_id, *args, **kwargs):
        seen.setdefault("started when recorded", Job.objects.values_list("started_at", flat=True).get(pk=job_id))
        return finish(job_id, *args, **kwargs)

    monkeypatch.setattr(denoise.stages, "run_merged_chunk", running)
    monkeypatch.setattr(denoise.services, "finish_chunk", finishing)
    with CaptureQueriesContext(connection) as statements:
        assert denoise.run_chunk.apply(args=[str(job.pk), 0], kwargs={"model": job.model}).get() == "step 2"
    before_the_step = [q["sql"].split()[0] for q in statements.captured_queries[: seen["first step"]]]
    assert before_the_step.count("UPDATE") == 1  # the claim: no write of the start (or of anything) after it
    row = Job.objects.get(pk=job.pk)
    assert row.started_at is not None and seen["started when recorded"] == row.started_at


def test_a_worker_that_stops_during_a_hand_over_lets_the_work_it_held_run(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from tasks import common

    monkeypatch.setattr(events, "_watcher", None)
    events.hold_hand_overs_while_busy()  # as a worker does (its own watcher, ended after the test)
    monkeypatch.setattr(events, "CARD_BUSY_MAX_SECONDS", 60.0)
    monkeypatch.setattr(events, "HAND_OVER_MAX_SECONDS", 60.0)
    executor = ThreadPoolExecutor(max_workers=1)
    seen: list[str] = []
    events.card_busy()
    held = events.after_the_card(executor, seen.append, "the yielded chunk's")
    events.card_handing_over()
    assert not held.done()
    common.release_held_work()  # Celery's worker_shutdown: the process exits next
    executor.shutdown(wait=True)  # what the interpreter's exit does with a worker's threads
    assert held.done() and seen == ["the yielded chunk's"]
