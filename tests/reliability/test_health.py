"""8. Health: /healthz (the process answers), /readyz (database, Redis, a live worker on every queue,
the oldest waiting message per queue), and the launcher restarting a worker that exits."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from genserver.jobs.models import JobStatus
from genserver.scheduling.pools import ALL_QUEUES
from tests.support.jobs import make_job

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_database_or_redis(django_assert_num_queries, monkeypatch):
    import genserver.redis_client

    monkeypatch.setattr(genserver.redis_client, "client", lambda: pytest.fail("healthz must not touch Redis"))
    with django_assert_num_queries(0):
        response = Client().get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


@pytest.fixture
def fake_worker():
    """A liveness key like a worker's (workers/heartbeat.py), consuming every queue."""
    from genserver import liveness

    liveness.write("probe-everything", {"name": "probe-everything", "queues": list(ALL_QUEUES), "pid": 0}, 30)
    yield "probe-everything"
    liveness.forget("probe-everything")


def test_readyz_reports_workers_broker_depth_and_oldest_waiting_message(make_user, fake_worker):
    owner = make_user("alice").user
    now = timezone.now()
    make_job(owner, status=JobStatus.QUEUED, published_at=now - timedelta(seconds=40))
    make_job(owner, status=JobStatus.QUEUED, published_at=now - timedelta(seconds=5))
    short = make_job(owner, status=JobStatus.DENOISING, published_at=now - timedelta(seconds=12))
    make_job(
        owner,
        status=JobStatus.DENOISING,
        lease_owner="card0@x:1",  # running: not waiting
        lease_expires_at=now + timedelta(seconds=30),
        published_at=now - timedelta(seconds=300),
    )
    make_job(owner, status=JobStatus.DECODING, published_at=now - timedelta(seconds=3))
    make_job(owner, status=JobStatus.SUCCEEDED, published_at=now - timedelta(seconds=999))
    response = Client().get("/readyz")
    body = response.json()
    assert response.status_code == 200, body
    assert body["status"] == "ready" and body["problems"] == []
    assert body["checks"]["database"]["ok"] and body["checks"]["redis"]["ok"]
    queues = body["queues"]
    assert set(queues) == set(ALL_QUEUES)
    assert all(fake_worker in q["live_workers"] for q in queues.values())
    assert queues["encode"]["waiting_jobs"] == 2 and 40 <= queues["encode"]["oldest_message_age_seconds"] < 60
    assert queues[short.duration_class]["waiting_jobs"] == 1
    assert 12 <= queues[short.duration_class]["oldest_message_age_seconds"] < 30
    assert queues["decode"]["waiting_jobs"] == 1 and queues["medium"]["oldest_message_age_seconds"] is None
    assert all(isinstance(q["broker_messages"], int) for q in queues.values())
    assert response["Cache-Control"] == "no-store"


def test_readyz_is_503_naming_what_is_missing(monkeypatch):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    import genserver.redis_client

    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    monkeypatch.setattr(genserver.redis_client, "client", lambda: dead)
    response = Client().get("/readyz")
    body = response.json()
    assert response.status_code == 503 and body["status"] == "unavailable"
    assert body["checks"]["redis"]["ok"] is False and "ConnectionError" in body["checks"]["redis"]["error"]
    assert "Redis (the broker) is unreachable" in body["problems"]
    assert body["checks"]["database"]["ok"] is True
    assert "Traceback" not in response.content.decode()


@pytest.mark.stack
@pytest.mark.django_db(transaction=True)
def test_readyz_sees_a_dead_worker_and_the_launcher_restarts_it(stack):
    from tests.conftest import wait_for

    assert Client().get("/readyz").status_code == 200
    before = stack.child("decode").process.pid
    stack.kill("decode")  # SIGKILL (its liveness key goes with it, as when its TTL runs out)
    response = Client().get("/readyz")
    assert response.status_code == 503
    assert "no live worker consumes queue 'decode'" in response.json()["problems"]
    assert response.json()["queues"]["decode"]["live_workers"] == []
    stack.wait_ready()  # the supervisor (the launcher's) restarts it
    assert stack.child("decode").process.pid != before
    wait_for(lambda: Client().get("/readyz").status_code == 200, 20, what="ready again")


def test_readyz_knows_the_queues_of_workers_dedicated_to_a_model(monkeypatch):
    """A worker dedicated to a model reads that model's class queues ("short.sdxl-sim"): /readyz checks
    those too, and names one left without a live worker."""
    from genserver import deployment, liveness
    from genserver.scheduling.pools import PoolLayout, WorkerSpec

    layout = PoolLayout(
        workers=(
            WorkerSpec("sdxl-card", ("short", "medium", "long"), models=("sdxl-sim",)),
            WorkerSpec("any-card", ("short", "medium", "long")),
            WorkerSpec("enc", ("encode", "control")),
            WorkerSpec("dec", ("decode",)),
        )
    )
    monkeypatch.setattr(deployment, "layout", lambda: layout)
    names = [spec.name for spec in layout.workers]
    for spec in layout.workers:
        liveness.write(spec.name, {"name": spec.name, "queues": list(spec.consumed_queues())}, 30)
    try:
        body = Client().get("/readyz").json()
        assert body["status"] == "ready", body["problems"]
        assert body["queues"]["short.sdxl-sim"]["live_workers"] == ["sdxl-card"]
        assert "any-card" in body["queues"]["short"]["live_workers"]
        liveness.forget(names[0])
        response = Client().get("/readyz")
        assert response.status_code == 503
        assert "no live worker consumes queue 'long.sdxl-sim'" in response.json()["problems"]
    finally:
        liveness.forget(*names)
