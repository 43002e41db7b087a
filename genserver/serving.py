"""The API's two handlers on one port: requests that stay open on Django's ASGI handler, the rest on kept threads.

Requests that hold the connection open (an event stream, a `Prefer: wait` submit, the OpenAI endpoint's bounded
wait) go to Django's ASGI handler: a stream waits on the event loop, a wait in a thread of its own, so no number
of them can starve the rest. Every other request, nearly all of the traffic, goes to Django's WSGI handler on a
fixed pool of threads (a2wsgi): Django's ASGI handler starts and joins a thread per request and adapts each
middleware across the sync/async line, which cost a submit about a fifth of the API's CPU (docs/BENCHMARKS.md,
"Submit throughput, stop 39"), and the kept threads keep their database connections.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from a2wsgi import WSGIMiddleware
from django.core.asgi import get_asgi_application
from django.core.signals import request_finished
from django.core.wsgi import get_wsgi_application
from django.db import connections

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


def application() -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The API's ASGI application (genserver.asgi). It closes the ASGI handler's connections at each request's
    end, in this process: build it only where it serves."""
    asynchronous = get_asgi_application()
    django_wsgi = get_wsgi_application()

    def on_kept_thread(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        _kept.thread = True
        return django_wsgi(environ, start_response)

    synchronous = WSGIMiddleware(on_kept_thread, workers=config.api_threads())  # type: ignore[arg-type]
    request_finished.connect(_close_unless_kept, dispatch_uid="genserver.asgi.close_unless_kept")

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        handler = asynchronous if holds_the_request(scope) else synchronous
        await handler(scope, receive, send)  # type: ignore[arg-type]

    return route
