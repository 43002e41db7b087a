"""A chunk's message names the job's model where its publisher had the job, so the card loads the model without
reading the job first: the claim is the task's first statement on the job's row (one read fewer on the path from
submit to first step). A message without it (published before this version) reads the model as before."""

from __future__ import annotations

import base64
import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from genserver.jobs import broker
from genserver.redis_client import client as redis_client
from tests.support.broker import capture_sends
from tests.tasks.test_denoise_boundary import job_with_one_step_chunks

pytestmark = pytest.mark.django_db(transaction=True)


def statements_on_the_job(job, **kwargs) -> list[str]:
    from tasks import denoise

    with CaptureQueriesContext(connection) as statements:
        denoise.run_chunk.apply(args=[str(job.pk), 0], kwargs=kwargs).get()
    return [q["sql"].split()[0] for q in statements.captured_queries if "jobs_job" in q["sql"]]


def test_a_chunk_message_naming_the_model_is_claimed_without_a_read_first(make_user, monkeypatch):
    capture_sends(monkeypatch, "send_chunk", "send_decode")
    owner = make_user("named").user
    named = job_with_one_step_chunks(owner, 2)
    assert statements_on_the_job(named, model=named.model)[0] == "UPDATE"  # the claim
    unnamed = job_with_one_step_chunks(owner, 2)
    assert statements_on_the_job(unnamed)[:2] == ["SELECT", "UPDATE"]  # the model's read, then the claim
    gone = job_with_one_step_chunks(owner, 2)
    assert statements_on_the_job(gone, model="a-model-the-registry-dropped")[:2] == ["SELECT", "UPDATE"]


def test_the_published_message_carries_the_model(make_user):
    job = job_with_one_step_chunks(make_user("carried").user, 2)
    broker.send_chunk(job.pk, 0, job.queue, job.priority, job.model)
    [raw] = [m for key in broker.queue_keys(job.queue) for m in redis_client().lrange(key, 0, -1)]
    body = json.loads(base64.b64decode(json.loads(raw)["body"]))  # kombu's envelope, Celery's protocol 2 body
    assert body[0] == [str(job.pk), 0] and body[1] == {"model": job.model}
    redis_client().delete(*broker.queue_keys(job.queue))
