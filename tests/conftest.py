"""Shared fixtures: the real database (migrated once), real Redis, real Celery workers and beat.

Helpers live in tests/support/; the stack boot in workers/local_workers.py (shared with bench/).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from django.core.management import call_command

from tests.support.api import submit  # noqa: F401 - re-exported: tests import these from here too
from tests.support.isolation import settle_stack
from tests.support.waits import job_row, wait_for  # noqa: F401 - re-exported
from workers.local_workers import LocalWorkers


@pytest.fixture(scope="session")
def django_db_setup(django_db_blocker):
    """Use the configured database itself (not a test_ copy): worker processes must see the same rows.

    CI points DATABASE_URL at its dedicated `test` database; locally it is a
    SQLite file in the session's private data directory.
    """
    with django_db_blocker.unblock():
        call_command("migrate", "--noinput", verbosity=0)
        call_command("make_tiny_models", verbosity=0)


@pytest.fixture(scope="session")
def redis_conn():
    from genserver.redis_client import client

    conn = client()
    conn.flushdb()
    return conn


@pytest.fixture(scope="session")
def stack(django_db_setup, redis_conn) -> Iterator[LocalWorkers]:
    """The launcher's workers and beat (workers/local_workers.py, the boot bench/ uses too)."""
    workers = LocalWorkers(loglevel="WARNING")
    yield workers
    workers.stop()


@pytest.fixture(autouse=True)
def _no_inherited_stack_work(request) -> Iterator[None]:
    """A stack test neither inherits nor leaves a job in flight (tests/support/isolation.py).

    The database fixture is set up first, so this teardown runs before
    pytest-django empties the tables: the jobs it cancels still have their rows.
    """
    if "stack" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("transactional_db")  # every stack test is transactional: workers see its rows
    settle_stack()
    yield
    settle_stack()


@pytest.fixture
def make_user() -> Callable:
    """An API client authenticated as a new user (needs a django_db mark on the test)."""
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    def make(username: str, staff: bool = False):
        user = get_user_model().objects.create_user(username=username, is_staff=staff)
        client = APIClient()
        client.force_authenticate(user)
        client.user = user
        return client

    return make


@pytest.fixture
def api(make_user):
    return make_user("alice")


# --- events (issue 13): the real ASGI server, for SSE, the CLI and other HTTP clients -----------------

@pytest.fixture(scope="session")
def asgi_server(django_db_setup, redis_conn) -> Iterator:
    """uvicorn serving genserver.asgi on a free port (tests/support/live_server.py), sharing this session's
    database, Redis and storage. Tests using it need the database rows committed (transactional_db or `stack`)."""
    from tests.support.live_server import AsgiServer

    server = AsgiServer()
    yield server
    server.stop()


@pytest.fixture
def api_token(transactional_db) -> Callable:
    """token_for(username, staff=False): a user (created if needed) and their API token, committed."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    def token_for(username: str, staff: bool = False) -> str:
        user, _ = get_user_model().objects.get_or_create(username=username, defaults={"is_staff": staff})
        return Token.objects.get_or_create(user=user)[0].key

    return token_for
