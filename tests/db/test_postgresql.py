"""genserver.db.postgresql: a connection is checked before it is used only once it sat idle past the window.

A kept connection (a worker's, between two tasks) in this process, and a pooled one through the real server
(uvicorn, one API process, a pool of one connection), each ended by PostgreSQL while nobody used it, as a server
restart or an idle timeout ends it.
"""

from __future__ import annotations

import uuid
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import psycopg
import pytest
from django.db import OperationalError, connection

from tests.reliability.conftest import using_postgres
from tests.support.live_server import AsgiServer
from tests.support.postgres import end_connections, open_connections
from tests.support.waits import wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not using_postgres(), reason="ends a PostgreSQL backend (DATABASE_URL)"),
]


def _status(server: AsgiServer, token: str) -> int:
    request = Request(f"{server.url}/api/v1/jobs/", headers={"Authorization": f"Token {token}"})
    try:
        with urlopen(request, timeout=30) as resp:
            return resp.status
    except HTTPError as err:
        return err.code


def _server(check_after_idle: str) -> tuple[AsgiServer, str]:
    name = f"genserver-test-pool-{uuid.uuid4().hex[:8]}"
    env = {"GENSERVER_DATABASE_POOL": "1", "GENSERVER_DATABASE_CHECK_AFTER_IDLE": check_after_idle, "PGAPPNAME": name}
    return AsgiServer(env=env), name


def _ended_between_requests(server: AsgiServer, name: str, token: str) -> int:
    """The status of a request after the pool's one connection was ended while it sat in the pool."""
    assert _status(server, token) == 200
    wait_for(lambda: open_connections(name) == 1, what="the pool's connection open")
    assert end_connections(name) == 1
    wait_for(lambda: open_connections(name) == 0, what="the pool's connection ended")
    return _status(server, token)


def test_a_connection_idle_past_the_window_is_checked_and_replaced(api_token):
    token = api_token("pool-checked")
    server, name = _server(check_after_idle="0")  # every borrow is past the window
    try:
        assert _ended_between_requests(server, name, token) == 200  # the check found it gone; another was lent
        assert _status(server, token) == 200
    finally:
        server.stop()


def test_a_connection_handed_back_within_the_window_is_lent_without_a_check(api_token):
    """What the window trades: no round trip before a request, and a connection the server ended within it fails
    the one request that borrows it; the pool then discards it and the next request gets a new one."""
    token = api_token("pool-unchecked")
    server, name = _server(check_after_idle="3600")
    try:
        assert _ended_between_requests(server, name, token) >= 500
        assert _status(server, token) == 200
    finally:
        server.stop()


def _end_this_processs_connection() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    params = {k: v for k, v in connection.get_connection_params().items() if k in ("dbname", "host", "port", "user")}
    with psycopg.connect(**params, autocommit=True) as other:
        assert other.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0]
        wait_for(
            lambda: not other.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()[0],
            what="the backend gone",
        )


def _next_tasks_query() -> int:
    """What a worker's next task does first (tasks/common.py at task_prerun), then its first query."""
    connection.close_if_unusable_or_obsolete()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        return cursor.fetchone()[0]


def test_a_kept_connection_idle_past_the_window_is_checked_and_replaced(settings):
    settings.DATABASE_CHECK_AFTER_IDLE = 0
    _end_this_processs_connection()
    assert _next_tasks_query() == 1  # the check found it gone; Django connected again


def test_a_kept_connection_used_within_the_window_is_not_checked(settings):
    """A task right after another uses the connection without a round trip first: one the server ended within the
    window fails that task's first query, as a drop during a query would; the next task gets a new one."""
    settings.DATABASE_CHECK_AFTER_IDLE = 3600
    _end_this_processs_connection()
    with pytest.raises(OperationalError):
        _next_tasks_query()
    assert _next_tasks_query() == 1
