"""The launcher's workers and beat supervised from this process, ready once every worker heartbeats.

One boot for the test suite's `stack` fixture (tests/conftest.py) and the
benchmarks (bench/chaos.py, bench/livestack.py). It lives here, next to the
launcher it drives, because `bench/` must not import `tests/`, and both may
import `workers/`.

    workers = LocalWorkers(loglevel="WARNING")   # starts them; raises if not ready in boot_timeout
    workers.kill("card0"); workers.wait_ready()  # a crash, and the supervisor's restart
    workers.stop()
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence

from .launcher import cpu_threads_per_worker, current_layout, worker_argv, worker_env
from .supervise import Child, Supervisor, python

BOOT_SECONDS = 90.0  # cold start of every worker (torch + diffusers imports) on a busy 2-core machine


def live_worker_names() -> set[str]:
    """The names of the workers whose liveness heartbeat is current (workers/heartbeat.py)."""
    from genserver.jobs.selectors import live_workers

    return {w["name"] for w in live_workers()}


def wait_until_live(names: Iterable[str], timeout: float, poll: Callable[[], object] = lambda: None,
                    interval: float = 0.3) -> None:
    """Until every worker in `names` heartbeats; `poll` runs each round (a supervisor restarting children)."""
    wanted, alive = set(names), set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        poll()
        alive = live_worker_names()
        if wanted <= alive:
            return
        time.sleep(interval)
    raise RuntimeError(f"workers not live after {timeout:.0f} s: have {sorted(alive)}, want {sorted(wanted)}"
                       " (their output is in the supervisor's log or on stderr)")


class LocalWorkers:
    """The worker side of the service as `make up` runs it: one Celery worker per pool entry, and beat."""

    def __init__(self, *, loglevel: str = "WARNING", supervisor: Supervisor | None = None,
                 worker_args: Sequence[str] = (), beat_schedule: str | None = None,
                 boot_timeout: float = BOOT_SECONDS) -> None:
        from django.conf import settings

        self.supervisor = supervisor or Supervisor(stop_timeout=10)
        self.layout = current_layout()
        threads = cpu_threads_per_worker(self.layout)
        for spec in self.layout.workers:
            self.supervisor.add(f"worker {spec.name}", worker_argv(spec, loglevel) + list(worker_args),
                                worker_env(spec, threads))
        self.supervisor.add("beat", [python(), "-m", "celery", "-A", "genserver", "beat", "--loglevel", loglevel,
                                     "--schedule", beat_schedule or settings.CELERY_BEAT_SCHEDULE_FILENAME])
        try:
            self.wait_ready(boot_timeout)
        except BaseException:  # the caller gets no object to stop: don't leave processes behind
            self.supervisor.stop()
            raise

    @property
    def names(self) -> set[str]:
        return {w.name for w in self.layout.workers}

    def wait_ready(self, timeout: float = BOOT_SECONDS) -> None:
        """Every worker of the layout has sent its liveness heartbeat (restarting any that exited)."""
        wait_until_live(self.names, timeout, poll=self.supervisor.poll)

    def child(self, worker: str) -> Child:
        return next(c for c in self.supervisor.children if c.name == f"worker {worker}")

    def kill(self, worker: str) -> None:
        """SIGKILL a worker's whole process group (main process and pool child): no cleanup runs."""
        from genserver.redis_client import WORKER_KEY, client

        os.killpg(self.child(worker).process.pid, signal.SIGKILL)
        self.child(worker).process.wait()
        client().delete(WORKER_KEY.format(name=worker))  # not live from now, not once its heartbeat expires

    def stop(self) -> None:
        self.supervisor.stop()
