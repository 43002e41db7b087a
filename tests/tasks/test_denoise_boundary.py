"""The denoise task's chunk boundaries where the card keeps the job, run here as a worker runs them (real
storage, database and Redis; its messages captured): one statement on the job's row per boundary, and the
step time learned off the boundary."""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from genserver.jobs import broker, services
from genserver.jobs.models import Job, JobStatus
from genserver.redis_client import CORRECTION_KEY, client as redis_client
from tests.support.broker import capture_sends

pytestmark = pytest.mark.django_db(transaction=True)


def statements_for_a_job_of(steps: int, owner, sent: list) -> int:
    """Run a tiny-sd job of `steps` one-step chunks on this card, nothing waiting beside it (so it keeps the
    card at every boundary but the last); the statements on the job tables its denoise task made."""
    from tasks import denoise
    from tasks.encode import encode

    request = {"model": "tiny-sd", "prompt": f"kept {time.time()}", "width": 64, "height": 64, "num_frames": 1}
    job = services.submit_job(owner, request | {"steps": steps, "guidance_scale": 5.0, "seed": 3, "num_outputs": 1})
    encode.apply(args=[str(job.pk)]).get()
    Job.objects.filter(pk=job.pk).update(chunk_steps=1)  # a boundary after every step
    redis_client().delete(*broker.queue_keys(job.queue))
    sent.clear()
    with CaptureQueriesContext(connection) as statements:
        assert denoise.run_chunk.apply(args=[str(job.pk), 0]).get() == f"step {steps}"
    denoise._off_the_boundary.submit(lambda: None).result()  # what the boundaries left to the worker's thread
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.checkpoint_step, row.chunks_run) == (JobStatus.DECODING, steps, steps)
    assert sent == [("decode", job.pk, row.priority)]  # no chunk message: every chunk ran here
    return sum("jobs_job" in q["sql"] for q in statements.captured_queries)


def test_each_kept_boundary_is_one_statement_and_the_step_time_is_learned(make_user, monkeypatch):
    from tasks import denoise

    monkeypatch.setattr(denoise, "HEARTBEAT_EVERY_SECONDS", 1e9)  # only the boundaries renew the lease here
    sent = capture_sends(monkeypatch, "send_encode", "send_chunk", "send_decode")
    redis_client().delete(CORRECTION_KEY)
    owner = make_user("kept").user
    six, twelve = statements_for_a_job_of(6, owner, sent), statements_for_a_job_of(12, owner, sent)
    assert twelve - six == 6  # one compare-and-set per kept boundary (a locked read and a save were two)
    assert redis_client().hlen(CORRECTION_KEY) == 1  # tiny-sd's 64² shape learned its step time
