"""A decode's message names the job's model, so the decode worker loads the VAE without reading the job first,
takes the job with one statement (the UPDATE returns the row) and records its end with another (which returns what
the stage timings learn from): two statements on the job's row where there were five. A message without the model
(published before this version) reads it first, as before."""

from __future__ import annotations

import base64
import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from genserver.jobs import broker
from genserver.jobs.models import Job, JobStatus
from genserver.redis_client import client as redis_client
from tests.support.broker import capture_sends
from tests.tasks.test_denoise_boundary import job_with_one_step_chunks

pytestmark = pytest.mark.django_db(transaction=True)


def denoised(owner, monkeypatch) -> tuple[Job, tuple]:
    """A 2-step job run through its denoising here, and the decode message its last chunk published."""
    from tasks import denoise

    sent = capture_sends(monkeypatch, "send_chunk", "send_decode")
    job = job_with_one_step_chunks(owner, 2)
    assert denoise.run_chunk.apply(args=[str(job.pk), 0], kwargs={"model": job.model}).get() == "step 2"
    [message] = [m for m in sent if m[0] == "decode"]
    return Job.objects.get(pk=job.pk), message


def statements_until_the_end(job: Job, monkeypatch, **kwargs) -> list[str]:
    """The statements the decode task ran on the job's row up to and with the one that ended it (its events
    left for later, as a worker leaves them to its event thread)."""
    from genserver.jobs import events
    from tasks.decode import decode

    later: list = []
    monkeypatch.setattr(events, "in_background", lambda work, *args: later.append((work, args)))
    with CaptureQueriesContext(connection) as captured:
        assert decode.apply(args=[str(job.pk)], kwargs=kwargs).get() == "succeeded"
    on_the_job = [q["sql"] for q in captured.captured_queries if "jobs_job" in q["sql"]]
    ended = next(i for i, sql in enumerate(on_the_job) if sql.startswith("UPDATE") and "'succeeded'" in sql)
    return [sql.split()[0] for sql in on_the_job[: ended + 1]]


def test_the_last_chunk_publishes_its_decode_with_the_model(make_user, monkeypatch):
    job, message = denoised(make_user("decode-named").user, monkeypatch)
    assert message == ("decode", job.pk, job.priority, job.model) and job.status == JobStatus.DECODING


def test_a_decode_message_naming_the_model_takes_and_ends_the_job_in_two_statements(make_user, monkeypatch):
    job, _ = denoised(make_user("decode-two").user, monkeypatch)
    assert statements_until_the_end(job, monkeypatch, model=job.model) == ["UPDATE", "UPDATE"]
    row = Job.objects.get(pk=job.pk)
    assert row.status == JobStatus.SUCCEEDED and row.outputs and row.finished_at is not None


def test_a_decode_message_without_the_model_reads_it_first(make_user, monkeypatch):
    job, _ = denoised(make_user("decode-unnamed").user, monkeypatch)
    assert statements_until_the_end(job, monkeypatch) == ["SELECT", "UPDATE", "UPDATE"]
    assert Job.objects.get(pk=job.pk).status == JobStatus.SUCCEEDED


def test_the_published_decode_message_carries_the_model(make_user):
    job = job_with_one_step_chunks(make_user("decode-carried").user, 2)
    broker.send_decode(job.pk, job.priority, job.model)
    [raw] = [m for key in broker.queue_keys("decode") for m in redis_client().lrange(key, 0, -1)]
    body = json.loads(base64.b64decode(json.loads(raw)["body"]))  # kombu's envelope, Celery's protocol 2 body
    assert body[0] == [str(job.pk)] and body[1] == {"model": job.model}
    redis_client().delete(*broker.queue_keys("decode"))
