"""The API's database connections under concurrent requests (genserver/settings.py, DATABASE_POOL).

Under ASGI each request runs in a thread of its own, so a persistent connection stayed open with a thread that
was gone: a submit load left PostgreSQL with 89 connections of its 100 and then 503s. The API's processes
now borrow from a pool of GENSERVER_DATABASE_POOL connections and hand each back at the request's end.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from urllib.request import Request, urlopen

import pytest
from django.db import connection

from tests.reliability.conftest import using_postgres
from tests.support.live_server import AsgiServer

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not using_postgres(), reason="counts PostgreSQL's connections (DATABASE_URL)"),
]

POOL = 3  # small, so that a leak of one connection per request cannot hide inside it
REQUESTS = 60


def _opened_since(moment) -> int:
    """Connections to this database, other than this one, that were opened after `moment` and are still open."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_start > %s",
            [moment],
        )
        return cursor.fetchone()[0]


def test_concurrent_requests_share_the_pool_and_leave_no_connection_behind(api_token):
    token = api_token("pooled")
    server = AsgiServer(env={"GENSERVER_DATABASE_POOL": str(POOL)})
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT now()")
            started = cursor.fetchone()[0]

        def get(_: int) -> int:
            req = Request(f"{server.url}/api/v1/jobs/", headers={"Authorization": f"Token {token}"})
            with urlopen(req, timeout=30) as resp:
                return resp.status

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(get, range(REQUESTS)))
        assert statuses == [200] * REQUESTS  # 8 at a time on 3 connections: they wait their turn, none is refused
        assert _opened_since(started) <= POOL  # one per request before the pool: up to 60
    finally:
        server.stop()
