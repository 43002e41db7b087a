"""2. Broker and database faults, on the real stack.

* Redis flushed mid-run (every queued message, unacked message and cancel flag
  gone): the reaper rebuilds the in-flight work from the database; no job is
  lost, none runs a chunk twice, a cancel still lands.
* Redis restarted mid-run (this session's own bundled server: killed and
  started again empty): the same; a job submitted while Redis is down is
  accepted (201, recorded) and runs once it is back; /readyz says 503 meanwhile.
* PostgreSQL unavailable (only when the suite runs on PostgreSQL): the
  database sits behind a TCP proxy that the test cuts; the API answers 503 with
  a JSON reason (no 500, no traceback), /readyz says why, /healthz stays up,
  and the running job and a new one finish once the database is back.
"""

from __future__ import annotations

import os
import signal
import urllib.parse

import pytest
from django.test import Client

from bench import chaos_probe
from tests.reliability.conftest import TcpProxy, bundled_redis_pid, revive, using_postgres
from tests.support.api import submit
from tests.support.waits import finished, job_row, wait_for
from workers.bundled_redis import start_throwaway_redis
from workers.local_workers import wait_until_live

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack]

VIDEO = {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 81}  # 1.3 s on the test clock
LONG_VIDEO = {"model": "wan-sim", "width": 1280, "height": 720, "num_frames": 81}  # 6 s


def waiting_messages(ids) -> set[str]:
    from genserver.jobs.broker import broker_job_ids
    from genserver.scheduling.pools import ALL_QUEUES

    return broker_job_ids(ALL_QUEUES) & {str(i) for i in ids}


def probe_counts(ids) -> dict[str, tuple[dict, int]]:
    """The probe's counts (chunks, decodes) of each job now. They live in Redis: a drill that wipes Redis
    takes them first, since a job may have run or even ended before the wipe (an embedding hit skips the
    encode hop)."""
    return {str(i): (chaos_probe.chunk_completions(i), chaos_probe.decode_completions(i)) for i in ids}


def assert_ran_at_most_once(job, before: tuple[dict, int]) -> None:
    """Each chunk and the decode ran to completion at most once over the counts taken before a wipe and
    those after it (a run that ended in the instant between the count and the wipe is missed, never counted
    twice); the outputs show the decode ran."""
    chunks_before, decodes_before = before
    chunks = chaos_probe.chunk_completions(job.pk)
    for step, n in chunks_before.items():
        chunks[step] = chunks.get(step, 0) + n
    assert all(n == 1 for n in chunks.values()), f"a chunk ran twice to completion: {chunks}"
    assert decodes_before + chaos_probe.decode_completions(job.pk) <= 1
    assert len(job.outputs) == job.num_outputs


def test_redis_flushed_mid_run_loses_no_job(stack, api):
    from genserver.redis_client import client

    running = submit(api, **VIDEO, prompt="running").json()["id"]
    wait_for(lambda: job_row(running).steps_done >= 3, 30, what="the first video to run")
    waiting = [submit(api, **VIDEO, prompt="queued video").json()["id"]]
    waiting += [submit(api, prompt=f"image {i}", width=512, height=512, steps=20).json()["id"] for i in range(3)]
    ids = [running, *waiting]
    assert waiting_messages(ids), "nothing was waiting in the broker: the drill would prove nothing"
    before = probe_counts(ids)
    client().flushdb()  # queued messages, unacked messages, cancel flags, worker heartbeats: all gone
    # Admission counts the cards whose heartbeats it sees. Until every worker has beaten again (one interval),
    # a submit may see only some of them, and be refused (429) for a class whose card is not back yet.
    wait_until_live(stack.names, 30.0)
    late = submit(api, **VIDEO, prompt="cancelled after the flush")
    assert late.status_code == 201, late.json()
    late = late.json()["id"]
    assert api.post(f"/api/v1/jobs/{late}/cancel/").status_code == 202
    jobs = [finished(i) for i in ids]
    assert [j.status for j in jobs] == ["succeeded"] * len(ids), [(j.status, j.error) for j in jobs]
    for job in jobs:
        assert_ran_at_most_once(job, before[str(job.pk)])
    assert finished(late).status == "cancelled"


def test_cancel_lands_although_redis_lost_its_flag(stack, api):
    from genserver.redis_client import client

    job_id = submit(api, **LONG_VIDEO, steps=100).json()["id"]
    wait_for(lambda: job_row(job_id).steps_done >= 2, 30, what="two steps")
    assert api.post(f"/api/v1/jobs/{job_id}/cancel/").status_code == 202
    client().flushdb()  # the Redis flag may be gone before the worker's next step looks at it
    job = finished(job_id, timeout=20)
    assert job.status == "cancelled" and job.steps_done < job.steps and not job.outputs


def test_redis_restarted_mid_run_loses_no_job(stack, api):
    from genserver.redis_client import client

    pid = bundled_redis_pid()
    if pid is None:
        pytest.skip("Redis is shared (REDIS_URL); only the flush is drilled on it")
    port = int(client().info("server")["tcp_port"])
    running = submit(api, **VIDEO, prompt="running").json()["id"]
    wait_for(lambda: job_row(running).steps_done >= 3, 30, what="the first video to run")
    ids = [
        running,
        submit(api, **VIDEO, prompt="queued").json()["id"],
        submit(api, prompt="image", width=512, height=512, steps=20).json()["id"],
    ]
    before = probe_counts(ids)  # the restarted server starts empty: the probe's counts go with the old one
    os.kill(pid, signal.SIGKILL)
    ready = Client().get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["redis"]["ok"] is False
    assert api.get(f"/api/v1/jobs/{running}/").status_code == 200  # reads need only the database
    during = submit(api, prompt="submitted while Redis is down", width=512, height=512, steps=20)
    assert during.status_code == 201, during.content  # recorded; the reaper publishes it once Redis is back
    ids.append(during.json()["id"])
    # Redis stays down until the outage has reached the running job: its card stepped on, failed its
    # chunk, moved it on, or holds it no more (between chunks, or its lease ran out while it stalled).
    at_kill = job_row(running)

    def outage_reached_the_running_job() -> bool:
        from django.utils import timezone

        job = job_row(running)
        held = job.lease_owner and job.lease_expires_at and job.lease_expires_at > timezone.now()
        return (
            job.steps_done > at_kill.steps_done
            or job.attempts > at_kill.attempts
            or job.status != at_kill.status
            or not held
        )

    wait_for(outage_reached_the_running_job, 30, interval=0.1, what="the outage to reach the running job")
    server, _ = start_throwaway_redis(port)  # the same port: every client reconnects to it
    import atexit

    atexit.register(server.terminate)
    wait_for(lambda: _pings(client()), 10, what="Redis back")
    jobs = [finished(i) for i in ids]
    assert [j.status for j in jobs] == ["succeeded"] * len(ids), [(j.status, j.error) for j in jobs]
    for job in jobs:
        assert_ran_at_most_once(job, before.get(str(job.pk), ({}, 0)))  # `during` was submitted after the kill
    after = submit(api, prompt="after the restart")
    assert after.status_code == 201 and finished(after.json()["id"]).status == "succeeded"
    stack.wait_ready()


def _pings(conn) -> bool:
    try:
        return bool(conn.ping())
    except Exception:  # noqa: BLE001 - any failure to ping means "not reachable" to the drill
        return False


@pytest.mark.skipif(not using_postgres(), reason="the database outage is drilled on PostgreSQL (DATABASE_URL)")
def test_database_outage_answers_503_and_work_resumes(stack, user_with_token):
    from django.db import close_old_connections, connection

    from workers.launcher import worker_argv, worker_env
    from workers.supervise import Supervisor

    _, client = user_with_token("dbdown")
    real = connection.settings_dict.copy()
    proxy = TcpProxy(real["HOST"] or "127.0.0.1", int(real["PORT"] or 5432))
    url = urllib.parse.urlsplit(os.environ["DATABASE_URL"])
    proxied_url = url._replace(
        netloc=url.netloc.rsplit("@", 1)[0] + f"@127.0.0.1:{proxy.port}"
        if "@" in url.netloc
        else f"127.0.0.1:{proxy.port}"
    ).geturl()
    # The stack's workers step aside; the same workers start again with the database behind the proxy.
    for spec in stack.layout.workers:
        stack.kill(spec.name)
    proxied = Supervisor(stop_timeout=10)
    try:
        for spec in stack.layout.workers:
            proxied.add(
                f"worker {spec.name}", worker_argv(spec, "ERROR"), worker_env(spec) | {"DATABASE_URL": proxied_url}
            )
        wait_until_live(stack.names, 90.0)
        connection.close()
        connection.settings_dict.update(HOST="127.0.0.1", PORT=str(proxy.port))
        response = submit(client, **LONG_VIDEO)
        assert response.status_code == 201, response.content
        job_id = response.json()["id"]
        wait_for(lambda: job_row(job_id).steps_done >= 3, 30, what="the video to run")

        proxy.cut()
        for response in (
            client.get("/api/v1/jobs/"),
            client.get(f"/api/v1/jobs/{job_id}/"),
            submit(client, prompt="while the database is down"),
            client.post(f"/api/v1/jobs/{job_id}/cancel/"),
        ):
            assert response.status_code == 503, response.content
            body = response.json()
            assert body["reason"] == "unavailable" and "database" in body["detail"]
            assert "Traceback" not in response.content.decode() and response["Retry-After"]
        ready = Client().get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["database"]["ok"] is False
        assert "the database is unreachable" in ready.json()["problems"]
        assert Client().get("/healthz").status_code == 200
        # Until the running chunk's lease has run out (read past the proxy): its worker lost the database too.
        wait_for(lambda: lease_expired(real, job_id), 30, interval=0.2, what="the running chunk's lease to run out")

        proxy.restore()
        close_old_connections()  # what a server does at every request boundary
        job = wait_for(lambda: (j := job_row(job_id)).is_terminal and j, 60, what="the video to finish")
        assert job.status == "succeeded", job.error
        assert job.attempts <= 1
        response = submit(client, prompt="after the outage")
        assert response.status_code == 201
        assert wait_for(lambda: (j := job_row(response.json()["id"])).is_terminal and j, 30).status == "succeeded"
        assert Client().get("/readyz").status_code == 200
    finally:
        proxy.close()
        connection.close()
        connection.settings_dict.update(HOST=real["HOST"], PORT=real["PORT"])
        proxied.stop()
        from genserver.redis_client import WORKER_KEY, client as redis_client

        for spec in stack.layout.workers:  # the stopped stand-ins' liveness keys would outlive them
            redis_client().delete(WORKER_KEY.format(name=stack.hostname(spec.name)))
        revive(stack)


def lease_expired(database: dict, job_id) -> bool:
    """Whether the job's lease has run out, by the database server's clock, on a direct connection."""
    import psycopg

    with psycopg.connect(
        host=database["HOST"] or "127.0.0.1",
        port=int(database["PORT"] or 5432),
        dbname=database["NAME"],
        user=database["USER"],
        password=database["PASSWORD"],
    ) as conn:
        row = conn.execute(
            "SELECT lease_expires_at IS NULL OR lease_expires_at < now() FROM jobs_job WHERE id = %s", [str(job_id)]
        ).fetchone()
    return bool(row and row[0])
