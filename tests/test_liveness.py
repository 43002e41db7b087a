"""Worker liveness: the registry names the keys, the keys are the truth, and a read costs the same however many
other keys Redis holds."""

from __future__ import annotations

import pytest

from genserver import liveness
from genserver.redis_client import WORKER_KEY, WORKERS_KEY
from tests.support.redis_calls import round_trips


def _names(found: list[dict]) -> set[str]:
    return {w["name"] for w in found}


def _beat(name: str, ttl: float = 30) -> None:
    liveness.write(name, {"name": name, "queues": ["short"]}, ttl)


def test_a_worker_counts_from_its_beat_until_it_is_forgotten_or_its_key_is_gone(redis_conn):
    mine = {"probe-a@n1", "probe-b@n1", "probe-c@n2"}
    for name in sorted(mine):
        _beat(name)
    try:
        assert mine <= _names(liveness.read())
        liveness.forget("probe-a@n1")  # a clean stop: at once, key and name
        assert not redis_conn.zscore(WORKERS_KEY, "probe-a@n1")
        redis_conn.delete(
            WORKER_KEY.format(name="probe-b@n1")
        )  # as when its key expires: the name stays, reads nothing
        assert redis_conn.zscore(WORKERS_KEY, "probe-b@n1")
        assert _names(liveness.read()) & mine == {"probe-c@n2"}
        _beat("probe-b@n1")  # a worker that comes back counts again
        assert _names(liveness.read()) & mine == {"probe-b@n1", "probe-c@n2"}
    finally:
        liveness.forget(*mine)


def test_a_name_unwritten_for_an_hour_leaves_the_registry_at_any_workers_next_beat(redis_conn, monkeypatch):
    import time

    now = time.time()
    try:
        monkeypatch.setattr(liveness.time, "time", lambda: now - liveness.FORGET_AFTER_SECONDS - 1)
        _beat("probe-old@n1")
        monkeypatch.setattr(liveness.time, "time", lambda: now - liveness.FORGET_AFTER_SECONDS + 60)
        _beat("probe-recent@n1")
        assert redis_conn.zscore(WORKERS_KEY, "probe-old@n1")  # nobody beat since the hour passed
        monkeypatch.setattr(liveness.time, "time", lambda: now)
        _beat("probe-now@n2")
        assert redis_conn.zscore(WORKERS_KEY, "probe-old@n1") is None
        assert redis_conn.zscore(WORKERS_KEY, "probe-recent@n1")  # within the hour: kept, whatever the clocks
    finally:
        liveness.forget("probe-old@n1", "probe-recent@n1", "probe-now@n2")


@pytest.fixture
def other_keys(redis_conn):
    """5,000 keys that are not workers' (each job's event stream lives an hour: a read that walked the keys, as a
    SCAN does, grew with the jobs of that hour)."""
    others = [f"genserver:job-events:probe-{i}" for i in range(5000)]
    with redis_conn.pipeline(transaction=False) as pipe:
        for key in others:
            pipe.set(key, "1", ex=300)
        pipe.execute()
    yield
    for start in range(0, len(others), 1000):
        redis_conn.delete(*others[start : start + 1000])


def test_a_read_is_one_round_trip_however_many_keys_redis_holds(other_keys, monkeypatch):
    _beat("probe-d@n1")
    sent = round_trips(monkeypatch, liveness)
    try:
        assert "probe-d@n1" in _names(liveness.read())
        assert sent == [["EVAL"]]
    finally:
        monkeypatch.undo()
        liveness.forget("probe-d@n1")


@pytest.mark.parametrize("name", ["card0@gpu-a", "group0@gpu-b.example.com"])
def test_the_payload_comes_back_as_written(name):
    payload = {"name": name, "node": name.partition("@")[2], "queues": ["short", "long"], "devices": "0,1"}
    liveness.write(name, payload, 30)
    try:
        assert next(w for w in liveness.read() if w["name"] == name) == payload
    finally:
        liveness.forget(name)
