"""Job events for live clients: each change is appended to a short per-job Redis log and announced on pub/sub.

The job service calls `publish_on_commit(job_id, kind)` at every transition a
client cares about (status and stage, progress at each heartbeat, a preview,
outputs, an error, the end). Once the transaction commits, `publish`:

1. renders the job once with the API's own representation (the renderer the
   jobs app registers at start-up: the serializer of GET /api/v1/jobs/{id}/),
   under the job's own short lock until step 2 is done, since several processes
   publish one job's events (`_one_writer`);
2. appends `{event, job, terminal}` to the job's capped Redis stream
   (`EVENT_LOG`, MAXLEN EVENTS_LOG_LENGTH, expiring EVENTS_TTL_SECONDS after
   its last event): the entry id is the SSE `id:`, so a client reconnecting
   with Last-Event-ID reads what it missed, the terminal event included;
3. publishes the entry id on the job's channel (`EVENT_CHANNEL`), which wakes
   the open streams of that job (genserver/jobs/api/events.py) to read the log.

A job waiting in a queue also moves when others leave it: `publish_queue_moved`
refreshes the waiting jobs of that queue that someone is watching (Redis'
PUBSUB NUMSUB says which), so queue position and ETA stay live without any
client polling the database. Publishing is best effort: Redis down is logged
and never fails the transition that committed.

A worker publishes from a thread of its own (`publish_in_background`, called at
its start): rendering the job (its queue position and ETA are several queries)
must not delay the card. Python runs one thread at a time, so that thread also
waits while the card's thread is on its way to a step (`card_busy`): else it
takes the interpreter for up to its switch interval (5 ms) at a time, in the
middle of a dispatch. The API publishes at once, so a response that follows
an event finds it in the log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar
from uuid import UUID

import redis
from django.conf import settings
from django.db import close_old_connections, transaction

from genserver.jobs.models import Job
from genserver.redis_client import client as redis_client

log = logging.getLogger(__name__)
T = TypeVar("T")

EVENT_LOG = "genserver:job-events:{job_id}"  # a Redis stream per job: the events a reconnect may replay
EVENT_CHANNEL = "genserver:job-events-notify:{job_id}"  # pub/sub: "a new entry is in the log"
TERMINAL_EVENTS = ("succeeded", "failed", "cancelled", "expired")
WATCHED_LIMIT = 200  # waiting jobs of one queue checked for watchers when it moves

# job → its API representation (a JSON-ready dict); registered by JobsConfig.ready(), so that the job
# service, which publishes, does not import the API layer that owns the serializer.
Renderer = Callable[[list[Job]], list[dict[str, Any]]]
_renderer: Renderer | None = None


def set_renderer(render: Renderer) -> None:
    global _renderer
    _renderer = render


def _render(jobs: list[Job]) -> list[dict[str, Any]]:
    if _renderer is None:  # the jobs app not ready (a script without django.setup()): the webhook subset
        from genserver.webhooks import job_payload

        return [job_payload(job) for job in jobs]
    return _renderer(jobs)


def log_key(job_id: UUID | str) -> str:
    return EVENT_LOG.format(job_id=job_id)


def channel(job_id: UUID | str) -> str:
    return EVENT_CHANNEL.format(job_id=job_id)


# Set in a worker process (`publish_in_background`): one thread, so the process's events keep their order.
_background: ThreadPoolExecutor | None = None


def publish_in_background() -> None:
    """From now on, this process's events are rendered and appended by a thread of their own (a worker's:
    measured in-process, a first chunk's claim and first heartbeat spent 5 ms of its 13 ms before the first
    step publishing theirs). They stay in order; one that is pending when the process stops is still sent."""
    global _background
    if _background is None:
        _background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="job-events")
    hold_hand_overs_while_busy()


# Cleared while the card's thread runs the path to its next step (a task's claim to its first step, a chunk
# boundary, an encode to its chunk's publish); the background thread starts its next item only once it is set
# again, or after CARD_BUSY_MAX_SECONDS, so that no event waits long behind a card that holds it (a model load).
_card_free = threading.Event()
_card_free.set()
CARD_BUSY_MAX_SECONDS = 0.5

# Work handed over while the card is busy waits here, not in its executor's queue: an item queued there wakes the
# executor's thread, which takes the interpreter from the card's thread only to find the card busy and sleep again
# (a first chunk's claim and load hand over five; held, its task's start to its first step went 0.99-1.10 →
# 0.86-0.96 ms in process, docs/BENCHMARKS.md "stop 42"). `card_stepping` queues them, in order; at the latest,
# the watcher queues them once the first one's CARD_BUSY_MAX_SECONDS are up. It looks every HELD_CHECK_SECONDS
# rather than being woken, since a wake-up on the card's path is what this avoids: more often keeps the bound
# closer, less often wakes the process less.
HELD_CHECK_SECONDS = 0.1
_held: list[tuple[ThreadPoolExecutor, Callable[[], None], float]] = []  # (executor, run, its latest start)
_hand_over = threading.Lock()  # the held list and the decision to hold, so that items keep their order
_watcher: threading.Thread | None = None

# A card whose task ends by yielding to a message waiting for it is still on the way to a step: the next task's.
# Its background work (the yielded chunk's deferred writes) ran between the two tasks, beside Celery's ack and
# delivery, and made those 4-7 ms longer at the median (docs/BENCHMARKS.md, "The hand-over"). It now waits
# to the next task's first step, or until the watcher lets it go HAND_OVER_MAX_SECONDS after the yield (the
# message went to another card): shorter runs the deferred work sooner on a card left idle, longer waits less
# often for a delivery that is merely slow.
HAND_OVER_MAX_SECONDS = 0.1
_free_after: float | None = None  # monotonic: when the watcher ends a hand-over that found no task


def hold_hand_overs_while_busy() -> None:
    """From now on, work handed over while the card is busy is held in this process until it steps (a worker's)."""
    global _watcher
    with _hand_over:
        if _watcher is None:
            _watcher = threading.Thread(target=_queue_overdue, name="held-work-watcher", daemon=True)
            _watcher.start()


def _queue_overdue() -> None:
    global _free_after
    while _watcher is threading.current_thread():  # a test that replaced it ends this one
        time.sleep(min(HELD_CHECK_SECONDS, CARD_BUSY_MAX_SECONDS))
        with _hand_over:
            if _free_after is not None and _free_after <= time.monotonic():
                _free_after = None
                _card_free.set()
            if _held and (_card_free.is_set() or _held[0][2] <= time.monotonic()):
                _queue_held()


def _queue_held() -> None:
    """With `_hand_over` held: every held item onto its executor's queue, in the order they were handed over."""
    for executor, run, _latest in _held:
        executor.submit(run)
    _held.clear()


def card_busy() -> None:
    """The card's thread is on its way to a step: this process's background work waits (a worker's)."""
    global _free_after
    _free_after = None  # a task took the card: its first step or its end lets the work go
    _card_free.clear()


def card_stepping() -> None:
    """The card's thread is in a step or idle: background work runs beside it (a GPU step leaves the CPU free; a
    task's end must call this or `card_handing_over`)."""
    global _free_after
    with _hand_over:
        _free_after = None
        _card_free.set()
        if _held:
            _queue_held()


def card_handing_over() -> None:
    """The card's task ends by yielding to a message waiting for it (tasks/denoise.py): background work keeps
    waiting through the hand-over, to the next task's first step, HAND_OVER_MAX_SECONDS at most. Where no watcher
    would end the wait (a process that does not hold hand-overs), the same as `card_stepping`."""
    global _free_after
    with _hand_over:
        if _watcher is not None:
            _free_after = time.monotonic() + HAND_OVER_MAX_SECONDS
            _card_free.clear()
            return
    card_stepping()


def in_background(work: Callable[..., Any], *args: Any) -> None:
    """`work(*args)` on the worker's event thread, after the events already queued there; at once in a process
    without one (the API). For what a card must not wait for and a later pass repairs if it is lost: a failure
    is logged either way, never raised (an executor would keep it in a future nobody reads)."""
    if _background is None:
        _logged(work, *args)
    else:
        after_the_card(_background, work, *args)


def after_the_card(executor: ThreadPoolExecutor, work: Callable[..., Any], *args: Any) -> Future[None]:
    """`work(*args)` on `executor`'s thread once the card's thread is not on its way to a step (`card_busy`), or
    CARD_BUSY_MAX_SECONDS after now at the latest; on that thread's own database connection, dropped first if it
    broke (a database restart). A failure is logged. Handed over while the card is busy, it is held in this
    process until then (`hold_hand_overs_while_busy`), not queued."""
    latest = time.monotonic() + CARD_BUSY_MAX_SECONDS
    done: Future[None] = Future()

    def run() -> None:
        try:
            _card_free.wait(max(0.0, latest - time.monotonic()))
            close_old_connections()
            _logged(work, *args)
        except Exception as error:  # close_old_connections: the caller's future carries it, as an executor's did
            done.set_exception(error)
            raise
        else:
            done.set_result(None)

    with _hand_over:
        if _watcher is not None and (_held or not _card_free.is_set()):  # behind the held ones: in order
            _held.append((executor, run, latest))
        else:
            executor.submit(run)
    return done


def _logged(work: Callable[..., Any], *args: Any) -> None:
    try:
        work(*args)
    except Exception:
        log.warning("background work %s%r failed", getattr(work, "__name__", work), args, exc_info=True)


def publish_soon(job_id: UUID | str, kind: str) -> None:
    """`publish` at once, or on the worker's event thread (a transition that has committed already)."""
    in_background(publish, job_id, kind)


def publish_on_commit(job_id: UUID | str, kind: str) -> None:
    """Publish the job's `kind` event once the transaction that made it true commits (at once outside one)."""
    transaction.on_commit(lambda: publish_soon(job_id, kind))


# A job's events are published by several processes (the API, its encode worker, each card a chunk of it runs on,
# its decode worker). Each renders the row as it reads it, then appends: two of them rendering and appending at the
# same time could append the older picture last, and a stream would see the job go back (step 5, then step 1). So a
# job's render and append happen under its own short Redis lock; it expires on its own if its holder dies.
PUBLISH_LOCK = "genserver:job-events-lock:{job_id}"
PUBLISH_LOCK_SECONDS = 5.0  # held at most this long (a holder that died)
PUBLISH_LOCK_WAIT_SECONDS = 2.0  # then the event goes out without it: a late event beats a lost one


@contextlib.contextmanager
def _one_writer(job_ids: list[UUID | str]) -> Iterator[None]:
    """These jobs' events are rendered and appended by this thread alone inside the block (locks taken in one order,
    so two publishers of overlapping sets never deadlock)."""
    with contextlib.ExitStack() as held:
        for job_id in sorted(str(j) for j in job_ids):
            lock = redis_client().lock(
                PUBLISH_LOCK.format(job_id=job_id),
                timeout=PUBLISH_LOCK_SECONDS,
                sleep=0.002,
                blocking_timeout=PUBLISH_LOCK_WAIT_SECONDS,
            )
            if lock.acquire():
                held.callback(_release, lock)
            else:
                log.debug(
                    "published job %s's event without its lock (held past %s s)", job_id, PUBLISH_LOCK_WAIT_SECONDS
                )
        yield


def _release(lock: Any) -> None:
    try:
        lock.release()
    except redis.exceptions.LockError:  # it expired meanwhile: another publisher may hold it now
        pass


def publish(job_id: UUID | str, kind: str) -> str | None:
    """Append the job's current representation to its event log and wake its streams; the entry id, or None."""
    try:
        with _one_writer([job_id]):
            job = Job.objects.select_related("owner").prefetch_related("segments").filter(pk=job_id).first()
            if job is None:
                return None
            return _append(job, kind, _render([job])[0])
    except Exception:
        log.warning("could not publish the %s event of job %s", kind, job_id, exc_info=True)
        return None


def snapshot(job_id: UUID | str, render: Callable[[], T]) -> tuple[str, T]:
    """The id of the job's newest logged event ("0-0" when none) and `render()`, taken together under the job's
    lock: every event logged after that id was rendered after this render (a new stream's first frame), so a
    stream that starts from it never sees the job go back."""
    with _one_writer([job_id]):
        newest = redis_client().xrevrange(log_key(job_id), count=1)
        return (as_text(newest[0][0]) if newest else "0-0"), render()


def as_text(value: Any) -> str:
    """A Redis reply (bytes, or str on a client that decodes) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _append(job: Job, kind: str, body: dict[str, Any]) -> str:
    terminal = job.is_terminal
    entry = {
        "event": kind if not terminal or kind in TERMINAL_EVENTS else job.status,
        "job": json.dumps(body, separators=(",", ":"), default=str),
        "terminal": "1" if terminal else "0",
    }
    conn = redis_client()
    if terminal and (end := _logged_end(conn, job.pk, entry["event"])):
        return end  # a late publisher (its transition came before the end) adds nothing after the end
    pipe = conn.pipeline(transaction=True)
    pipe.xadd(log_key(job.pk), entry, maxlen=settings.EVENTS_LOG_LENGTH, approximate=False)
    pipe.expire(log_key(job.pk), int(settings.EVENTS_TTL_SECONDS))
    entry_id = as_text(pipe.execute()[0])
    conn.publish(channel(job.pk), entry_id)
    return entry_id


def _logged_end(conn: Any, job_id: UUID | str, event: str) -> str:
    """The id of the log's last entry when it is already this end of the job (`event`, terminal), else ""."""
    newest = conn.xrevrange(log_key(job_id), count=1)
    if not newest:
        return ""
    fields = {as_text(k): as_text(v) for k, v in newest[0][1].items()}
    return as_text(newest[0][0]) if fields.get("terminal") == "1" and fields.get("event") == event else ""


def publish_queue_moved(queue: str) -> int:
    """A job left `queue` (a worker took it): refresh queue position and ETA of the watched jobs waiting there.

    Only jobs with an open stream (a subscriber on their channel) are rendered, so an unwatched
    queue costs one query and one NUMSUB. Returns how many events were published.
    """
    from genserver.jobs.models import ACTIVE, JobStage

    try:
        waiting = list(
            Job.objects.filter(queue=queue, status__in=ACTIVE, stage__in=(JobStage.QUEUED, JobStage.WAITING))
            .order_by("priority", "created_at")
            .values_list("pk", flat=True)[:WATCHED_LIMIT]
        )
        if not waiting:
            return 0
        counts = redis_client().pubsub_numsub(*(channel(pk) for pk in waiting))
        watched = [pk for pk, (_name, subscribers) in zip(waiting, counts) if subscribers]
        if not watched:
            return 0
        with _one_writer(watched):
            jobs = list(Job.objects.select_related("owner").prefetch_related("segments").filter(pk__in=watched))
            for job, body in zip(jobs, _render(jobs)):
                _append(job, "queue", body)
        return len(jobs)
    except Exception:
        log.warning("could not refresh the watched jobs of queue %s", queue, exc_info=True)
        return 0


def publish_queue_moved_on_commit(queue: str) -> None:
    transaction.on_commit(lambda: in_background(publish_queue_moved, queue))
