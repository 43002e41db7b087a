"""Bounded waits for a job to end (Prefer: wait, the OpenAI images endpoint)."""

from __future__ import annotations

import time
from typing import Any

from genserver.jobs.models import Job, JobStatus
from genserver.scheduling.pools import DECODE, ENCODE

from . import capacity  # capacity.live_workers: one name to stand in for in tests
from .capacity import capacity_of

# --- Bounded waits (Prefer: wait, the OpenAI images endpoint) ------------------------
WAIT_POLL_FIRST_SECONDS = 0.05  # short work ends within a few polls
WAIT_POLL_MAX_SECONDS = 0.5  # one indexed primary-key read per waiter at most twice a second


WAIT_SERVED_CHECK_SECONDS = 1.0  # how often a waiter checks that some live worker can still run its job


def _queue_it_waits_on(job: Job) -> str:
    """The queue whose worker runs the job's next stage."""
    if job.status == JobStatus.QUEUED:
        return ENCODE
    if job.status == JobStatus.DECODING:
        return DECODE
    return job.queue


def nobody_serves(job: Job) -> bool:
    """No live worker (on any node) consumes the queue of the job's next stage: waiting for it is in vain
    until one starts. Redis unreachable counts as served (the wait stays bounded by its deadline)."""
    try:
        workers = capacity.live_workers()
    except Exception:  # noqa: BLE001 - a wait is no place to fail a request for Redis
        return False
    wanted = _queue_it_waits_on(job)
    return not any(wanted in spec.consumed_queues() for spec in capacity_of(workers).workers)


def wait_for_terminal(job_id: Any, seconds: float) -> Job:
    """The job's row once it is terminal, or as it is when `seconds` have passed (never longer), or as soon
    as no live worker serves the stage it waits for (nothing could end it: the caller answers at once).

    Polls the row by primary key with a growing interval: a job that ends in a
    fraction of a second answers that quickly, a long wait costs one small read
    every WAIT_POLL_MAX_SECONDS, and a look at the workers' heartbeats every
    WAIT_SERVED_CHECK_SECONDS.
    """
    start = time.monotonic()
    deadline = start + max(0.0, seconds)
    interval = WAIT_POLL_FIRST_SECONDS
    next_check = start
    while True:
        job = Job.objects.get(pk=job_id)
        now = time.monotonic()
        left = deadline - now
        if job.is_terminal or left <= 0:
            return job
        if now >= next_check:
            if nobody_serves(job):
                return job
            next_check = now + WAIT_SERVED_CHECK_SECONDS
        time.sleep(min(interval, left))
        interval = min(interval * 2, WAIT_POLL_MAX_SECONDS)
