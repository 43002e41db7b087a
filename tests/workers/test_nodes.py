"""Node identity (GENSERVER_NODE) and capacity counted from live workers' heartbeats, on every node."""

from __future__ import annotations

import socket

import pytest

from genserver import config
from genserver.config import SettingsError
from genserver.scheduling.pools import default_layout, worker_from_queues
from tests.support.api import submit
from tests.support.waits import wait_for
from workers.launcher import worker_argv, worker_env, worker_hostname


def test_node_defaults_to_the_host_name_and_refuses_a_name_celery_cannot_carry(monkeypatch):
    monkeypatch.delenv("GENSERVER_NODE", raising=False)
    assert config.node() == socket.gethostname().split(".")[0]
    monkeypatch.setenv("GENSERVER_NODE", "gpu-box-7")
    assert config.node() == "gpu-box-7"
    monkeypatch.setenv("GENSERVER_NODE", "a@b")
    with pytest.raises(SettingsError, match="GENSERVER_NODE"):
        config.node()


def test_two_nodes_with_the_same_layout_name_their_workers_apart():
    layout = default_layout(num_gpus=2)
    a = [worker_argv(spec, node="node-a") for spec in layout.workers]
    b = [worker_argv(spec, node="node-b") for spec in layout.workers]
    hostnames_a = {argv[argv.index("--hostname") + 1] for argv in a}
    hostnames_b = {argv[argv.index("--hostname") + 1] for argv in b}
    assert hostnames_a == {f"{spec.name}@node-a" for spec in layout.workers}
    assert not hostnames_a & hostnames_b
    assert worker_hostname(layout.workers[0], "node-b") == "gpu0@node-b"
    # Same cards on each machine: the pinning does not depend on the node.
    assert worker_env(layout.workers[0])["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_heartbeat_is_rebuilt_into_the_pool_entry_it_stands_for():
    plain = worker_from_queues("gpu1@a", ["short", "medium", "long"], (1,))
    assert (plain.queues, plain.models, plain.lane, plain.speedup) == (("short", "medium", "long"), (), "", 1.0)
    dedicated = worker_from_queues("sdxl@a", ["short.sdxl-sim", "medium.sdxl-sim"], (2,))
    assert dedicated.models == ("sdxl-sim",) and dedicated.consumed_queues() == ("short.sdxl-sim", "medium.sdxl-sim")
    group = worker_from_queues("group0@a", ["short@interactive", "long@interactive"], (0, 1, 2, 3))
    assert group.lane == "interactive" and group.speedup == pytest.approx(3.52)


def _beat(node: str, worker: str, queues: list[str], ttl: float = 30) -> str:
    """A liveness key exactly as workers/heartbeat.py writes it."""
    from genserver import liveness

    name = f"{worker}@{node}"
    payload = {"name": name, "node": node, "worker": worker, "queues": queues, "pid": 0, "devices": "", "models": []}
    liveness.write(name, payload, ttl)
    return name


@pytest.fixture
def clean_heartbeats(redis_conn):
    from genserver.redis_client import WORKER_KEY, WORKERS_KEY

    def clear() -> None:
        for key in [*redis_conn.scan_iter(match=WORKER_KEY.format(name="*")), WORKERS_KEY]:
            redis_conn.delete(key)

    clear()
    yield
    clear()


def _two_card_node(node: str, ttl: float = 30) -> None:
    """A node of the CPU layout with 2 simulated cards and GENSERVER_IMAGE_CARDS=1: cpu0 (images), cpu1 (all),
    encode, decode."""
    _beat(node, "cpu0", ["short", "medium"], ttl)
    _beat(node, "cpu1", ["short", "medium", "long"], ttl)
    _beat(node, "encode", ["encode", "control", "webhooks"], ttl)
    _beat(node, "decode", ["decode"], ttl)


@pytest.mark.django_db
def test_queues_count_the_cards_alive_on_every_node_and_drop_a_dead_one(staff_api, clean_heartbeats):
    api = staff_api  # the workers and cards per node are staff's view
    before = {q["name"]: q for q in api.get("/api/v1/queues/").json()}
    assert before["short"]["capacity_source"] == "layout"  # nothing reports yet: the layout estimates

    _two_card_node("node-a", ttl=1.5)  # node A stops renewing: its keys expire as a dead node's do
    _two_card_node("node-b")
    queues = {q["name"]: q for q in api.get("/api/v1/queues/").json()}
    assert queues["short"]["capacity_source"] == "live"
    assert queues["short"]["cards"] == 4 and queues["short"]["cards_by_node"] == {"node-a": 2, "node-b": 2}
    assert queues["long"]["cards"] == 2
    assert "cpu1@node-a" in queues["long"]["workers"] and "cpu1@node-b" in queues["long"]["workers"]
    workers = api.get("/api/v1/workers/").json()["workers"]
    assert {(w["node"], w["worker"]) for w in workers} >= {("node-a", "cpu0"), ("node-b", "decode")}
    nodes = api.get("/api/v1/workers/").json()["nodes"]
    assert nodes["node-a"]["cards"] == nodes["node-b"]["cards"] == 2 and len(nodes["node-a"]["workers"]) == 4

    def short_cards() -> int:
        return {q["name"]: q for q in api.get("/api/v1/queues/").json()}["short"]["cards"]

    wait_for(lambda: short_cards() == 2, 10, what="node A's cards to stop counting")
    # A new node counts from its first heartbeat.
    _two_card_node("node-c")
    assert short_cards() == 4


@pytest.mark.django_db
def test_admission_and_etas_use_the_live_cards(api, clean_heartbeats):
    _two_card_node("node-a")
    _two_card_node("node-b")
    first = submit(api, model="wan-sim").json()
    second = submit(api, model="wan-sim").json()
    third = submit(api, model="wan-sim").json()
    # Two long cards alive (the layout's one per node): the first two videos take one each at once, and the third
    # takes the first to free, once a whole video has run (with one card the second would wait for the first).
    assert second["eta_seconds"] == pytest.approx(first["eta_seconds"], rel=0.02)
    assert third["eta_seconds"] == pytest.approx(first["eta_seconds"] * 2, rel=0.02)
    # Only image cards alive (a node whose video cards died): a video is refused, an image accepted.
    from genserver.redis_client import WORKER_KEY, client

    for node in ("node-a", "node-b"):
        client().delete(WORKER_KEY.format(name=f"cpu1@{node}"))
    refused = submit(api, model="wan-sim")
    assert refused.status_code == 429 and "no worker serves" in refused.json()["detail"]
    assert submit(api).status_code == 201


def test_a_node_prints_its_workers_as_systemd_units_and_procfile_lines(tmp_path):
    from workers.units import procfile, systemd_units

    layout = default_layout(num_gpus=2)
    units = systemd_units(layout, "gpu-box-7", "INFO", tmp_path)
    for spec in layout.workers:
        assert f"# --- genserver-worker-{spec.name}.service" in units
        assert f"--hostname {spec.name}@gpu-box-7" in units
    assert 'Environment="GENSERVER_NODE=gpu-box-7"' in units and "Restart=always" in units
    assert "Wants=genserver-worker-gpu0.service genserver-worker-gpu1.service" in units
    lines = procfile(layout, "gpu-box-7", "INFO").splitlines()
    assert [line.split(":")[0] for line in lines] == [spec.name for spec in layout.workers]
    assert "CUDA_VISIBLE_DEVICES=1" in lines[1] and "--hostname gpu1@gpu-box-7" in lines[1]
