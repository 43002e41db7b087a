"""A first chunk whose message carries its publisher's copy of the job's row begins its first step while the claim
is on its way to the database (GENSERVER_FIRST_STEP_BEFORE_CLAIM): the step runs before the claim answers, and the
job then runs as a claim-first chunk runs it; a claim that does not take the job throws the step away; a row that
changed since the copy runs again from the claimed row; a model that merges claims first when other work waits.
Run here as a worker runs them (real storage, database and Redis; the messages captured)."""

from __future__ import annotations

import json
import threading

import pytest
import redis
import torch

from genserver.jobs import broker, events, flags, rows
from genserver.jobs.models import Job, JobStage, JobStatus
from genserver.redis_client import CANCEL_KEY, STEPS_KEY, client as redis_client
from tests.support.broker import capture_sends, clear_broker
from tests.tasks.test_denoise_boundary import job_with_one_step_chunks

pytestmark = pytest.mark.django_db(transaction=True)

ENDED = ("status", "stage", "lease_owner", "steps_done", "checkpoint_step", "chunks_run", "attempts")


def message_row(job: Job) -> dict:
    """The row as the first chunk's message carries it (through JSON, as kombu sends it)."""
    return json.loads(json.dumps(rows.row_of(Job.objects.get(pk=job.pk))))


class Card:
    """The tiny model's steps and the claims on this card, in the order they happened; `gate`: each claim waits
    until a step has begun (a test of the order can then only pass if the step does not wait for the claim)."""

    def __init__(self, monkeypatch, *, gate: bool = False, fail_step: int | None = None) -> None:
        from tasks import denoise

        self.order: list[str] = []
        self.latents: list[torch.Tensor] = []
        stepped = threading.Event()
        family_type = type(denoise.family_of(Job(model="tiny-sd"), "denoise"))
        step, claim = family_type.step, denoise.services.claim_chunk
        save = denoise.stages.save_chunk_end

        def stepping(family, state):
            self.order.append(f"step {state.step}")
            stepped.set()
            if fail_step == state.step:
                raise RuntimeError("the card failed")
            return step(family, state)

        def claiming(*args):
            if gate:
                assert stepped.wait(60), "the claim waited for a step that never began"
            found = claim(*args)
            self.order.append("claim" if found else "claim refused")
            return found

        def saving(family, store, state, result, synced=True):
            self.latents.append(state.latents.clone())
            return save(family, store, state, result, synced=synced)

        monkeypatch.setattr(family_type, "step", stepping)
        monkeypatch.setattr(denoise.services, "claim_chunk", claiming)
        monkeypatch.setattr(denoise.stages, "save_chunk_end", saving)
        monkeypatch.setattr(denoise, "HEARTBEAT_EVERY_SECONDS", 1e9)
        monkeypatch.setattr(denoise.broker, "should_yield", lambda *args, **kwargs: False)  # it keeps the card
        monkeypatch.setattr(events, "in_background", lambda work, *args: None)

    def run(self, job: Job, row: dict | None) -> str:
        from tasks import denoise

        kwargs = {"model": job.model} | ({"row": row} if row is not None else {})
        outcome = denoise.run_chunk.apply(args=[str(job.pk), 0], kwargs=kwargs).get()
        denoise._off_the_boundary.submit(lambda: None).result()  # what the boundaries left to its thread
        return outcome


def ended(job: Job) -> tuple:
    return tuple(Job.objects.values_list(*ENDED).get(pk=job.pk))


def test_the_first_step_runs_before_the_claim_answers_and_the_job_ends_as_a_claimed_one_does(make_user, monkeypatch):
    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    owner = make_user("before-claim").user
    copied, claimed_first = (job_with_one_step_chunks(owner, 3, prompt="the same prompt") for _ in range(2))
    sent.clear()

    card = Card(monkeypatch, gate=True)
    assert card.run(copied, message_row(copied)) == "step 3"
    assert card.order == ["step 0", "claim", "step 1", "step 2"]  # the claim answered during the first step
    before = list(card.latents)  # each boundary's checkpoint

    card = Card(monkeypatch)
    assert card.run(claimed_first, None) == "step 3"
    assert card.order == ["claim", "step 0", "step 1", "step 2"]

    assert ended(copied) == ended(claimed_first) == (JobStatus.DECODING, JobStage.WAITING, "", 3, 3, 3, 0)
    assert Job.objects.get(pk=copied.pk).started_at is not None
    assert len(before) == len(card.latents) == 3
    assert all(map(torch.equal, before, card.latents))  # the same seed and prompt: the same latents at every step
    assert sent == [
        ("decode", copied.pk, Job.objects.get(pk=copied.pk).priority, copied.model),
        ("decode", claimed_first.pk, Job.objects.get(pk=claimed_first.pk).priority, claimed_first.model),
    ]


def test_a_step_whose_claim_does_not_take_the_job_is_thrown_away(make_user, monkeypatch):
    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    job = job_with_one_step_chunks(make_user("refused").user, 3)
    row = message_row(job)
    # Asked after the card read the flags, before its claim: the claim refuses what the step began.
    Job.objects.filter(pk=job.pk).update(cancel_requested=True)
    sent.clear()

    card = Card(monkeypatch, gate=True)
    assert card.run(job, row) == "skipped"
    assert card.order == ["step 0", "claim refused"]  # no second step, nothing saved
    assert card.latents == []
    left = Job.objects.get(pk=job.pk)
    assert (left.lease_owner, left.chunks_run, left.started_at, left.checkpoint_key) == ("", 0, None, "")
    assert sent == []


def test_a_row_changed_since_the_copy_runs_again_from_the_claimed_row(make_user, monkeypatch):
    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    job = job_with_one_step_chunks(make_user("changed").user, 3)
    row = message_row(job)
    Job.objects.filter(pk=job.pk).update(steps=4)  # another total since the copy (POST /steps/)

    card = Card(monkeypatch, gate=True)
    assert card.run(job, row) == "step 4"
    # The copy's step, thrown away at its claim's answer; then the claimed row's four.
    assert card.order == ["step 0", "claim", "step 0", "step 1", "step 2", "step 3"]
    assert ended(job) == (JobStatus.DECODING, JobStage.WAITING, "", 4, 4, 4, 0)


def test_a_step_that_fails_before_its_claim_answers_is_recorded_once_the_claim_took_the_job(make_user, monkeypatch):
    capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    job = job_with_one_step_chunks(make_user("failed").user, 3)

    card = Card(monkeypatch, gate=True, fail_step=0)
    assert card.run(job, message_row(job)) == "retried"
    assert card.order == ["step 0", "claim"]
    left = Job.objects.get(pk=job.pk)
    assert (left.attempts, left.lease_owner) == (1, "") and "the card failed" in left.error


def test_a_model_that_merges_begins_before_its_claim_only_when_nothing_else_waits(make_user, monkeypatch, settings):
    from tasks import denoise

    clear_broker()
    owner = make_user("merges").user
    job, other = job_with_one_step_chunks(owner, 3), job_with_one_step_chunks(owner, 3)
    row = message_row(job)
    assert denoise.deployment.registry().get(job.model).max_merge > job.num_outputs  # tiny-sd merges
    assert denoise._copy_to_begin_from(str(job.pk), 0, row).pk == job.pk
    assert denoise._copy_to_begin_from(str(job.pk), 1, row) is None  # a continuation claims first
    assert denoise._copy_to_begin_from(str(other.pk), 0, row) is None  # another job's row
    assert denoise._copy_to_begin_from(str(job.pk), 0, {k: v for k, v in row.items() if k != "steps"}) is None
    assert denoise._copy_to_begin_from(str(job.pk), 0, row | {"model": "a-model-the-registry-dropped"}) is None

    for raised in (lambda: flags.raise_cancel(job.pk), lambda: flags.raise_new_total(job.pk, 4)):
        raised()  # the claim would refuse the step, or run another
        try:
            assert denoise._copy_to_begin_from(str(job.pk), 0, row) is None
        finally:
            redis_client().delete(CANCEL_KEY.format(job_id=job.pk), STEPS_KEY.format(job_id=job.pk))
    assert denoise._copy_to_begin_from(str(job.pk), 0, row).pk == job.pk

    def redis_down(*args):
        raise redis.ConnectionError("Redis is restarting")

    with monkeypatch.context() as down:
        down.setattr(flags, "read_flags", redis_down)
        flags.watch().untrack(job.pk)  # read afresh, as a job this card has not read yet
        assert denoise._copy_to_begin_from(str(job.pk), 0, row) is None  # the claim-first path needs no flag read

    broker.send_chunk(other.pk, 0, other.queue, other.priority, other.model)  # a job the claim may merge with
    try:
        assert denoise._copy_to_begin_from(str(job.pk), 0, row) is None
    finally:
        clear_broker()
    settings.FIRST_STEP_BEFORE_CLAIM = False
    assert denoise._copy_to_begin_from(str(job.pk), 0, row) is None


def test_a_first_chunk_message_carries_the_row_and_shows_only_that_it_does(make_user):
    import base64

    clear_broker()
    job = job_with_one_step_chunks(make_user("carried-row").user, 2)
    broker.send_chunk(job.pk, 0, job.queue, job.priority, job.model, row=rows.row_of(job))
    [raw] = [m for key in broker.queue_keys(job.queue) for m in redis_client().lrange(key, 0, -1)]
    message = json.loads(raw)
    body = json.loads(base64.b64decode(message["body"]))  # kombu's envelope, Celery's protocol 2 body
    assert body[1]["model"] == job.model and rows.job_from_row(body[1]["row"]).pk == job.pk
    assert message["headers"]["kwargsrepr"] == f"{{'model': {job.model!r}, 'row': '…'}}"
    assert broker.withdraw_chunks(job.queue, [job.pk]) == 1  # found by its id as before
