"""A first chunk's message carries the job's row as its publisher wrote it (genserver/jobs/rows.py): through JSON
and back it is the row a read gives, from the submit's hit and from the encode's finish alike."""

from __future__ import annotations

import base64
import json
import uuid

import pytest

from genserver.jobs import broker, rows
from genserver.jobs.models import Job
from genserver.redis_client import client as redis_client
from tests.jobs.test_embedding_hit import store_embeddings
from tests.support.api import submit
from tests.support.broker import BROKER_QUEUES

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("empty_broker")]


def carried_row(job_id: str) -> dict | None:
    """The `row` argument of the job's chunk message waiting in the broker."""
    for queue in BROKER_QUEUES:
        for key in broker.queue_keys(queue):
            for raw in redis_client().lrange(key, 0, -1):
                message = json.loads(raw)
                if message["headers"]["task"] == broker.CHUNK_TASK.name and job_id.encode() in raw:
                    return json.loads(base64.b64decode(message["body"]))[1].get("row")
    return None


def as_read(job: Job) -> dict:
    return {field.attname: getattr(job, field.attname) for field in Job._meta.concrete_fields}


def test_a_hits_message_carries_the_row_the_submit_wrote(make_user):
    prompt = f"a carried row {uuid.uuid4()}"
    store_embeddings("sdxl-sim", prompt)
    created = submit(make_user("row-hit"), prompt=prompt).json()
    row = carried_row(created["id"])
    assert row is not None
    assert as_read(rows.job_from_row(row)) == as_read(Job.objects.get(pk=created["id"]))


def test_an_encoded_jobs_message_carries_the_row_its_encode_left(make_user):
    from tasks.encode import encode

    created = submit(make_user("row-encoded"), prompt=f"a row encoded first {uuid.uuid4()}").json()
    assert carried_row(created["id"]) is None  # its encode's message, not a chunk's
    encode.apply(args=[created["id"]]).get()
    row = carried_row(created["id"])
    assert row is not None
    assert as_read(rows.job_from_row(row)) == as_read(Job.objects.get(pk=created["id"]))


def test_a_copy_is_the_claimed_rows_first_steps_only_while_their_shape_is_the_same(make_user):
    created = submit(make_user("row-shape"), prompt="a shape").json()
    row = Job.objects.get(pk=created["id"])
    copy = rows.job_from_row(json.loads(json.dumps(rows.row_of(row))))
    assert rows.same_first_steps(copy, row)
    row.lease_owner, row.chunks_run = "a card", 1  # what a claim changes: not the step
    assert rows.same_first_steps(copy, row)
    for name, other in (("steps", row.steps + 1), ("seed", row.seed + 1), ("embeddings_key", "another")):
        changed = Job.objects.get(pk=created["id"])
        setattr(changed, name, other)
        assert not rows.same_first_steps(copy, changed), name
    rows.adopt(copy, row)
    assert as_read(copy) == as_read(row)
    assert rows.job_from_row({k: v for k, v in rows.row_of(row).items() if k != "seed"}) is None
    assert rows.job_from_row(rows.row_of(row) | {"created_at": "not a moment"}) is None
