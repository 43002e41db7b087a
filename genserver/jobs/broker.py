"""The broker: each task's name and queue (declared once), publishing, and kombu's Redis key layout.

The job service publishes through here; `tasks/` registers its Celery tasks
with the names below (`@shared_task(name=broker.ENCODE_TASK.name)`), so a
task name is spelled in one place and the API process never imports
`tasks` (nor, through it, torch).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from uuid import UUID

import redis
from redis.commands.core import Script

from genserver.celery import app
from genserver.redis_client import (
    AHEAD_KEY,
    ARRIVED_KEY,
    ARRIVING_CLAIM_KEY,
    ARRIVING_KEY,
    CUT_CLAIM_KEY,
    client as redis_client,
)
from genserver.scheduling.pools import CONTROL, DECODE, ENCODE, WEBHOOKS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskRoute:
    """A task's registered name and the queue its messages go to ("": the queue is the job's own)."""

    name: str
    queue: str


ENCODE_TASK = TaskRoute("tasks.encode.encode", ENCODE)
CHUNK_TASK = TaskRoute("tasks.denoise.run_chunk", "")  # the job's class queue (or its lane's)
DECODE_TASK = TaskRoute("tasks.decode.decode", DECODE)
SEGMENT_DECODE_TASK = TaskRoute("tasks.segments.decode_segment", DECODE)
ASSEMBLE_TASK = TaskRoute("tasks.segments.assemble", DECODE)
WEBHOOK_TASK = TaskRoute("tasks.webhooks.deliver", WEBHOOKS)
REAP_TASK = TaskRoute("tasks.maintenance.reap", CONTROL)  # Celery beat
RETAIN_TASK = TaskRoute("tasks.maintenance.retain", CONTROL)  # Celery beat
PING_TASK = TaskRoute("tasks.probe.ping", "")  # bench/overhead.py picks the queue it measures


# --- publishing ----------------------------------------------------------------------


def _send(
    task: TaskRoute,
    args: list[Any],
    priority: int | None = None,
    queue: str = "",
    kwargs: dict[str, Any] | None = None,
    kwargsrepr: str | None = None,
) -> None:
    options: dict[str, Any] = {} if priority is None else {"priority": priority}
    if kwargsrepr is not None:  # what Flower and the logs show of the arguments (Celery's default: their repr)
        options["kwargsrepr"] = kwargsrepr
    app.send_task(task.name, args=args, kwargs=kwargs, queue=queue or task.queue, **options)


_ARRIVED_SECONDS = 10  # how long a published chunk's wake-up waits for a card that holds for it
# An announcement no card read is deleted with its queue's hash this long after the last one (a card reading it
# forgets an entry once it is older than the hold).
_ANNOUNCED_SECONDS = 3600


def send_encode(job_id: UUID, priority: int, chunk_queue: str = "") -> None:
    """The job's encode. With `chunk_queue`: first announce the chunk the encode will publish there at `priority`
    (`should_yield`); the encode withdraws it once the chunk is published (`arrived`)."""
    if chunk_queue:
        key = ARRIVING_KEY.format(queue=chunk_queue)
        try:
            with redis_client().pipeline() as pipe:
                pipe.hset(key, str(job_id), f"{priority} {time.time()}")
                pipe.expire(key, _ANNOUNCED_SECONDS)  # the entries a card never read (an idle stack) go with it
                pipe.execute()
        except redis.RedisError:  # only a card's hold at a boundary needs it; the job goes on without
            log.warning("could not announce the first chunk of job %s", job_id, exc_info=True)
    _send(ENCODE_TASK, [str(job_id)], priority)


def send_chunk(
    job_id: UUID, from_step: int, queue: str, priority: int, model: str = "", row: dict[str, Any] | None = None
) -> None:
    """The next denoise chunk goes to the job's queue (its class, or its model's own class queue)
    at its current priority band. `model`, where the caller has the job: the card loads it without reading
    the job first (a read on the path to the first step). `row`, a first chunk's publisher's copy of the row it
    wrote (genserver/jobs/rows.py): the card may begin the first step while it claims the job."""
    kwargs: dict[str, Any] = {"model": model} if model else {}
    if row is not None:
        kwargs["row"] = row
    # The row stays out of the message's headers (Flower and the logs show its model and that it is there).
    shown = f"{{'model': {model!r}, 'row': '…'}}" if row is not None else None
    _send(CHUNK_TASK, [str(job_id), from_step], priority, queue=queue, kwargs=kwargs or None, kwargsrepr=shown)


def arrived(job_id: UUID, queue: str) -> None:
    """The job's first chunk, announced by its encode, is published on `queue` (or the job left): a card that
    holds for it stops holding."""
    arrived_key = ARRIVED_KEY.format(job_id=job_id)
    try:
        with redis_client().pipeline() as pipe:
            pipe.hdel(ARRIVING_KEY.format(queue=queue), str(job_id))
            pipe.lpush(arrived_key, 1)  # wakes the card that holds for it, if one does
            pipe.expire(arrived_key, _ARRIVED_SECONDS)  # a hold lasts a fraction of a second
            pipe.execute()
    except redis.RedisError:  # the announcement ages out after the hold
        log.warning("could not withdraw the announcement of job %s", job_id, exc_info=True)


def send_decode(job_id: UUID, priority: int, model: str = "") -> None:
    """The job's decode goes to the decode worker. `model`, where the caller has the job: the worker loads its
    VAE without reading the job first."""
    _send(DECODE_TASK, [str(job_id)], priority, kwargs={"model": model} if model else None)


def send_webhook(job_id: UUID, event: str, payload: dict[str, Any]) -> None:
    """A webhook event goes to its own queue, consumed by a worker that holds no card."""
    _send(WEBHOOK_TASK, [str(job_id), event, payload])


def send_segment_decode(job_id: UUID, index: int, priority: int) -> None:
    """A long video's segment is decoded on the decode worker while its card denoises the next one."""
    _send(SEGMENT_DECODE_TASK, [str(job_id), index], priority)


def send_assemble(job_id: UUID, priority: int) -> None:
    """Every segment is published: the whole video is assembled on the decode worker."""
    _send(ASSEMBLE_TASK, [str(job_id)], priority)


def withdraw_chunks(queue: str, job_ids: Iterable[UUID]) -> int:
    """Take the waiting denoise messages of these jobs off `queue`: they joined a merged batch.

    Left there, each would wake a card only to find its job held (harmless,
    but a card's yield test would also see them as work waiting ahead of the
    batch). A message some worker takes meanwhile is simply not found.
    Returns how many were removed.
    """
    return withdraw(CHUNK_TASK, queue, job_ids)


def withdraw(task: TaskRoute, queue: str, job_ids: Iterable[UUID]) -> int:
    """Take the waiting `task` messages of these jobs off `queue` (every priority list; "": the task's own
    queue): a job re-prioritised is re-published at its new priority, one that expired needs none.
    A message some worker takes meanwhile is simply not found. Returns how many were removed."""
    wanted = [str(job_id).encode() for job_id in job_ids]
    if not wanted:
        return 0
    r = redis_client()
    keys = queue_keys(queue or task.queue)
    with r.pipeline() as pipe:
        for key in keys:
            pipe.lrange(key, 0, -1)
        listed = pipe.execute()
    task_name = task.name.encode()
    removed = 0
    for key, messages in zip(keys, listed):
        for raw in messages:
            if task_name in raw and any(job_id in raw for job_id in wanted):
                removed += int(r.lrem(key, 1, raw))
    return removed


# --- what waits in the broker (kombu's Redis layout) -------------------------------------

_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def queue_keys(queue: str) -> list[str]:
    """kombu's Redis layout: priority 0 in the list named like the queue, priority p in "queue:p"."""
    return [queue] + [f"{queue}:{p}" for p in range(1, 10)]


def broker_job_ids(queues: Iterable[str]) -> set[str]:
    """Ids of the jobs that have a message waiting in the broker (read from the task headers' argsrepr)."""
    r = redis_client()
    found: set[str] = set()
    for queue in queues:
        with r.pipeline() as pipe:
            for key in queue_keys(queue):
                pipe.lrange(key, 0, -1)
            for messages in pipe.execute():
                for raw in messages:
                    found.update(m.decode() for m in _UUID.findall(raw))
    return found


def should_yield(queues: Sequence[str], priority: int, worker: str, hold: float, *, at_equal: bool = True) -> bool:
    """A card's yield test at a chunk boundary, in one round trip when it keeps its job (the common case): whether
    a message it would take before the running job's continuation (at `priority` or better; better only without
    `at_equal`, classes.yields_to_equal_priority) waits on `queues`, or is about to: a better job (at a priority
    better than `priority`) announced by its encode message less than `hold` seconds ago (`send_encode`), whose
    first chunk was published while this card held for it. A video's step lasts seconds and an encode
    milliseconds, so the card yields to it rather than start another chunk. One card holds per job (the first to
    claim it); the hold ends early when the chunk is published and another card took it."""
    r = redis_client()
    lists = _lists_at_or_before(queues, priority if at_equal else priority - 1)
    announced = [ARRIVING_KEY.format(queue=queue) for queue in queues] if hold > 0 else []
    replies = _yield_test(r)(keys=[*lists, *announced], args=[len(lists)])
    if replies == 1:
        return True
    now, stale, better = time.time(), [], []
    for queue, flat in zip(queues, replies):
        for raw_id, raw in zip(flat[::2], flat[1::2]):
            at_priority, since = raw.split()
            if now - float(since) > hold:
                stale.append((queue, raw_id))
            elif int(at_priority) < priority:
                better.append((float(since), int(at_priority), raw_id.decode()))
    if stale:  # their chunks were never published (a cancel, a failed encode): forget them
        with r.pipeline() as pipe:
            for queue, raw_id in stale:
                pipe.hdel(ARRIVING_KEY.format(queue=queue), raw_id)
            pipe.execute()
    for since, at_priority, job_id in sorted(better):  # the first announced first
        if r.set(ARRIVING_CLAIM_KEY.format(job_id=job_id), worker, nx=True, ex=_CUT_CLAIM_SECONDS):
            return _held_until_published(r, queues, at_priority, job_id, since + hold)
    return False


# The yield test's read as one command: the lists' lengths, up to the first that holds a message (then 1), else
# each announcement hash's fields and values, flat. The same commands as a pipeline took the card 0.39 ms against
# 0.13-0.20 ms (21 lists and 3 hashes; most of it redis-py packing and parsing each command), at every boundary.
_YIELD_TEST = """
local lists = tonumber(ARGV[1])
for i = 1, lists do
  if redis.call('LLEN', KEYS[i]) > 0 then return 1 end
end
local announced = {}
for i = lists + 1, #KEYS do
  announced[#announced + 1] = redis.call('HGETALL', KEYS[i])
end
return announced
"""


@lru_cache(maxsize=1)
def _yield_test(r: redis.Redis) -> Script:
    """The yield test's script on `r` (sent by its hash; loaded again after a Redis restart forgot it)."""
    return r.register_script(_YIELD_TEST)


def _held_until_published(r: redis.Redis, queues: Sequence[str], priority: int, job_id: str, until: float) -> bool:
    """Block (no polling: the card's process and Redis stay idle) until the announced chunk is published or `until`
    passes; then whether a message this card would take first waits (False: another card already took it)."""
    left = until - time.time()
    if left <= 0:
        return False
    try:
        r.blpop([ARRIVED_KEY.format(job_id=job_id)], timeout=left)  # a float timeout needs Redis 6
    except redis.ResponseError:
        log.warning("cannot hold for an arriving job: a Redis before 6 takes no fractional timeout", exc_info=True)
        return False
    with r.pipeline() as pipe:
        for key in _lists_at_or_before(queues, priority):
            pipe.llen(key)
        return any(int(n) for n in pipe.execute())


def _lists_at_or_before(queues: Sequence[str], priority: int) -> list[str]:
    """The Redis lists of `queues` that a worker pops at `priority` or before (kombu's layout)."""
    return [key for queue in queues for key in queue_keys(queue)[: priority + 1]]


# How many of the next messages of a list a cut test reads: the ones a card would take next.
_CUT_LOOKAHEAD = 4
_CUT_CLAIM_SECONDS = 60  # a claim outlives any chunk's last step; the message is taken long before
# A job placed ahead that never starts (cancelled, expired) keeps its mark at most this long; its messages are
# gone by then, so a stale mark matches none.
_AHEAD_SECONDS = 3600


def claim_cut(queues: Sequence[str], priority: int, worker: str, waited: float) -> bool:
    """Whether this card should cut its running chunk now: a message of a job published ahead (the lightest
    user's, AHEAD_KEY) at least `waited` seconds ago waits on `queues` at a priority better than `priority`
    (the running job's continuation), and this card is the first to claim it (one card per message, so a
    waiting job costs one cut, not one per card). One round trip when nothing better waits (the common case)."""
    r = redis_client()
    keys = [key for queue in queues for key in queue_keys(queue)[:priority]]
    if not keys:
        return False
    with r.pipeline() as pipe:
        for key in keys:
            pipe.lrange(key, -_CUT_LOOKAHEAD, -1)  # kombu pushes on the left and pops on the right
        listed = pipe.execute()
    waiting = [(raw, _UUID.findall(raw)) for messages in listed for raw in reversed(messages)]  # next taken first
    ids = sorted({m.decode() for _, found in waiting for m in found})
    if not ids:
        return False
    # One read of every waiting message's marks (the ids in a message: its job's, and its task's, never marked).
    marked = {i: float(t) for i, t in zip(ids, r.mget([AHEAD_KEY.format(job_id=i) for i in ids])) if t is not None}
    for raw, found in waiting:
        since = [marked[m.decode()] for m in found if m.decode() in marked]
        if not since or time.time() - max(since) < waited:
            continue
        claim = CUT_CLAIM_KEY.format(message=hashlib.sha1(raw).hexdigest())
        if r.set(claim, worker, nx=True, ex=_CUT_CLAIM_SECONDS):
            return True
    return False


def mark_ahead(job_id: UUID) -> None:
    """The job was published ahead (services/fairness.py): its waiting messages may cut another user's chunk."""
    redis_client().set(AHEAD_KEY.format(job_id=job_id), time.time(), ex=_AHEAD_SECONDS)  # since when it waits


def clear_ahead(job_id: UUID) -> None:
    """Its first chunk was claimed: it no longer cuts anyone's chunk."""
    redis_client().delete(AHEAD_KEY.format(job_id=job_id))


def broker_depth(queue: str) -> int:
    """Messages waiting in the broker for `queue`, over all priority lists (kombu's key layout)."""
    r = redis_client()
    with r.pipeline() as pipe:
        for key in queue_keys(queue):
            pipe.llen(key)
        return sum(int(n) for n in pipe.execute())
