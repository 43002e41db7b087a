"""`make up` as a user runs it: two stacks on one machine keep to their own Redis; Ctrl-C stops them in order,
quietly."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Collection
from pathlib import Path

import pytest
import redis

from genserver import config
from tests.conftest import wait_for
from tests.support.tiny_models import copy_tiny_models
from workers.bundled_redis import free_port

pytestmark = pytest.mark.stack

BOOT_SECONDS = 240  # two stacks boot side by side on a small machine
ALL_QUEUES = '["short", "medium", "long", "encode", "decode", "control", "webhooks"]'


class UpStack:
    """`python -m workers.stack` in its own data directory, ports and worker name, its output in a log file."""

    def __init__(
        self,
        worker: str,
        stdout: int | None = None,
        *,
        seeded: bool = True,
        derived_redis_port: bool = True,
        avoid_ports: Collection[int] = (),
    ) -> None:
        """`stdout`: a file descriptor for the banner instead of the log (stderr still goes to the log).
        `seeded`: the tiny checkpoints copied in first, as a second `make up` finds them; else the stack
        generates them, as a user's first `make up` does (7 CPU-s: one stack of the suite does it).
        `derived_redis_port`: the embedded Redis on the port the data directory derives (what `make up`
        does), in a directory whose port is free and not in `avoid_ports`; else on a port the OS hands out."""
        self.data_dir, self.redis_port = _data_dir(worker, derived_redis_port, avoid_ports)
        if seeded:
            copy_tiny_models(self.data_dir / "models")
        self.port, self.flower_port = free_port(), free_port()
        self.worker = worker
        env = {
            k: v
            for k, v in os.environ.items()
            # PROMETHEUS_MULTIPROC_DIR too: this process set it (genserver.metrics) to the session's folder,
            # and `make up` empties the one it is given of value files: the session's own counters.
            if k not in ("REDIS_URL", "DATABASE_URL", "GENSERVER_EMBEDDED_REDIS_PORT", "PROMETHEUS_MULTIPROC_DIR")
        }
        env |= {
            "GENSERVER_DATA_DIR": str(self.data_dir),
            **({} if derived_redis_port else {"GENSERVER_EMBEDDED_REDIS_PORT": str(self.redis_port)}),
            "GENSERVER_PORT": str(self.port),
            "FLOWER_PORT": str(self.flower_port),
            "GENSERVER_API_WORKERS": "1",
            "GENSERVER_LOG_LEVEL": "INFO",
            "GENSERVER_NODE": f"up-{worker}",
            "GENSERVER_POOLS": f'{{"workers": [{{"name": "{worker}", "queues": {ALL_QUEUES}}}]}}',
            "DJANGO_SETTINGS_MODULE": "genserver.settings",
        }
        self.log_path = self.data_dir / "stack.log"
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers.stack"],
            env=env,
            stdout=self.log if stdout is None else stdout,
            stderr=subprocess.STDOUT if stdout is None else self.log,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def token(self) -> str | None:
        found = re.search(r"Token\s+(\w+)", self.output())
        return found.group(1) if found else None

    def redis_url(self) -> str:
        """The bundled Redis this stack started (its command line is in the log)."""
        port = re.search(r"starting redis: \S+ --port (\d+) ", self.output()).group(1)
        return f"redis://127.0.0.1:{port}/0"

    def call(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            method="POST" if body else "GET",
            data=json.dumps(body).encode() if body else None,
            headers={"Authorization": f"Token {self.token()}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")
        except OSError as exc:  # a busy machine: the API did not answer in time (the caller waits and asks again)
            return 0, {"error": repr(exc)}

    def stop(self) -> None:
        """SIGTERM: the stack stops its children (their own process groups) itself; SIGKILL only if it hangs."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def _data_dir(worker: str, derived_redis_port: bool, avoid_ports: Collection[int]) -> tuple[Path, int]:
    """A fresh data directory and its stack's Redis port. A derived port can meet another directory's
    (1 in 1,000) or something else listening (the suite runs stacks at once): such a directory is
    traded for another, since the derivation, not the draw, is what these tests prove."""
    while True:
        data_dir = Path(tempfile.mkdtemp(prefix=f"genserver-up-{worker}-")).resolve()
        if not derived_redis_port:
            return data_dir, free_port()
        port = config.derived_redis_port(data_dir)
        if port not in avoid_ports and _nothing_listens(port):
            return data_dir, port
        shutil.rmtree(data_dir)


def _nothing_listens(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def two_stacks():
    alpha = UpStack("alpha", seeded=False)
    stacks = [alpha, UpStack("beta", avoid_ports={alpha.redis_port})]
    try:
        for stack in stacks:
            wait_for(
                lambda stack=stack: stack.token() or stack.process.poll() is not None,
                BOOT_SECONDS,
                interval=0.5,
                what=f"the {stack.worker} stack's banner",
            )
            assert stack.token(), stack.output()
        yield stacks
    finally:
        for stack in stacks:
            stack.stop()
            shutil.rmtree(stack.data_dir, ignore_errors=True)


def test_two_stacks_keep_their_own_redis_and_ctrl_c_stops_in_order_without_traceback(two_stacks):
    alpha, beta = two_stacks
    # A first `make up` writes the tiny checkpoints; one that finds them (beta's were copied in) does not.
    assert "making the tiny demo checkpoints" in alpha.output()
    assert "making the tiny demo checkpoints" not in beta.output()
    # Each on the port its data directory derives, so the two differ.
    assert [s.redis_url() for s in two_stacks] == [f"redis://127.0.0.1:{s.redis_port}/0" for s in two_stacks]
    assert alpha.redis_url() != beta.redis_url()
    # Each Redis holds only its own stack's worker heartbeat: the second stack did not join the first.
    for stack, other in ((alpha, beta), (beta, alpha)):
        conn = redis.Redis.from_url(stack.redis_url())
        key = f"genserver:worker:{stack.worker}@up-{stack.worker}"  # worker ids carry their node
        wait_for(lambda conn=conn, key=key: conn.exists(key), 60, interval=0.3, what=f"{stack.worker}'s heartbeat")
        assert not conn.exists(f"genserver:worker:{other.worker}@up-{other.worker}")
        wait_for(lambda stack=stack: stack.call("/readyz")[0] == 200, 60, interval=0.5, what=f"{stack.worker} ready")

    # A job in flight, then Ctrl-C: the workers and the API stop first, beat and Flower next, Redis last.
    # 2,960 s of video work (6 s at the test scale) in chunks of one step: the warm shutdown ends the
    # chunk in hand, checkpoints it and publishes the next one instead of running the video to its end.
    status, job = alpha.call(
        "/api/v1/jobs/", {"model": "wan-sim", "prompt": "waves", "width": 1280, "height": 720, "num_frames": 81}
    )
    assert status == 201, job
    wait_for(
        lambda: alpha.call(f"/api/v1/jobs/{job['id']}/")[1].get("progress", {}).get("step", 0) > 0,
        60,
        interval=0.2,
        what="the job to be denoising",
    )
    os.killpg(alpha.process.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends to the foreground group
    assert alpha.process.wait(timeout=120) == 0
    log = alpha.output()
    stopped = re.findall(r"\bstopped (api|worker \w+|beat|flower|redis)$", log, flags=re.M)
    assert set(stopped[:2]) == {"api", "worker alpha"}, log[-3000:]
    assert set(stopped[2:4]) == {"beat", "flower"} and stopped[4] == "redis", log[-3000:]
    for noise in ("Traceback", "Error 111", "Connection refused", "Restoring", "did not stop"):
        assert noise not in log, f"{noise!r} in the log of a clean stop:\n{log[-5000:]}"
    with sqlite3.connect(alpha.data_dir / "genserver.sqlite3") as db:
        status, checkpoint, steps = db.execute(
            "SELECT status, checkpoint_step, steps FROM jobs_job WHERE id = ?", (job["id"].replace("-", ""),)
        ).fetchone()
    assert status == "denoising" and 0 < checkpoint < steps, (status, checkpoint, steps)  # resumes at next start
    # The other stack did not notice.
    assert beta.call("/readyz")[0] == 200


def test_a_stack_whose_output_is_gone_stops_what_it_started():
    """The process reading `make up`'s output died (a benchmark interrupted while it waited for the banner):
    printing the banner fails, and the stack stops its children instead of leaving them running."""
    read, write = os.pipe()
    os.close(read)  # nobody reads the banner
    stack = UpStack("gamma", stdout=write, derived_redis_port=False)  # what it stops matters here, not the port
    os.close(write)
    try:
        assert stack.process.wait(timeout=BOOT_SECONDS) != 0
        output = stack.output()
        started = set(re.findall(r"\bstarting (api|worker \w+|beat|flower|redis):", output))
        stopped = set(re.findall(r"\bstopped (api|worker \w+|beat|flower|redis)$", output, flags=re.M))
        assert started == {"api", "worker gamma", "beat", "flower", "redis"}, output[-3000:]
        assert stopped == started, output[-3000:]
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", stack.port)) != 0  # the API no longer listens
    finally:
        stack.stop()
        shutil.rmtree(stack.data_dir, ignore_errors=True)
