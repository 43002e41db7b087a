"""The two-node drill: two launchers as two nodes share only Redis, the database and the object store.

The test process is the control host: the API, and the session stack's beat
(the one reaper of the cluster; the session stack's own workers are suspended
for the drill). Each node is a launcher (workers/local_workers.py) with its own
GENSERVER_NODE and its own data directory (its copy of the weights, its
scratch); the store is S3 on moto's server over HTTP (tests/support/s3.py), so
nothing is shared on disk. A tiny-wan video runs on one node, that node's whole
process tree is SIGKILLed mid-denoise, and the other node resumes the job from
its checkpoint in the store: it succeeds with the bytes of an undisturbed run
of the same seed, and /api/v1/queues/ stops counting the dead node's cards
within the lease. A third node then joins, counts, and takes work.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.api import download, submit
from tests.support.waits import finished, job_row, wait_for
from workers.local_workers import LocalWorkers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.stack, pytest.mark.heavy]

# One segment (tiny-wan runs longer videos as segments of 9 frames), tiny-wan's most steps.
VIDEO = {
    "model": "tiny-wan",
    "prompt": "two nodes, one video",
    "seed": 4321,
    "width": 128,
    "height": 128,
    "num_frames": 9,
    "steps": 50,
}


NODE_LEASE_SECONDS = 10.0


def node_env(name: str, scratch: Path, store: dict[str, str]) -> dict[str, str]:
    """A node's own files under `scratch`; the database, Redis and the store (`store`) are the cluster's."""
    from django.conf import settings

    data = scratch / name
    shutil.copytree(settings.MODELS_DIR, data / "models", symlinks=True)  # the node's installed weights
    env = {
        "GENSERVER_DATA_DIR": str(data),
        "GENSERVER_STORAGE_DIR": str(data / "storage"),
        # The suite's 3-s lease fails a job on a 2-core machine shared by many stacks (a step or a
        # model load outlasts it three times); the drill is about nodes, not about a tight lease.
        "GENSERVER_LEASE_SECONDS": str(NODE_LEASE_SECONDS),
        **store,
    }
    if not os.environ.get("DATABASE_URL"):  # the session's SQLite file, not one in the node's directory
        env["DATABASE_URL"] = f"sqlite:///{settings.DATABASES['default']['NAME']}"
    return env


def start_node(name: str, scratch: Path, store: dict[str, str]) -> LocalWorkers:
    return LocalWorkers(loglevel="WARNING", node=name, env=node_env(name, scratch, store), beat=False)


def long_cards(api) -> dict[str, int]:
    """GET /api/v1/queues/: the live cards serving the long class, per node."""
    queues = {q["name"]: q for q in api.get("/api/v1/queues/").json()}
    assert queues["long"]["capacity_source"] == "live"
    return queues["long"]["cards_by_node"]


@pytest.fixture
def store(s3_server) -> Iterator[dict[str, str]]:
    """The cluster's object store: a prefix of moto's S3 bucket, for the nodes and this process (the API)."""
    from tests.conftest import S3_TEST_BUCKET

    env = s3_server.env(S3_TEST_BUCKET, prefix=f"two-nodes-{os.getpid()}")
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # not monkeypatch: the session stack's workers restart after this, on their own store
    try:
        yield env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def cluster_nodes(stack, store, tmp_path) -> Iterator[dict[str, LocalWorkers]]:
    """Nodes "north" and "south"; the session stack's workers step aside meanwhile (its beat stays)."""
    stack.suspend_workers()
    nodes: dict[str, LocalWorkers] = {}
    try:
        for name in ("north", "south"):
            nodes[name] = start_node(name, tmp_path, store)
        yield nodes
    finally:
        for node in nodes.values():
            node.stop()
        for name in store:
            os.environ.pop(name, None)  # the session stack's workers restart on the local store
        stack.resume_workers()


def test_a_node_dies_mid_video_and_another_resumes_it_byte_for_byte(
    cluster_nodes, store, s3_server, api, staff_api, tmp_path
):
    from genserver.redis_client import WORKER_KEY, client

    # 1. Two launchers with the same layout, side by side: every worker of both is live under its node.
    live = {w["name"] for w in staff_api.get("/api/v1/workers/").json()["workers"]}
    assert cluster_nodes["north"].names | cluster_nodes["south"].names <= live
    assert long_cards(staff_api) == {"north": 1, "south": 1}

    # 2. A video starts on one node (call it the victim); kill that node's whole process tree mid-denoise.
    response = submit(api, **VIDEO)
    assert response.status_code == 201, response.content
    killed = response.json()["id"]
    try:
        running = wait_for(
            lambda: (j := job_row(killed)).is_terminal and j or j.checkpoint_step >= 5 and "@" in j.lease_owner and j,
            180,
            what="five checkpointed steps",
        )
    except AssertionError as exc:
        j = job_row(killed)
        raise AssertionError(
            f"{exc}: {j.status} step {j.steps_done}/{j.steps}, checkpoint {j.checkpoint_step}, "
            f"owner {j.lease_owner!r}, attempts {j.attempts}, error {j.error!r}"
        ) from None
    assert not running.is_terminal, (running.status, running.error)
    victim = running.lease_owner.split(":")[0].partition("@")[2]
    survivor = ({"north", "south"} - {victim}).pop()
    ttls = [client().pttl(WORKER_KEY.format(name=n)) for n in cluster_nodes[victim].names]
    cluster_nodes[victim].kill_node()
    at_kill = job_row(killed)
    assert at_kill.steps_done < at_kill.steps, "the video ended before the kill; give it more steps"
    # Its checkpoints are in the object store, none on the nodes' disks.
    from tests.conftest import S3_TEST_BUCKET

    listed = s3_server.client().list_objects_v2(Bucket=S3_TEST_BUCKET, Prefix=store["GENSERVER_S3_PREFIX"])
    assert any(f"checkpoints/{killed}/" in o["Key"] for o in listed.get("Contents", [])), listed
    assert not list(tmp_path.rglob("step-*.pt"))
    # The dead node's liveness keys expire within the lease: its card stops counting.
    assert all(0 < ttl <= NODE_LEASE_SECONDS * 1000 for ttl in ttls), ttls
    wait_for(lambda: long_cards(staff_api) == {survivor: 1}, 60, interval=0.2, what=f"{victim}'s card to stop counting")

    # 3. The survivor resumes it from the checkpoint in the store: the bytes of an undisturbed run.
    job = finished(killed)
    assert job.status == "succeeded", job.error
    assert job.attempts >= 1 and job.chunks_run > 1
    clean = finished(submit(api, **VIDEO).json()["id"])
    assert clean.status == "succeeded" and clean.attempts == 0
    first = [download(api, o["url"]) for o in api.get(f"/api/v1/jobs/{killed}/").json()["outputs"]]
    second = [download(api, o["url"]) for o in api.get(f"/api/v1/jobs/{clean.pk}/").json()["outputs"]]
    assert first and first == second, "the resumed job's outputs differ from an undisturbed run's"

    # 4. A third node joins: it counts from its first heartbeat, and takes work (alone once the survivor stops).
    cluster_nodes["east"] = start_node("east", tmp_path, store)
    wait_for(lambda: long_cards(staff_api) == {survivor: 1, "east": 1}, 30, interval=0.2, what="east's card to count")
    cluster_nodes[survivor].stop()
    client().delete(*[WORKER_KEY.format(name=n) for n in cluster_nodes[survivor].names])  # a clean leave
    assert long_cards(staff_api) == {"east": 1}
    third = finished(submit(api, **VIDEO | {"seed": 99, "steps": 8}).json()["id"])  # any work: a short one
    assert third.status == "succeeded", third.error
