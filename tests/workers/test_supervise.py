"""The supervisor and the stack's bundled Redis: ordered stops, crash loops seen by /readyz, one Redis per stack."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import redis

from tests.conftest import wait_for
from workers.bundled_redis import free_port
from workers.supervise import Supervisor

# A child that, on SIGTERM, appends "<name> <time>" to a file and exits (after a short pause, like a warm shutdown).
STOPPABLE = """
import signal, sys, time
def stop(*_):
    time.sleep(0.3)
    with open(sys.argv[1], "a") as f:
        f.write(sys.argv[2] + " " + repr(time.time()) + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + "." + str(hash(sys.argv[2])) + ".ready", "w").close()
while True:
    time.sleep(0.05)
"""


def test_stop_goes_stage_by_stage_so_the_broker_stops_last(tmp_path):
    record = tmp_path / "stopped.txt"
    supervisor = Supervisor(stop_timeout=10)
    for name, stage in (("redis", 2), ("api", 0), ("worker card0", 0), ("beat", 1), ("flower", 1)):
        supervisor.add(name, [sys.executable, "-c", STOPPABLE, str(record), name], stop_stage=stage)
    wait_for(lambda: len(list(tmp_path.glob("*.ready"))) == 5, 30, what="the children's SIGTERM handlers")
    supervisor.stop()
    order = [line.rsplit(" ", 1)[0] for line in record.read_text().splitlines()]
    assert sorted(order) == sorted(["redis", "api", "worker card0", "beat", "flower"])
    assert set(order[:2]) == {"api", "worker card0"}
    assert set(order[2:4]) == {"beat", "flower"}
    assert order[4] == "redis"


@pytest.mark.django_db
def test_a_crash_looping_child_makes_readyz_unavailable(settings):
    from django.test import Client

    from genserver.health import supervisor_state_path

    state_file = supervisor_state_path()
    supervisor = Supervisor(stop_timeout=5, state_file=state_file)
    try:
        supervisor.add("redis", [sys.executable, "-c", "import sys; sys.exit(3)"])
        wait_for(
            lambda: (supervisor.poll(), json.loads(state_file.read_text())["children"]["redis"]["crash_looping"])[1],
            30,
            interval=0.1,
            what="the crash loop to be recorded",
        )
        body = Client().get("/readyz").json()
        assert any("'redis' is crash-looping" in p and "exit status 3" in p for p in body["problems"])
        assert body["status"] == "unavailable" and body["checks"]["processes"]["ok"] is False
    finally:
        supervisor.stop()
    assert not state_file.exists()  # a stopped supervisor leaves no state behind


def test_each_data_directory_derives_a_port_of_its_own_and_the_default_keeps_6389(tmp_path, monkeypatch):
    from genserver import config

    monkeypatch.delenv("GENSERVER_EMBEDDED_REDIS_PORT", raising=False)
    # The derivation on fixed paths: it hashes the absolute path, and two random directories (tmp_path's)
    # share a port 1 time in 1,000, which made "they differ" a flaky assertion. These two are known to differ.
    first, second = (config.derived_redis_port(Path(f"/srv/genserver/{name}")) for name in ("first", "second"))
    assert first != second and 6390 <= min(first, second) <= max(first, second) <= 7389
    assert config.derived_redis_port(Path("/srv/genserver/first")) == first  # the same directory, the same port
    # What `make up` reads: the port of GENSERVER_DATA_DIR, the default ./var's 6389, or the variable's own.
    monkeypatch.setenv("GENSERVER_DATA_DIR", str(tmp_path))
    assert config.embedded_redis_port() == config.derived_redis_port(tmp_path.resolve())
    monkeypatch.setenv("GENSERVER_DATA_DIR", str(config.BASE_DIR / "var"))
    assert config.embedded_redis_port() == 6389
    monkeypatch.setenv("GENSERVER_EMBEDDED_REDIS_PORT", "7777")
    assert config.embedded_redis_port() == 7777


def test_two_stacks_get_two_redis_servers_and_a_taken_port_is_refused(tmp_path):
    """On ports the OS hands out: the suite runs stacks at once, and two derived ports (1,000 of them)
    may meet; the derivation itself is the test above."""
    from workers.stack import start_embedded_redis

    supervisors = [Supervisor(stop_timeout=5), Supervisor(stop_timeout=5)]
    try:
        urls = [start_embedded_redis(sup, tmp_path / name, free_port()) for sup, name in zip(supervisors, "ab")]
        first, second = (redis.Redis.from_url(u) for u in urls)
        first.set("genserver:test:owner", "first")
        assert second.get("genserver:test:owner") is None
        assert first.info("server")["process_id"] != second.info("server")["process_id"]
        # A third stack told to use the first one's port refuses to start, naming the variable to change.
        with pytest.raises(SystemExit, match="GENSERVER_EMBEDDED_REDIS_PORT"):
            start_embedded_redis(
                Supervisor(stop_timeout=5), tmp_path / "c", first.connection_pool.connection_kwargs["port"]
            )
    finally:
        for sup in supervisors:
            sup.stop()
