"""A small process supervisor: start children, restart those that exit, stop them all on a signal."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("genserver.supervise")
STABLE_SECONDS = 60.0  # a child that ran this long before exiting restarts without back-off


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True
    process: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0


class Supervisor:
    """Runs children in their own process groups; Ctrl-C or SIGTERM stops every one of them.

    A child that exits is restarted after a back-off that doubles up to 30 s
    (a crash loop must not spin the CPU), unless it was added with restart=False.
    """

    def __init__(self, stop_timeout: float = 20.0) -> None:
        self.children: list[Child] = []
        self.stop_timeout = stop_timeout
        self._stopping = False

    def add(self, name: str, argv: list[str], env: dict[str, str] | None = None, restart: bool = True) -> Child:
        child = Child(name, argv, env or {}, restart)
        self.children.append(child)
        self._start(child)
        return child

    def _start(self, child: Child) -> None:
        env = os.environ.copy()
        env.update(child.env)
        log.info("starting %s: %s", child.name, " ".join(child.argv))
        child.process = subprocess.Popen(child.argv, env=env, start_new_session=True)
        child.started_at = time.monotonic()

    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            self._stopping = True

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def poll(self) -> None:
        """Restart children that exited (call in a loop)."""
        now = time.monotonic()
        for child in self.children:
            proc = child.process
            if proc is None or proc.poll() is None:
                continue
            if not child.restart:
                continue
            if child.next_start == 0.0:
                if now - child.started_at > STABLE_SECONDS:
                    child.restarts = 0  # it ran fine for a while: this exit is not part of a crash loop
                delay = min(30.0, 0.5 * 2 ** min(child.restarts, 6))
                child.next_start = now + delay
                log.warning("%s exited with %s; restarting in %.1f s", child.name, proc.returncode, delay)
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                self._start(child)

    def run_forever(self) -> None:
        self.install_signal_handlers()
        try:
            while not self._stopping:
                self.poll()
                time.sleep(0.5)
        finally:
            self.stop()

    def stop(self) -> None:
        """SIGTERM every child's process group (warm shutdown), then SIGKILL what is left."""
        self._stopping = True
        for child in reversed(self.children):
            if child.process and child.process.poll() is None:
                try:
                    os.killpg(child.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self.stop_timeout
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", child.name)
            try:
                os.killpg(child.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def python() -> str:
    return sys.executable
