"""A small process supervisor: start children, restart those that exit, stop them all on a signal, in order."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .zygote import ForkedProcess, Zygote

log = logging.getLogger("genserver.supervise")
STABLE_SECONDS = 60.0  # a child that ran this long before exiting restarts without back-off
CRASH_LOOP_RESTARTS = 2  # restarted this many times in a row without running STABLE_SECONDS: crash-looping
STATE_REFRESH_SECONDS = 5.0  # the state file is rewritten at least this often (readers treat an old one as stale)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True
    process: subprocess.Popen | ForkedProcess | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0
    stop_stage: int = 0  # Supervisor.stop stops stage 0 first, then 1, ...: what others depend on stops last
    last_exit: int | None = None
    forked: bool = False  # started (and restarted) by forking the zygote (workers/zygote.py) when it can


class Supervisor:
    """Runs children in their own process groups; Ctrl-C or SIGTERM stops every one of them.

    A child that exits is restarted after a back-off that doubles up to 30 s
    (a crash loop must not spin the CPU), unless it was added with restart=False.
    With a `state_file`, the children's state (running, restarts, crash-looping)
    is written there as JSON on every change, for /readyz (genserver/health.py).
    """

    def __init__(
        self, stop_timeout: float = 20.0, state_file: Path | None = None, zygote: Zygote | None = None
    ) -> None:
        """`zygote` forks the children added with forked=True (workers/zygote.py); without one they use Popen."""
        self.children: list[Child] = []
        self.zygote = zygote
        self.stop_timeout = stop_timeout
        self.state_file = state_file
        self._stopping = False
        self._state_written_at = 0.0

    def add(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        restart: bool = True,
        stop_stage: int = 0,
        forked: bool = False,
    ) -> Child:
        child = Child(name, argv, env or {}, restart, stop_stage=stop_stage, forked=forked)
        self.children.append(child)
        self._start(child)
        child.started_at = time.monotonic()
        self.write_state()
        return child

    def _start(self, child: Child) -> None:
        env = os.environ.copy()
        env.update(child.env)
        if child.forked and self.zygote is not None:
            child.process = self.zygote.spawn(child.argv, env)
            if child.process is not None:
                log.info("starting %s: %s (forked from the zygote)", child.name, " ".join(child.argv))
                return
        log.info("starting %s: %s", child.name, " ".join(child.argv))
        child.process = subprocess.Popen(child.argv, env=env, start_new_session=True)

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
        changed = False
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
                child.last_exit = proc.returncode
                changed = True
                log.warning("%s exited with %s; restarting in %.1f s", child.name, proc.returncode, delay)
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                self._start(child)
                child.started_at = time.monotonic()
                changed = True
        if changed or now - self._state_written_at > STATE_REFRESH_SECONDS:
            self.write_state()

    def crash_looping(self, child: Child, now: float | None = None) -> bool:
        """Restarted CRASH_LOOP_RESTARTS times in a row, none of them running STABLE_SECONDS."""
        now = time.monotonic() if now is None else now
        down = child.process is not None and child.process.poll() is not None
        recent = down or now - child.started_at < STABLE_SECONDS
        return child.restart and child.restarts >= CRASH_LOOP_RESTARTS and recent

    def state(self) -> dict:
        """The children as /readyz reads them: running, restarts in a row, last exit status, crash-looping."""
        now = time.monotonic()
        return {
            "supervisor_pid": os.getpid(),
            "updated_at": time.time(),
            "stopping": self._stopping,
            "children": {
                c.name: {
                    "running": c.process is not None and c.process.poll() is None,
                    "restarts": c.restarts,
                    "last_exit": c.last_exit,
                    "crash_looping": self.crash_looping(c, now),
                }
                for c in self.children
            },
        }

    def write_state(self) -> None:
        """Atomically replace the state file (temp file + rename), when there is one."""
        if self.state_file is None:
            return
        self._state_written_at = time.monotonic()
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_file.with_name(self.state_file.name + ".tmp")
            tmp.write_text(json.dumps(self.state()))
            os.replace(tmp, self.state_file)
        except OSError:
            log.warning("could not write %s", self.state_file, exc_info=True)

    def run_forever(self) -> None:
        self.install_signal_handlers()
        try:
            while not self._stopping:
                self.poll()
                time.sleep(0.5)
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop the children stage by stage (stop_stage 0 first): SIGTERM a stage's process groups
        (Celery's warm shutdown: the task in flight ends), wait for them, SIGKILL what is left, then
        the next stage. So the broker, stopped last, is there while the workers finish."""
        self._stopping = True
        for stage in sorted({c.stop_stage for c in self.children}):
            group = [c for c in self.children if c.stop_stage == stage and c.process is not None]
            if group:
                self._stop_group(group)
        if self.state_file is not None:
            self.state_file.unlink(missing_ok=True)

    def _stop_group(self, group: list[Child]) -> None:
        for child in reversed(group):
            if child.process.poll() is None:
                log.info("stopping %s", child.name)
                try:
                    os.killpg(child.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self.stop_timeout
        for child in group:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                log.info("stopped %s", child.name)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", child.name, self.stop_timeout)
            try:
                os.killpg(child.process.pid, signal.SIGKILL)  # what is left of its group (a pool child)
            except (ProcessLookupError, PermissionError):
                pass


def python() -> str:
    return sys.executable
