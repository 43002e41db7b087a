"""The launcher's workers and beat supervised from this process, ready once every worker heartbeats.

One boot for the test suite's `stack` fixture (tests/conftest.py) and the
benchmarks (bench/chaos.py, bench/livestack.py). It lives here, next to the
launcher it drives, because `bench/` must not import `tests/`, and both may
import `workers/`.

    workers = LocalWorkers(loglevel="WARNING")   # starts them; raises if not ready in boot_timeout
    workers.kill("card0"); workers.wait_ready()  # a crash, and the supervisor's restart
    workers.stop()

A second node on the same machine (tests/test_two_nodes.py): `LocalWorkers(node="b",
env={...its own scratch directory...}, beat=False)`; its workers are `card0@b`, ...
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence

from .launcher import cpu_threads_per_worker, current_layout, use_zygote, worker_argv, worker_env, worker_hostname
from .supervise import Child, Supervisor, python

BOOT_SECONDS = 90.0  # cold start of every worker (torch + diffusers imports) on a busy 2-core machine


def live_worker_names() -> set[str]:
    """The names (`card0@NODE`) of the workers whose liveness heartbeat is current (workers/heartbeat.py)."""
    from genserver.jobs.selectors import live_workers

    return {w["name"] for w in live_workers()}


def wait_until_live(
    names: Iterable[str], timeout: float, poll: Callable[[], object] = lambda: None, interval: float = 0.3
) -> None:
    """Until every worker in `names` heartbeats; `poll` runs each round (a supervisor restarting children)."""
    wanted, alive = set(names), set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        poll()
        alive = live_worker_names()
        if wanted <= alive | {name.partition("@")[0] for name in alive}:  # a bare pool entry: on any node
            return
        time.sleep(interval)
    raise RuntimeError(
        f"workers not live after {timeout:.0f} s: have {sorted(alive)}, want {sorted(wanted)}"
        " (their output is in the supervisor's log or on stderr)"
    )


class LocalWorkers:
    """The worker side of the service as `make up` runs it: one Celery worker per pool entry, and beat."""

    def __init__(
        self,
        *,
        loglevel: str = "WARNING",
        supervisor: Supervisor | None = None,
        worker_args: Sequence[str] = (),
        beat_schedule: str | None = None,
        boot_timeout: float = BOOT_SECONDS,
        node: str | None = None,
        env: dict[str, str] | None = None,
        beat: bool = True,
    ) -> None:
        """`node` names this launcher in the cluster (default GENSERVER_NODE); `env` is added to every
        child's environment (a node's own scratch directory); `beat`: exactly one per cluster."""
        from django.conf import settings

        from genserver import config

        self.node = node or config.node()
        self.supervisor = supervisor or Supervisor(stop_timeout=10)
        self.layout = current_layout()
        threads = cpu_threads_per_worker(self.layout)
        extra = {"GENSERVER_NODE": self.node, **(env or {})}
        forked = use_zygote(self.supervisor, self.layout)
        for spec in self.layout.workers:
            self.supervisor.add(
                f"worker {spec.name}",
                worker_argv(spec, loglevel, self.node) + list(worker_args),
                worker_env(spec, threads) | extra,
                forked=forked,
            )
        if beat:
            self.supervisor.add(
                "beat",
                [
                    python(),
                    "-m",
                    "celery",
                    "-A",
                    "genserver",
                    "beat",
                    "--loglevel",
                    loglevel,
                    "--schedule",
                    beat_schedule or settings.CELERY_BEAT_SCHEDULE_FILENAME,
                ],
                extra,
            )
        try:
            self.wait_ready(boot_timeout)
        except BaseException:  # the caller gets no object to stop: don't leave processes behind
            self.supervisor.stop()
            raise

    @property
    def names(self) -> set[str]:
        """The workers' names in the cluster: `card0@NODE`."""
        return {self.hostname(w.name) for w in self.layout.workers}

    def hostname(self, worker: str) -> str:
        """`card0` of this node as the cluster names it: `card0@NODE`."""
        return worker_hostname(worker, self.node)

    def wait_ready(self, timeout: float = BOOT_SECONDS) -> None:
        """Every worker of the layout has sent its liveness heartbeat (restarting any that exited)."""
        wait_until_live(self.names, timeout, poll=self.supervisor.poll)

    def child(self, worker: str) -> Child:
        return next(c for c in self.supervisor.children if c.name == f"worker {worker}")

    def kill(self, worker: str) -> None:
        """SIGKILL a worker's whole process group (main process and pool child): no cleanup runs."""
        from genserver import liveness

        os.killpg(self.child(worker).process.pid, signal.SIGKILL)
        self.child(worker).process.wait()
        liveness.forget(self.hostname(worker))  # not live from now, not once its heartbeat expires

    def suspend_workers(self) -> None:
        """Stop this node's workers (warm shutdown, no restart; beat keeps running) and drop their
        liveness keys: the cluster drill (tests/test_two_nodes.py) runs its own nodes meanwhile."""
        from genserver import liveness

        workers = [c for c in self.supervisor.children if c.name.startswith("worker ")]
        for child in workers:
            child.restart = False
            if child.process is not None and child.process.poll() is None:
                os.killpg(child.process.pid, signal.SIGTERM)
        for child in workers:
            if child.process is not None:
                child.process.wait()
        liveness.forget(*self.names)

    def resume_workers(self, timeout: float = BOOT_SECONDS) -> None:
        """Start the workers `suspend_workers` stopped, and wait until each heartbeats."""
        for child in self.supervisor.children:
            if child.name.startswith("worker ") and not child.restart:
                child.restart = True
                self.supervisor._start(child)
        self.wait_ready(timeout)

    def kill_node(self) -> None:
        """SIGKILL every process this node started (each worker's group: main process and pool child),
        as a machine that loses power: nothing is restarted, and the liveness keys stay until they
        expire (within the lease), as a dead machine's do."""
        for child in self.supervisor.children:
            child.restart = False
            if child.process is not None and child.process.poll() is None:
                os.killpg(child.process.pid, signal.SIGKILL)
        for child in self.supervisor.children:
            if child.process is not None:
                child.process.wait()

    def stop(self) -> None:
        self.supervisor.stop()
