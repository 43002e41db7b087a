"""GET /api/v1/jobs/{id}/events/: the job's server-sent event stream, served asynchronously (ASGI).

Each event's `data:` is the job exactly as GET /api/v1/jobs/{id}/ shows it and
its `id:` the entry of the job's Redis event log (genserver/jobs/events.py),
where the job service put the job's JSON once per event. The flow of one stream:

1. authenticate (an API token, `Token` or `Bearer`, in a thread; else the session) and
   check that the caller may see the job (its status only), or 404;
2. follow the job through this process's hub (`Hub`) *before* reading its log, so an
   event published in between is read, never lost;
3. with `Last-Event-ID`: replay the log after it (a reconnect); without: send
   the job as it is now (its one render per stream), with the log's latest id;
4. on each notification take the log's entries after the last id sent, and send them;
   every EVENTS_KEEPALIVE_SECONDS send a comment (proxies keep the connection)
   and read the log anyway (a lost notification delays, never drops, an event);
5. end after the terminal event. A reconnect after it gets 204, which tells an
   EventSource to stop reconnecting.

The hub is what keeps hundreds of streams cheap: per API process it holds one
pub/sub connection (subscribed once to each followed job's channel), reads each
new log entry once, and turns it into the SSE frame once per public base URL
(the relative URLs made absolute); every stream of that job relays those same
bytes. An open stream holds no request thread and no database connection (its
reads close theirs): only a waiter on the event loop, so submits are served
alongside hundreds of streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from rest_framework import exceptions

from genserver.jobs import events, selectors
from genserver.jobs.api.auth import authenticate_header_token
from genserver.jobs.models import Job

log = logging.getLogger(__name__)

URL_FIELDS = ("preview_url",)
NESTED_URL_FIELDS = (("outputs", ("url",)), ("segments", ("url", "poster_url")))
MAX_REDIS_CONNECTIONS = 1_000  # per API process: the hub's subscription and the log reads
RETRY_MS = 2000  # an EventSource reconnects after this long
ENTRY_ID = re.compile(r"^\d{1,20}-\d{1,20}$")  # a Redis stream id, as sent in `id:`
HUB_CHANNEL = "genserver:job-events-hub"  # the hub stays subscribed to it, so its reader always has a subscription
RESUBSCRIBE_SECONDS = 1.0  # after the subscription failed (Redis restarting), try again this often
OPENING_READS = 4  # per API process: the database reads of opening streams that run at once (in threads)
KEPT_ENTRIES = 64  # newest log entries a hub keeps per followed job (a stream further behind reads Redis itself)


def render_jobs(jobs: list[Job]) -> list[dict[str, Any]]:
    """The jobs as GET /api/v1/jobs/{id}/ shows them (relative URLs; each stream makes them absolute)."""
    from genserver.jobs.api.serializers import JobSerializer

    snapshot = selectors.QueueSnapshot.load()
    snapshot.prepare(jobs)
    context = {"request": None, "snapshot": snapshot}
    return [dict(JobSerializer(job, context=context).data) for job in jobs]


def _sort_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _absolute(base: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body's relative URLs prefixed with `base` (scheme://host of the request, no trailing slash)."""

    def fix(url: Any) -> Any:
        return base + url if isinstance(url, str) and url.startswith("/") else url

    for name in URL_FIELDS:
        body[name] = fix(body.get(name))
    for name, keys in NESTED_URL_FIELDS:
        for item in body.get(name) or []:
            for key in keys:
                item[key] = fix(item.get(key))
    return body


def _frame(base: str, entry_id: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(_absolute(base, body), separators=(",", ":"))
    return f"id: {entry_id}\ndata: {data}\n\n".encode()


@dataclass
class Entry:
    """One log entry, its SSE frame made once per base URL and shared by every stream of the process."""

    id: str
    job: str  # the job's JSON as the publisher rendered it (relative URLs)
    terminal: bool
    frames: dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def from_redis(cls, entry_id: Any, fields: dict[bytes, bytes]) -> Entry:
        return cls(events.as_text(entry_id), events.as_text(fields[b"job"]), fields.get(b"terminal") == b"1")

    def frame(self, base: str) -> bytes:
        found = self.frames.get(base)
        if found is None:
            found = self.frames[base] = _frame(base, self.id, json.loads(self.job))
        return found


def _entries(read: Any) -> list[Entry]:
    """XRANGE's answer as entries."""
    return [Entry.from_redis(entry_id, fields) for entry_id, fields in read or ()]


@dataclass
class Followed:
    """A job some streams of this process follow: its newest entries, read once for all of them."""

    waiters: set[asyncio.Event] = field(default_factory=set)
    entries: list[Entry] = field(default_factory=list)  # ascending; every entry after `since` up to the last read
    since: str | None = None  # None: nothing read yet
    stale: bool = True  # a notification (or a keepalive) came after the last read
    reading: asyncio.Future[None] | None = None


class Hub:
    """The event streams of one event loop (one per API process): one subscription, one read per entry."""

    def __init__(self, conn: aioredis.Redis) -> None:
        self.conn = conn
        self.pubsub = conn.pubsub()
        self.jobs: dict[str, Followed] = {}
        self.runner: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()  # one (un)subscription at a time: the pub/sub connection is not re-entrant
        self.opening = asyncio.Semaphore(OPENING_READS)  # streams' database reads in threads at once

    async def follow(self, job_id: str) -> asyncio.Event:
        """Wake the returned event at each new entry of the job (subscribed before this returns)."""
        async with self.lock:
            if not self.pubsub.subscribed:
                await self.pubsub.subscribe(**{HUB_CHANNEL: self._on_message})
            if self.runner is None or self.runner.done():
                self.runner = asyncio.create_task(self._run())
            followed = self.jobs.get(job_id)
            if followed is None:
                followed = self.jobs[job_id] = Followed()
                await self.pubsub.subscribe(**{events.channel(job_id): self._on_message})
            woken = asyncio.Event()
            followed.waiters.add(woken)
            return woken

    async def unfollow(self, job_id: str, woken: asyncio.Event) -> None:
        async with self.lock:
            followed = self.jobs.get(job_id)
            if followed is None:
                return
            followed.waiters.discard(woken)
            if not followed.waiters:
                del self.jobs[job_id]
                await self.pubsub.unsubscribe(events.channel(job_id))

    async def _run(self) -> None:
        """Read the subscription (the one reader of its connection); after a failure, wake every stream
        (whose own read then fails on a Redis that is down, ending it: clients resume) and read again."""
        while True:
            try:
                await self.pubsub.run(poll_timeout=settings.EVENTS_KEEPALIVE_SECONDS)
            except Exception:
                log.warning("the event streams' subscription failed; reading it again", exc_info=True)
                for followed in self.jobs.values():
                    followed.stale = True
                    for woken in followed.waiters:
                        woken.set()
                await asyncio.sleep(RESUBSCRIBE_SECONDS)

    def _on_message(self, message: dict[str, Any]) -> None:
        job_id = events.as_text(message["channel"]).rpartition(":")[2]
        followed = self.jobs.get(job_id)
        if followed is None:
            return
        followed.stale = True
        for woken in followed.waiters:
            woken.set()

    async def after(self, job_id: str, last_id: str, *, refresh: bool = False) -> list[Entry]:
        """The job's log entries after `last_id`: from the entries read for every stream of the process,
        read anew from Redis at most once per notification (or `refresh`), whoever asks first."""
        followed = self.jobs.get(job_id)
        if followed is None or (followed.since is not None and _sort_key(last_id) < _sort_key(followed.since)):
            # further behind than what is kept (a reconnect with an old Last-Event-ID): its own read
            return _entries(await self.conn.xrange(events.log_key(job_id), min=f"({last_id}"))
        if followed.since is None:
            followed.since = last_id
        if refresh:
            followed.stale = True
        while followed.stale:
            if followed.reading is None:
                followed.reading = asyncio.ensure_future(self._read(job_id, followed))
            await asyncio.shield(followed.reading)  # a stream that goes away does not cancel the others' read
        after = _sort_key(last_id)
        return [e for e in followed.entries if _sort_key(e.id) > after]

    async def _read(self, job_id: str, followed: Followed) -> None:
        followed.stale = False
        try:
            newest = followed.entries[-1].id if followed.entries else followed.since
            read = await self.conn.xrange(events.log_key(job_id), min=f"({newest}")
        except BaseException:
            followed.stale = True
            raise
        finally:
            followed.reading = None
        followed.entries.extend(_entries(read))
        if len(followed.entries) > KEPT_ENTRIES:
            dropped = len(followed.entries) - KEPT_ENTRIES
            followed.since = followed.entries[dropped - 1].id
            del followed.entries[:dropped]


# Per event loop (one per API process under uvicorn; Django's test client runs each request on a new one).
_pools: dict[asyncio.AbstractEventLoop, aioredis.ConnectionPool] = {}
_hubs: dict[asyncio.AbstractEventLoop, Hub] = {}


def _forget_closed_loops() -> None:
    for loop in [loop for loop in _pools if loop.is_closed()]:
        _pools.pop(loop, None)
        _hubs.pop(loop, None)


def _redis() -> aioredis.Redis:
    """One connection pool per event loop (the API process's), shared by its streams."""
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None:
        _forget_closed_loops()
        pool = _pools[loop] = aioredis.ConnectionPool.from_url(
            settings.REDIS_URL, socket_connect_timeout=5, max_connections=MAX_REDIS_CONNECTIONS
        )
    return aioredis.Redis(connection_pool=pool)


def _hub() -> Hub:
    loop = asyncio.get_running_loop()
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = Hub(_redis())
    return hub


def _closing_db(read: Any) -> Any:
    """`read` run in the stream's thread, its database connection closed after it: a stream stays open for
    minutes and must not hold a connection (PostgreSQL's max_connections) or its thread's file handle. Inside
    a test's transaction (Django's test client runs the view on the test's own connection) it stays open.

    At most OPENING_READS of them run at once per process: 200 streams opening together were 200 threads
    rendering jobs at once (the profile showed them queued on the Redis pool's lock), competing for the GIL
    with the event loop that relays every stream's events and answers every request."""

    def run(*args: Any) -> Any:
        try:
            return read(*args)
        finally:
            if not connection.in_atomic_block:
                connection.close()

    threaded = sync_to_async(run)

    async def limited(*args: Any) -> Any:
        async with _hub().opening:
            return await threaded(*args)

    return limited


def _authenticate(request: HttpRequest) -> Any:
    """The token's user, else None (`Token` or `Bearer`; in a thread: it reads the database)."""
    found = authenticate_header_token(request)
    return found[0] if found else None


def _visible_status(user: Any, job_id: Any) -> str | None:
    """The job's status if the user may see it, else None (the view's check: one row, nothing rendered)."""
    return selectors.jobs_visible_to(user).filter(pk=job_id).values_list("status", flat=True).first()


def _snapshot(user: Any, job_id: str) -> tuple[str, dict[str, Any] | None]:
    return events.snapshot(job_id, lambda: _visible_job(user, job_id))


def _visible_job(user: Any, job_id: Any) -> dict[str, Any] | None:
    job = selectors.jobs_visible_to(user).select_related("owner").prefetch_related("segments").filter(pk=job_id).first()
    return render_jobs([job])[0] if job is not None else None


async def job_events(request: HttpRequest, job_id: Any) -> HttpResponseBase:
    """Server-sent events of one job (owner or staff; 404 otherwise)."""
    # 1. who asks (first, as every other endpoint: an anonymous request is a 401 whatever its method)
    try:
        user = await _closing_db(_authenticate)(request)
    except exceptions.AuthenticationFailed as failed:
        return JsonResponse({"detail": str(failed.detail)}, status=401, headers={"WWW-Authenticate": "Token"})
    if user is None:
        session_user = await request.auser()
        user = session_user if session_user.is_authenticated else None
    if user is None:
        return JsonResponse(
            {"detail": "Authentication credentials were not provided."},
            status=401,
            headers={"WWW-Authenticate": "Token"},
        )
    if request.method != "GET":
        return JsonResponse({"detail": f'Method "{request.method}" not allowed.'}, status=405, headers={"Allow": "GET"})
    # 2. may they see the job
    status = await _closing_db(_visible_status)(user, job_id)
    if status is None:
        raise Http404("No such job.")
    job_id = str(job_id)
    last_id = (request.headers.get("Last-Event-ID") or "").strip()
    last_id = last_id if ENTRY_ID.match(last_id) else ""  # not one of ours: start afresh
    if last_id and status in events.TERMINAL_EVENTS:
        log_tail = await _redis().xrevrange(events.log_key(job_id), count=1)
        if log_tail and events.as_text(log_tail[0][0]) == last_id:
            return HttpResponse(status=204)  # the client has the terminal event: stop reconnecting
    base = request.build_absolute_uri("/").rstrip("/")
    response = StreamingHttpResponse(_stream(base, job_id, status, last_id, user), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return response


async def _stream(base: str, job_id: str, status: str, last_id: str, user: Any) -> AsyncIterator[bytes]:
    hub = _hub()
    conn = hub.conn
    log_key = events.log_key(job_id)
    woken: asyncio.Event | None = None
    try:
        # 2. follow first: whatever is published from here on is either in the log read below or announced
        woken = await hub.follow(job_id)
        # 3. a reconnect replays what it missed; a new stream (or one whose log expired) starts from the job as it is
        if last_id and status in events.TERMINAL_EVENTS and not await conn.xrange(log_key, min=f"({last_id}", count=1):
            last_id = ""  # ended, and its log no longer holds what came after: the job as it ended
        if not last_id:
            # The job as it is now, with the log's newest entry, both under the job's publish lock
            # (events.snapshot): whatever was logged up to `last_id` is in this row, and whatever is logged after
            # it was rendered after this row and is replayed from the log below. (The row read before the log's
            # newest entry skipped a terminal event logged in between; read apart from it, an event rendered
            # before this row but logged after showed the job going back.)
            last_id, current = await _closing_db(_snapshot)(user, job_id)
            if current is None:  # deleted since the check
                return
            yield f"retry: {RETRY_MS}\n".encode() + _frame(base, last_id, current)
            if current["status"] in events.TERMINAL_EVENTS:
                return
        # 4. follow the log
        refresh = True
        while True:
            woken.clear()  # cleared before the read: an entry announced during it wakes the wait below
            for entry in await hub.after(job_id, last_id, refresh=refresh):
                last_id = entry.id
                yield entry.frame(base)
                if entry.terminal:
                    return  # 5. the terminal event was the last
            try:
                await asyncio.wait_for(woken.wait(), timeout=settings.EVENTS_KEEPALIVE_SECONDS)
                refresh = False
            except TimeoutError:
                yield b": keepalive\n\n"
                refresh = True
    except aioredis.ConnectionError:
        return  # Redis went away (a restart, the stack stopping): end here; the client resumes with Last-Event-ID
    finally:
        if woken is not None:
            try:
                await hub.unfollow(job_id, woken)
            except aioredis.ConnectionError:
                pass
