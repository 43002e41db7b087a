"""Reads: which jobs a user sees, and the queue picture (positions, ETAs, backlog) from the database."""
from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet

from genserver import deployment
from genserver.jobs.broker import broker_depth
from genserver.jobs.models import ACTIVE, Job, JobStatus
from genserver.redis_client import WORKER_KEY, client as redis_client
from genserver.scheduling.admission import WorkItem, expected_wait
from genserver.scheduling.classes import CLASSES, priority_for
from genserver.scheduling.pools import PoolLayout


def jobs_visible_to(user: Any) -> QuerySet[Job]:
    """Staff see every job; a user sees only their own (another's is a 404, not a 403)."""
    qs = Job.objects.all()
    return qs if user.is_staff else qs.filter(owner=user)


def model_of(job_id) -> str | None:
    """The job's model name (None if there is no such job), read without taking it."""
    return Job.objects.filter(pk=job_id).values_list("model", flat=True).first()


def _is_running(job: Job) -> bool:
    return bool(job.lease_owner) and job.status in (JobStatus.DENOISING,)


def _chunk_remaining(job: Job) -> float:
    step_seconds = job.estimated_seconds / job.total_steps if job.steps else 0.0
    done_in_chunk = max(0, job.steps_done - job.checkpoint_step)
    return max(0, job.chunk_steps - done_in_chunk) * step_seconds


def _work_item(job: Job, wall: bool) -> WorkItem:
    scale = job.clock_scale if wall else 1.0
    return WorkItem(queue=job.queue or job.duration_class, priority=job.priority,
                    remaining_seconds=job.remaining_seconds * scale, running=_is_running(job),
                    chunk_remaining_seconds=_chunk_remaining(job) * scale)


def _active_jobs() -> list[Job]:
    return list(Job.objects.filter(status__in=ACTIVE).only(
        "id", "status", "duration_class", "queue", "priority", "estimated_seconds", "clock_scale", "steps",
        "steps_done", "checkpoint_step", "chunk_steps", "lease_owner", "published_at", "created_at",
        "segment_count"))


def backlog_items() -> list[WorkItem]:
    """Every active job as admission sees it, in wall seconds (its work × its clock_scale): the clock
    of the estimates and ETAs the API shows and of the admission limits."""
    return [_work_item(j, wall=True) for j in _active_jobs()]


@dataclass
class QueueSnapshot:
    """The active jobs loaded once, answering position and ETA for many jobs in one request."""

    jobs: list[Job]
    layout: PoolLayout

    @classmethod
    def load(cls) -> QueueSnapshot:
        return cls(_active_jobs(), deployment.layout())

    def _ahead(self, job: Job) -> Iterable[Job]:
        key = (job.priority, job.published_at or job.created_at)
        for other in self.jobs:
            if other.pk == job.pk:
                continue
            if _is_running(other) or (other.priority, other.published_at or other.created_at) <= key:
                yield other

    def queue_position(self, job: Job) -> int | None:
        """Jobs that will take a card before this one (0: it runs, or runs next). None once terminal."""
        if job.is_terminal:
            return None
        if _is_running(job) or job.status == JobStatus.DECODING:
            return 0
        mine = {w.name for w in self.layout.workers if (job.queue or job.duration_class) in w.consumed_queues()}
        return sum(1 for other in self._ahead(job) if not _is_running(other)
                   and any((other.queue or other.duration_class) in w.consumed_queues()
                           for w in self.layout.workers if w.name in mine))

    def eta_seconds(self, job: Job) -> float | None:
        """Expected wall seconds until the job finishes denoising. None once terminal."""
        if job.is_terminal:
            return None
        # A job on a queue only card groups read runs group_speedup(k) times faster than one card.
        own = job.remaining_seconds * job.clock_scale / self.layout.job_speedup(job.queue or job.duration_class)
        if _is_running(job) or job.status == JobStatus.DECODING:
            return round(own, 3)
        items = [_work_item(o, wall=True) for o in self._ahead(job)]
        wait = expected_wait(job.queue or job.duration_class, job.priority, items, self.layout)
        return None if math.isinf(wait) else round(wait + own, 3)


def live_workers() -> list[dict[str, Any]]:
    """Workers that sent a heartbeat recently (see workers/heartbeat.py)."""
    r = redis_client()
    found = []
    for key in r.scan_iter(match=WORKER_KEY.format(name="*"), count=200):
        raw = r.get(key)
        if raw:
            found.append(json.loads(raw))
    return sorted(found, key=lambda w: w.get("name", ""))


def queue_overview() -> list[dict[str, Any]]:
    """Per duration class: depth, backlog, workers, and whether a new job would be accepted now
    (every figure in wall seconds, like the jobs' estimates and ETAs)."""
    layout, thresholds, limits = deployment.layout(), deployment.thresholds(), deployment.limits()
    jobs = _active_jobs()
    items = [_work_item(j, wall=True) for j in jobs]
    try:
        workers = live_workers()
    except Exception:  # noqa: BLE001 - the overview must answer even when Redis is down
        workers = None
    result = []
    for cls in CLASSES:
        mine = [j for j in jobs if j.duration_class == cls]
        # A typical new job of the class: its worst (latest-served) new-job priority.
        typical = {"short": thresholds.short * 0.99, "medium": thresholds.medium * 0.99,
                   "long": thresholds.medium * 20}[cls]
        wait = expected_wait(cls, priority_for(cls, typical, False, thresholds), items, layout)
        limit = limits.for_class(cls)
        entry: dict[str, Any] = {
            "name": cls,
            "depth": sum(1 for j in mine if not _is_running(j)),
            "running": sum(1 for j in mine if _is_running(j)),
            "backlog_seconds": round(sum(j.remaining_seconds * j.clock_scale for j in mine), 3),
            "workers": [w.name for w in layout.workers if cls in w.queues],  # dedicated ones included
            "expected_wait_seconds": None if math.isinf(wait) else round(wait, 3),
            "wait_limit_seconds": limit,
            "accepting": wait <= limit,
        }
        if workers is not None:
            entry["live_workers"] = [w["name"] for w in workers if cls in w.get("queues", [])]
            try:
                entry["broker_messages"] = broker_depth(cls)
            except Exception:  # noqa: BLE001 - the overview answers without the depth when Redis is down
                entry["broker_messages"] = None
        result.append(entry)
    return result


# --- Bounded waits (Prefer: wait, the OpenAI images endpoint) ------------------------
WAIT_POLL_FIRST_SECONDS = 0.05  # short work ends within a few polls
WAIT_POLL_MAX_SECONDS = 0.5  # one indexed primary-key read per waiter at most twice a second


def wait_for_terminal(job_id: Any, seconds: float) -> Job:
    """The job's row once it is terminal, or as it is when `seconds` have passed (never longer).

    Polls the row by primary key with a growing interval: a job that ends in a
    fraction of a second answers that quickly, a long wait costs one small read
    every WAIT_POLL_MAX_SECONDS.
    """
    deadline = time.monotonic() + max(0.0, seconds)
    interval = WAIT_POLL_FIRST_SECONDS
    while True:
        job = Job.objects.get(pk=job_id)
        left = deadline - time.monotonic()
        if job.is_terminal or left <= 0:
            return job
        time.sleep(min(interval, left))
        interval = min(interval * 2, WAIT_POLL_MAX_SECONDS)
