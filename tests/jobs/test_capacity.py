"""The cluster's picture from Redis: `cluster_reads` is live_capacity() and stage_seconds() in one round trip."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from genserver import liveness
from genserver.jobs.selectors import capacity
from genserver.jobs.selectors.capacity import LongCapState, cluster_reads, live_capacity, stage_seconds
from genserver.redis_client import LONG_CAP_KEY, STAGE_SECONDS_KEY
from tests.support.redis_calls import round_trips

CARDS = ("probe0@cap-node", "probe1@cap-node", "probe2@cap-node")


@pytest.fixture
def three_cards(redis_conn):
    redis_conn.delete(LONG_CAP_KEY, STAGE_SECONDS_KEY)  # what earlier tests learned or decided
    for name in CARDS:
        liveness.write(name, {"name": name, "queues": ["short", "medium", "long"]}, 30)
    yield
    liveness.forget(*CARDS)
    redis_conn.delete(LONG_CAP_KEY, STAGE_SECONDS_KEY)


@pytest.mark.parametrize("cap", [LongCapState(), LongCapState(engaged=True, cap=2, long_cards=3)])
def test_one_round_trip_reads_what_the_three_reads_read(redis_conn, three_cards, monkeypatch, cap):
    redis_conn.set(LONG_CAP_KEY, json.dumps(asdict(cap)), ex=60)
    redis_conn.hset(STAGE_SECONDS_KEY, mapping={"sdxl-sim:tail": "0.25", "wan-sim:lead-in": "1.5"})
    sent = round_trips(monkeypatch, capacity, "redis_client")
    cluster = cluster_reads()
    assert sent == [["EVAL", "GET", "HGETALL"]]
    monkeypatch.undo()

    assert cluster.layout == live_capacity() and cluster.stage_seconds == stage_seconds()
    assert cluster.stage_seconds == {"sdxl-sim:tail": 0.25, "wan-sim:lead-in": 1.5}
    names = {spec.name for spec in cluster.layout.workers}
    assert set(CARDS) <= names
    uncapped = live_capacity(capped=False)
    assert (cluster.layout != uncapped) is cap.engaged  # the cap holds: the long class counts fewer cards


def test_unreachable_redis_reads_the_configured_layout_and_no_stages(monkeypatch):
    from redis.exceptions import ConnectionError as RedisConnectionError

    from genserver import deployment

    def down():
        raise RedisConnectionError("no Redis here")

    monkeypatch.setattr(capacity, "redis_client", down)
    monkeypatch.setattr(liveness, "client", down)  # live_capacity's own read of the workers, below
    cluster = cluster_reads()
    assert cluster.layout == deployment.layout() and cluster.stage_seconds == {}
    assert cluster.layout == live_capacity()  # as the separate reads fall back


def test_a_read_is_reused_for_cluster_read_seconds_and_then_read_again(redis_conn, three_cards, monkeypatch):
    """What GENSERVER_CLUSTER_READ_SECONDS trades: within it a process's requests reuse one read (no round
    trip, and a change not yet seen); past it, or once forgotten, the next request reads the change."""
    monkeypatch.setenv("GENSERVER_CLUSTER_READ_SECONDS", "0.5")
    capacity.forget_cluster_read()
    now = [1000.0]
    sent = round_trips(monkeypatch, capacity, "redis_client")

    def reads() -> int:
        return sum(trip == ["EVAL", "GET", "HGETALL"] for trip in sent)

    first = cluster_reads(clock=lambda: now[0])
    redis_conn.hset(STAGE_SECONDS_KEY, "sdxl-sim:tail", "0.75")  # a worker learns a stage time
    now[0] += 0.4
    assert cluster_reads(clock=lambda: now[0]) is first and reads() == 1  # reused: not seen yet
    now[0] += 0.2
    later = cluster_reads(clock=lambda: now[0])
    assert reads() == 2 and later.stage_seconds == {"sdxl-sim:tail": 0.75}
    assert cluster_reads(clock=lambda: now[0]) is later
    capacity.forget_cluster_read()
    cluster_reads(clock=lambda: now[0])
    assert reads() == 3
    monkeypatch.setenv("GENSERVER_CLUSTER_READ_SECONDS", "0")  # the suite's setting: every call reads
    cluster_reads(clock=lambda: now[0])
    assert reads() == 4


def test_a_fallback_without_redis_is_not_reused(monkeypatch, redis_conn, three_cards):
    from redis.exceptions import ConnectionError as RedisConnectionError

    monkeypatch.setenv("GENSERVER_CLUSTER_READ_SECONDS", "5")
    capacity.forget_cluster_read()
    real = capacity.redis_client

    def down():
        raise RedisConnectionError("no Redis here")

    monkeypatch.setattr(capacity, "redis_client", down)
    assert cluster_reads().stage_seconds == {}
    redis_conn.hset(STAGE_SECONDS_KEY, "sdxl-sim:tail", "0.5")
    monkeypatch.setattr(capacity, "redis_client", real)  # back: the next request reads it
    assert cluster_reads().stage_seconds == {"sdxl-sim:tail": 0.5}
    capacity.forget_cluster_read()
