"""The API's two handlers on one port: requests that stay open on Django's ASGI handler, the rest on kept threads.

Requests that hold the connection open (an event stream, a `Prefer: wait` submit, the OpenAI endpoint's bounded
wait) go to Django's ASGI handler: a stream waits on the event loop, a wait in a thread of its own, so no number
of them can starve the rest. Every other request, nearly all of the traffic, runs Django's middleware and view
synchronously on a fixed pool of threads (`KeptThreads`): Django's ASGI handler starts and joins a thread per
request and adapts each middleware across the sync/async line, which cost a submit about a fifth of the API's CPU
(docs/BENCHMARKS.md, "Submit throughput, stop 39"), and the kept threads keep their database connections. The
request goes to its thread once, with its body read, and its answer comes back once: a WSGI bridge (a2wsgi) handed
the start of the answer and each part of it back to the event loop one at a time, and a WSGI environ was built to
be turned into the request Django builds from the ASGI scope anyway (stop 45).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from tempfile import SpooledTemporaryFile
from typing import Any

from django.core import signals
from django.core.asgi import get_asgi_application
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.db import connections
from django.http import FileResponse, HttpResponseBase
from django.urls import set_script_prefix

from genserver import config
from genserver.jobs.api.waits import asks_to_wait

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# The routes of genserver/jobs/api/urls.py (job-events) and genserver/urls.py (openai-images-generate) that hold
# the request; tests/test_serving.py reverses their names, so a moved route fails there instead of here.
_STREAM = re.compile(r"^/api/v1/jobs/[^/]+/events/?$")
_BOUNDED_WAIT = ("/v1/images/generations",)


def holds_the_request(scope: Scope) -> bool:
    """Whether a request may stay open for long (seconds to minutes): it then runs on the ASGI handler."""
    if scope["type"] != "http":
        return True  # lifespan and anything else the WSGI side cannot speak
    path = scope["path"]
    if _STREAM.match(path) or path.rstrip("/") in _BOUNDED_WAIT:
        return True
    return any(name == b"prefer" and asks_to_wait(value.decode("latin-1")) for name, value in scope["headers"])


_kept = threading.local()


def _close_unless_kept(**_: Any) -> None:
    """At a request's end, close its connections unless its thread is one of the kept ones: the ASGI handler's
    thread ends with the request, and a connection left with it stays open (SQLite's file handles, a
    PostgreSQL backend) until the process ends. On PostgreSQL the pool then takes it back."""
    if not getattr(_kept, "thread", False):
        connections.close_all()


def _mark_kept() -> None:
    _kept.thread = True


class KeptThreads(ASGIHandler):
    """Django's handler for the requests answered at once: ASGI on the event loop's side (the body read there,
    the answer sent from there), the middleware and the view run synchronously on `threads` kept threads, each
    request handed to its thread once and its answer back once. A streamed answer (an output's file) is sent
    part by part from its thread, as the thread reads it."""

    def __init__(self, threads: int) -> None:
        BaseHandler.__init__(self)
        self.load_middleware(is_async=False)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="genserver-kept", initializer=_mark_kept)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # type: ignore[override]
        try:
            body = await self.read_body(receive)
        except RequestAborted:
            return
        loop = asyncio.get_running_loop()
        response = await loop.run_in_executor(self.pool, self.respond, scope, body, send, loop)
        if response is not None:
            await self.send_response(response, send)

    def respond(
        self, scope: Scope, body: SpooledTemporaryFile, send: Send, loop: asyncio.AbstractEventLoop
    ) -> HttpResponseBase | None:
        """On a kept thread: the request's answer, closed, for the event loop to send; or None once a streamed
        answer has been sent from here. Closing an answer sends request_finished, which hands this thread's
        database connection back: it must happen on the thread that served the request."""
        try:
            set_script_prefix(get_script_prefix(scope))
            signals.request_started.send(sender=self.__class__, scope=scope)
            request, response = self.create_request(scope, body)
            if request is not None:
                response = self.get_response(request)
                response._handler_class = self.__class__
                if isinstance(response, FileResponse):
                    response.block_size = self.chunk_size
        finally:
            body.close()
        try:
            if not response.streaming:
                return response
            self.stream(response, send, loop)
            return None
        finally:
            response.close()

    def stream(self, response: HttpResponseBase, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        """A streamed answer (an output's file, a static file): its start, then its parts, each sent by the event
        loop before the next is read."""

        def sent(message: dict[str, Any]) -> None:
            asyncio.run_coroutine_threadsafe(send(message), loop).result()  # type: ignore[arg-type]

        headers = [(str(name).encode("ascii"), str(value).encode("latin1")) for name, value in response.items()]
        headers += [(b"Set-Cookie", c.output(header="").encode("ascii").strip()) for c in response.cookies.values()]
        sent({"type": "http.response.start", "status": response.status_code, "headers": headers})
        for part in response:
            for chunk, _ in self.chunk_bytes(part):
                sent({"type": "http.response.body", "body": chunk, "more_body": True})
        sent({"type": "http.response.body"})


def application() -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The API's ASGI application (genserver.asgi). It closes the ASGI handler's connections at each request's
    end, in this process: build it only where it serves."""
    asynchronous = get_asgi_application()
    synchronous = KeptThreads(config.api_threads())
    signals.request_finished.connect(_close_unless_kept, dispatch_uid="genserver.asgi.close_unless_kept")

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        handler = asynchronous if holds_the_request(scope) else synchronous
        await handler(scope, receive, send)

    return route
