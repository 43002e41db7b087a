"""Condition waits: poll until something is true (with a generous timeout that only a real failure reaches)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

JOB_SECONDS = 180.0  # a stack job on a busy 2-core machine; only a stuck job reaches it


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> T:
    """Poll until predicate() is truthy; its value is returned. The timeout is a failure, not a pace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")


def job_row(job_id):
    from genserver.jobs.models import Job

    return Job.objects.get(pk=job_id)


def finished(job_id, timeout: float = JOB_SECONDS):
    """The job's row once it is terminal (succeeded, failed, cancelled or expired)."""
    return wait_for(lambda: (j := job_row(job_id)).is_terminal and j, timeout, what=f"job {job_id} to end")


def broker_drained(queues: Iterable[str], timeout: float = 30.0) -> None:
    """Until no message waits on `queues` (each was taken by a worker; it may still be running)."""
    from genserver.jobs.selectors import broker_depth

    names = list(queues)
    wait_for(lambda: all(broker_depth(q) == 0 for q in names), timeout, what=f"{names} to be drained")


def workers_idle(timeout: float = 30.0) -> None:
    """Until every live worker answers Celery's `inspect active` with no task running.

    A solo-pool worker answers only between tasks, so a worker that does not
    answer is busy, not idle.
    """
    from genserver.celery import app
    from workers.local_workers import live_worker_names

    def idle() -> bool:
        replies = app.control.inspect(timeout=1.0).active() or {}
        answered = set(replies)  # Celery hostnames: `gpu0@NODE`, as the liveness keys
        return live_worker_names() <= answered and not any(replies.values())

    wait_for(idle, timeout, interval=0.1, what="every worker to be idle")


def settled(queues: Iterable[str], timeout: float = 30.0) -> None:
    """Every message on `queues` taken and run to its end (duplicates included): nothing left to happen."""
    broker_drained(queues, timeout)
    workers_idle(timeout)
