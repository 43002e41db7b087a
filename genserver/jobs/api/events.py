"""GET /api/v1/jobs/{id}/events/: the job's server-sent event stream, served asynchronously (ASGI).

Each event's `data:` is the job exactly as GET /api/v1/jobs/{id}/ shows it and
its `id:` the entry of the job's Redis event log (genserver/jobs/events.py).
The flow of one stream:

1. authenticate (an API token, `Token` or `Bearer`, in a thread; else the session) and
   load the job the caller may see, or 404;
2. subscribe to the job's channel *before* reading its log, so an event
   published in between is read, never lost;
3. with `Last-Event-ID`: replay the log after it (a reconnect); without: send
   the job as it is now, with the log's latest id;
4. on each notification read the log after the last id sent, and send it;
   every EVENTS_KEEPALIVE_SECONDS send a comment (proxies keep the connection)
   and read the log anyway (a lost notification delays, never drops, an event);
5. end after the terminal event. A reconnect after it gets 204, which tells an
   EventSource to stop reconnecting.

An open stream holds no request thread and no database connection: only a
Redis subscription on the event loop, so submits are served alongside
hundreds of streams.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from rest_framework import exceptions

from genserver.jobs import events, selectors
from genserver.jobs.api.auth import authenticate_header_token
from genserver.jobs.models import Job

URL_FIELDS = ("preview_url",)
NESTED_URL_FIELDS = (("outputs", ("url",)), ("segments", ("url", "poster_url")))
MAX_REDIS_CONNECTIONS = 10_000  # per API process: its open streams and their log reads
RETRY_MS = 2000  # an EventSource reconnects after this long
ENTRY_ID = re.compile(r"^\d{1,20}-\d{1,20}$")  # a Redis stream id, as sent in `id:`
_pool: aioredis.ConnectionPool | None = None


def render_jobs(jobs: list[Job]) -> list[dict[str, Any]]:
    """The jobs as GET /api/v1/jobs/{id}/ shows them (relative URLs; each stream makes them absolute)."""
    from genserver.jobs.api.serializers import JobSerializer

    snapshot = selectors.QueueSnapshot.load()
    snapshot.prepare(jobs)
    context = {"request": None, "snapshot": snapshot}
    return [dict(JobSerializer(job, context=context).data) for job in jobs]


def _redis() -> aioredis.Redis:
    """One connection pool per process (the event loop's), shared by its streams."""
    global _pool
    if _pool is None:
        # Each open stream holds one connection (its subscription): redis-py's default cap (100) would refuse
        # the 101st stream of a process; the server's own limit (maxclients, 10,000 by default) is the bound.
        _pool = aioredis.ConnectionPool.from_url(
            settings.REDIS_URL, socket_connect_timeout=5, max_connections=MAX_REDIS_CONNECTIONS
        )
    return aioredis.Redis(connection_pool=_pool)


def _authenticate(request: HttpRequest) -> Any:
    """The token's user, else None (`Token` or `Bearer`; in a thread: it reads the database)."""
    found = authenticate_header_token(request)
    return found[0] if found else None


def _visible_job(user: Any, job_id: Any) -> dict[str, Any] | None:
    job = selectors.jobs_visible_to(user).select_related("owner").prefetch_related("segments").filter(pk=job_id).first()
    return render_jobs([job])[0] if job is not None else None


def _absolute(request: HttpRequest, body: dict[str, Any]) -> dict[str, Any]:
    def fix(url: Any) -> Any:
        return request.build_absolute_uri(url) if isinstance(url, str) and url.startswith("/") else url

    for field in URL_FIELDS:
        body[field] = fix(body.get(field))
    for field, keys in NESTED_URL_FIELDS:
        for item in body.get(field) or []:
            for key in keys:
                item[key] = fix(item.get(key))
    return body


def _frame(request: HttpRequest, entry_id: str, job: dict[str, Any] | str) -> bytes:
    body = json.loads(job) if isinstance(job, str | bytes) else job
    data = json.dumps(_absolute(request, body), separators=(",", ":"))
    return f"id: {entry_id}\ndata: {data}\n\n".encode()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def job_events(request: HttpRequest, job_id: Any) -> HttpResponse:
    """Server-sent events of one job (owner or staff; 404 otherwise)."""
    # 1. who asks (first, as every other endpoint: an anonymous request is a 401 whatever its method)
    try:
        user = await sync_to_async(_authenticate)(request)
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
        return JsonResponse({"detail": f'Method "{request.method}" not allowed.'}, status=405)
    # 2. may they see the job
    current = await sync_to_async(_visible_job)(user, job_id)
    if current is None:
        raise Http404("No such job.")
    conn = _redis()
    last_id = (request.headers.get("Last-Event-ID") or "").strip()
    last_id = last_id if ENTRY_ID.match(last_id) else ""  # not one of ours: start afresh
    if last_id and current["status"] in events.TERMINAL_EVENTS:
        log_tail = await conn.xrevrange(events.log_key(job_id), count=1)
        if log_tail and _text(log_tail[0][0]) == last_id:
            return HttpResponse(status=204)  # the client has the terminal event: stop reconnecting
    response = StreamingHttpResponse(
        _stream(request, conn, job_id, current, last_id, user), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return response


async def _stream(
    request: HttpRequest, conn: aioredis.Redis, job_id: Any, current: dict[str, Any], last_id: str, user: Any
) -> AsyncIterator[bytes]:
    log_key = events.log_key(job_id)
    pubsub = conn.pubsub()
    try:
        # 2. subscribe first: whatever is published from here on is either in the log read below or announced
        await pubsub.subscribe(events.channel(job_id))
        # 3. a reconnect replays what it missed; a new stream (or one whose log expired) starts from the job as it is
        if (
            last_id
            and current["status"] in events.TERMINAL_EVENTS
            and not await conn.xrange(log_key, min=f"({last_id}", count=1)
        ):
            last_id = ""  # ended, and its log no longer holds what came after: the job as it ended
        if not last_id:
            newest = await conn.xrevrange(log_key, count=1)
            last_id = _text(newest[0][0]) if newest else "0-0"
            # The job as it is now, read after the log's newest entry: an event is logged after its
            # transition commits, so whatever came before `last_id` is in this row, and whatever comes
            # after is replayed from the log below. (Read before, a terminal event logged in between was
            # skipped, and the stream waited on a job that had ended.)
            current = await sync_to_async(_visible_job)(user, job_id) or current
            yield f"retry: {RETRY_MS}\n".encode() + _frame(request, last_id, current)
            if current["status"] in events.TERMINAL_EVENTS:
                return
        # 4. follow the log
        while True:
            for entry_id, fields in await conn.xrange(log_key, min=f"({last_id}"):
                last_id = _text(entry_id)
                yield _frame(request, last_id, _text(fields[b"job"]))
                if fields.get(b"terminal") == b"1":
                    return  # 5. the terminal event was the last
            message = await pubsub.get_message(
                ignore_subscribe_messages=True, timeout=settings.EVENTS_KEEPALIVE_SECONDS
            )
            if message is None:
                yield b": keepalive\n\n"
    except aioredis.ConnectionError:
        return  # Redis went away (a restart, the stack stopping): end here; the client resumes with Last-Event-ID
    finally:
        try:
            await pubsub.aclose()
        except aioredis.ConnectionError:
            pass
