"""3. Duplicates: a message published twice, or redelivered after visibility_timeout, never runs a
chunk twice to completion nor writes a second set of outputs.

The probe (bench/chaos_probe.py) counts, inside the workers and in this
process, every checkpoint and output file written: each chunk's checkpoint and
the job's last output must be written exactly once.
"""

from __future__ import annotations

import threading
import time

import pytest

from bench import chaos_probe
from tests.support.api import submit
from tests.support.jobs import make_job
from tests.support.waits import finished, job_row, settled, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]

VIDEO = {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 81, "steps": 20}


def assert_each_chunk_and_decode_once(job) -> None:
    chunks = chaos_probe.chunk_completions(job.pk)
    expected = -(-job.steps // job.chunk_steps)
    assert len(chunks) == expected and set(chunks.values()) == {1}, chunks
    assert chaos_probe.decode_completions(job.pk) == 1
    assert len(job.outputs) == job.num_outputs
    assert job.chunks_run == expected, "a chunk was claimed twice"
    assert job.attempts == 0 and job.error == ""


def test_every_message_published_twice_runs_each_chunk_once(stack, make_user):
    """While the job runs, its current message is published again and again, and a second consumer in
    this process takes the same stage at the same moment as the real worker (a race on the claim)."""
    from django.db import connection

    from genserver.jobs import broker
    from genserver.jobs.models import JobStatus
    from tasks.decode import decode
    from tasks.denoise import run_chunk
    from tasks.encode import encode

    api = make_user("dup")
    # 60 steps: several chunks, so the twin meets the job between boundaries more than once.
    job_id = submit(api, **(VIDEO | {"steps": 60})).json()["id"]  # one output: wan-sim's max_batch
    stop = threading.Event()
    outcomes: list[str] = []
    published: list[str] = []  # the stage of each duplicate the twin published

    def duplicate() -> None:
        try:
            while not stop.is_set():
                job = job_row(job_id)
                if job.is_terminal:
                    return
                if job.status in (JobStatus.QUEUED, JobStatus.ENCODING):
                    broker.send_encode(job.pk, job.priority)
                    outcomes.append(encode.apply(args=[job_id]).get())
                elif job.status == JobStatus.DENOISING:
                    broker.send_chunk(job.pk, job.checkpoint_step, job.queue, job.priority)
                    outcomes.append(run_chunk.apply(args=[job_id, job.checkpoint_step]).get())
                elif job.status == JobStatus.DECODING:
                    broker.send_decode(job.pk, job.priority)
                    outcomes.append(decode.apply(args=[job_id]).get())
                published.append(job.status)
                time.sleep(0.01)
        finally:
            connection.close()

    twin = threading.Thread(target=duplicate)
    twin.start()
    job = finished(job_id)
    stop.set()
    twin.join()
    assert job.status == "succeeded", job.error
    # What was duplicated, not how often: the count of rounds depends on how fast this run's job went.
    assert JobStatus.DENOISING in published and "skipped" in outcomes, (published, outcomes)
    job = job_row(job_id)
    settled(["encode", job.queue, "decode"])  # the duplicates left in the broker ran (and found it finished)
    assert_each_chunk_and_decode_once(job_row(job_id))


def test_messages_redelivered_after_visibility_timeout_run_nothing_twice(stack, make_user):
    """Every message of the job, while a worker holds it unacknowledged, is aged past
    visibility_timeout and handed back to its queue by kombu's own restore (as after a lost
    worker or a partition): the copy is delivered again while the first delivery still runs."""
    from django.conf import settings

    from genserver.celery import app
    from genserver.redis_client import client

    api = make_user("redelivery")
    job_id = submit(api, **VIDEO).json()["id"]
    stop = threading.Event()
    redelivered: dict[bytes, str] = {}
    expired = time.time() - settings.CELERY_VISIBILITY_TIMEOUT - 60

    def redeliver() -> None:
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            r = client()
            while not stop.is_set():
                for tag, raw in r.hgetall(channel.unacked_key).items():
                    if job_id.encode() in raw and tag not in redelivered:
                        r.zadd(channel.unacked_index_key, {tag: expired})
                        redelivered[tag] = raw.decode(errors="replace")
                        channel.qos.restore_visible(num=1000, interval=1)
                time.sleep(0.003)

    twin = threading.Thread(target=redeliver)
    twin.start()
    job = finished(job_id)
    stop.set()
    twin.join()

    def no_copy_of_the_job_unacked() -> bool:
        with app.connection_for_write() as conn:
            return not any(job_id.encode() in raw for raw in client().hvals(conn.default_channel.unacked_key))

    # The redelivered copies run: none is held unacknowledged or waits in a queue, no worker is busy.
    wait_for(no_copy_of_the_job_unacked, 30, what="the redelivered copies to be acknowledged")
    settled(["encode", job.queue, "decode"])
    assert job.status == "succeeded", job.error
    stages = {
        name
        for name in ("tasks.encode.encode", "tasks.denoise.run_chunk", "tasks.decode.decode")
        if any(name in raw for raw in redelivered.values())
    }
    assert "tasks.denoise.run_chunk" in stages and len(redelivered) >= 2, stages
    assert_each_chunk_and_decode_once(job_row(job_id))


@pytest.mark.parametrize("stage", ["chunk", "decode", "encode"])
def test_concurrent_claims_of_one_stage_let_exactly_one_run(make_user, stage):
    """Eight consumers take the same stage of one job at the same instant (the compare-and-set that
    every duplicate meets): exactly one gets it. No message is published: no worker interferes."""
    from django.db import connection

    from genserver.jobs import services
    from genserver.jobs.models import JobStatus

    owner = make_user("claims").user
    status = {"chunk": JobStatus.DENOISING, "decode": JobStatus.DECODING, "encode": JobStatus.QUEUED}[stage]
    job = make_job(owner, VIDEO | {"prompt": "race"}, status=status, checkpoint_step=0)
    take = {
        "chunk": lambda worker: services.claim_chunk(job.pk, worker, 0),
        "decode": lambda worker: services.start_decoding(job.pk, worker),
        "encode": lambda worker: services.start_encoding(job.pk, worker),
    }[stage]
    barrier = threading.Barrier(8)
    won: list[str] = []

    def claim(n: int) -> None:
        try:
            barrier.wait()
            if take(f"racer-{n}"):
                won.append(f"racer-{n}")
        finally:
            connection.close()

    racers = [threading.Thread(target=claim, args=(n,)) for n in range(8)]
    for t in racers:
        t.start()
    for t in racers:
        t.join()
    assert len(won) == 1, won
    job.refresh_from_db()
    assert job.lease_owner == won[0] and job.chunks_run == (1 if stage == "chunk" else 0)
    assert services.finish_cancelled(job.pk, won[0])  # leave nothing active behind
