"""The API's two handlers (genserver/serving.py): long requests on Django's ASGI handler, the rest on kept threads."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.request import Request, urlopen

import pytest
from django.contrib.staticfiles import finders
from django.urls import reverse

from genserver.serving import holds_the_request
from tests.reliability.conftest import using_postgres
from tests.support.live_server import AsgiServer
from tests.support.postgres import open_connections
from tests.support.waits import wait_for

THREADS = 2
REQUESTS = 24


def _http(path: str, *headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "path": path, "headers": list(headers)}


JOB = "0b8e7c2a-3f7e-4a55-9d8e-2f1f5a0f7e11"


@pytest.mark.parametrize(
    ("scope", "stays_open"),
    [
        # the routes that hold the request, by name: a moved route fails here
        (_http(reverse("job-events", args=[JOB])), True),
        (_http(reverse("openai-images-generate")), True),
        (_http("/api/v1/jobs/", (b"prefer", b"wait=10")), True),
        (_http("/api/v1/jobs/", (b"prefer", b"respond-async, wait = 5")), True),
        ({"type": "lifespan"}, True),
        (_http("/api/v1/jobs/"), False),
        (_http(f"/api/v1/jobs/{JOB}/"), False),
        (_http("/api/v1/jobs/", (b"prefer", b"return=minimal")), False),
        (_http("/api/v1/jobs/", (b"prefer", b"wait=soon")), False),  # malformed: the view ignores it too
        (_http("/api/v1/jobs/", (b"x-wait", b"wait=5")), False),
        (_http("/healthz"), False),
        (_http("/metrics"), False),
    ],
)
def test_requests_that_may_stay_open_go_to_the_asgi_handler_the_rest_to_the_kept_threads(scope, stays_open):
    assert holds_the_request(scope) is stays_open


# SQLite keeps a closed connection's file open while another connection of the process holds a lock on the
# file (its POSIX locks are per process), so its descriptors do not count connections.
@pytest.mark.skipif(not using_postgres(), reason="counts PostgreSQL's connections (DATABASE_URL)")
@pytest.mark.django_db(transaction=True)
def test_long_requests_leave_no_connection_behind_and_the_kept_threads_keep_theirs(api_token):
    """Each request on the ASGI handler runs in a thread that ends with it; its connection must close with it
    (left open, they piled up until PostgreSQL refused new ones). Quick requests keep at most one per thread."""
    token = api_token("connections")
    name = f"genserver-test-asgi-{uuid.uuid4().hex[:8]}"
    server = AsgiServer(env={"GENSERVER_API_THREADS": str(THREADS), "GENSERVER_DATABASE_POOL": "0", "PGAPPNAME": name})
    try:

        def get(prefer: str) -> int:
            headers = {"Authorization": f"Token {token}", **({"Prefer": prefer} if prefer else {})}
            with urlopen(Request(f"{server.url}/api/v1/jobs/", headers=headers), timeout=30) as resp:
                return resp.status

        with ThreadPoolExecutor(8) as pool:
            # a list is never waited on: `Prefer: wait` only routes these to the ASGI handler's threads
            statuses = list(pool.map(get, ["wait=5"] * REQUESTS + [""] * REQUESTS))
        assert statuses == [200] * (2 * REQUESTS)
        # a request's connection closes after its answer is sent: wait for the last ones (without the close, one
        # per request on the ASGI side stays open for good)
        wait_for(lambda: open_connections(name) <= THREADS, what="the long requests' connections closed")
        assert open_connections(name) >= 1  # the kept threads keep theirs
    finally:
        server.stop()


def test_the_kept_threads_answer_with_the_body_headers_and_cookies_django_wrote(asgi_server, api_token):
    """A quick request's answer through the real server: a file streamed part by part from its thread (larger
    than one part), a view's cookies, and a JSON body read on the event loop and parsed by the view."""
    static = "admin/js/vendor/jquery/jquery.js"
    with urlopen(f"{asgi_server.url}/static/{static}", timeout=30) as resp:
        on_disk = Path(finders.find(static)).read_bytes()
        assert len(on_disk) > 3 * 64 * 1024  # several of the handler's parts
        assert resp.read() == on_disk
        assert int(resp.headers["Content-Length"]) == len(on_disk)
    with urlopen(f"{asgi_server.url}/admin/login/", timeout=30) as resp:
        assert resp.status == 200 and "csrftoken=" in resp.headers["Set-Cookie"]
    token = api_token("kept-threads")
    body = json.dumps({"model": "sdxl-sim", "prompt": "p" * 2000, "steps": 2}).encode()
    request = Request(
        f"{asgi_server.url}/api/v1/jobs/",
        data=body,
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        method="POST",
    )
    with urlopen(request, timeout=30) as resp:
        assert resp.status == 201 and json.loads(resp.read())["prompt"] == "p" * 2000
