"""Shared fixtures: the real database (migrated once), real Redis, real Celery workers and beat.

Helpers live in tests/support/; the stack boot in workers/local_workers.py (shared with bench/).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from django.core.management import call_command

from tests.support.api import submit  # noqa: F401 - re-exported: tests import these from here too
from tests.support.broker import clear_broker
from tests.support.isolation import flush_retrying_deadlocks, settle_stack
from tests.support.s3 import MotoServer
from tests.support.tiny_models import copy_tiny_models, open_run_cache
from tests.support.waits import job_row, wait_for  # noqa: F401 - re-exported
from workers.local_workers import LocalWorkers, wait_until_live

LIVE_SECONDS = 90.0  # a worker restarted by the supervisor imports Django and torch first: slow on 2 busy cores


@pytest.fixture(scope="session")
def django_db_setup(django_db_blocker):
    """Use the configured database itself (not a test_ copy): worker processes must see the same rows.

    CI points DATABASE_URL at its dedicated `test` database; locally it is a
    SQLite file in the session's private data directory. Either is emptied first.
    """
    with django_db_blocker.unblock():
        call_command("migrate", "--noinput", verbosity=0)
        # A run starts from empty tables, as with a fresh test database: an earlier run on the same
        # database (interrupted, or one before it on this machine) may have left rows behind.
        call_command("flush", "--noinput", verbosity=0)
        from django.conf import settings

        copy_tiny_models(settings.MODELS_DIR)  # the run's one generation (tests/support/tiny_models.py)


@pytest.fixture(scope="session")
def redis_conn():
    from genserver.redis_client import client

    conn = client()
    conn.flushdb()
    return conn


class _StackOnBackend:
    """The one stack of the session, on the storage backend the current test needs (rebooted on a change:
    the s3 variants of stack tests run last, so that happens at most once)."""

    def __init__(self) -> None:
        self.workers: LocalWorkers | None = None
        self.backend = ""

    def on(self, backend: str, env: dict[str, str]) -> LocalWorkers:
        if self.workers is not None and self.backend != backend:
            self.stop()
        if self.workers is None:
            self.workers = LocalWorkers(loglevel="WARNING")  # its children copy os.environ (storage_backend's)
            for child in self.workers.supervisor.children:  # and so do their restarts, after this test too
                child.env.update(env)
            self.backend = backend
        return self.workers

    def stop(self) -> None:
        if self.workers is not None:
            self.workers.stop()
            self.workers = None


@pytest.fixture(scope="session")
def _stack_on_backend(django_db_setup, redis_conn) -> Iterator[_StackOnBackend]:
    stacks = _StackOnBackend()
    yield stacks
    stacks.stop()


@pytest.fixture
def stack(_stack_on_backend, request) -> LocalWorkers:
    """The launcher's workers and beat (workers/local_workers.py, the boot bench/ uses too), on the local
    storage backend, or on the test's `storage_backend` when it asks for one."""
    backend, env = "local", {}
    if "storage_backend" in request.fixturenames:
        backend = request.getfixturevalue("storage_backend")
        env = request.getfixturevalue("storage_env")
    workers = _stack_on_backend.on(backend, env)
    # Every worker heartbeats before the test submits: admission counts live cards only, and a drill before
    # this test may have flushed Redis (the liveness keys with it) or killed a worker that is restarting.
    wait_until_live(workers.names, LIVE_SECONDS, poll=workers.supervisor.poll, interval=0.1)
    return workers


# --- Storage backends (issue 12): the local directory, and S3 through moto's server over HTTP ----------
S3_TEST_BUCKET = "genserver-test"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    """moto's standalone S3 server on 127.0.0.1 (tests/support/s3.py), with the test bucket."""
    with MotoServer() as server:
        server.create_bucket(S3_TEST_BUCKET)
        yield server


@pytest.fixture(params=["local", "s3"])
def storage_backend(request) -> str:
    """Run the test on each storage backend: the test process (and a stack it uses) stores through it."""
    return request.param


@pytest.fixture
def storage_env(storage_backend, request, monkeypatch) -> dict[str, str]:
    """The variables that select `storage_backend`, set in this process for the test; {} for local."""
    if storage_backend != "s3":
        monkeypatch.setenv("GENSERVER_STORAGE", "local")
        return {}
    env = request.getfixturevalue("s3_server").env(S3_TEST_BUCKET, prefix=f"session-{os.getpid()}")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture(autouse=True)
def _storage_env_set(request) -> None:
    """A test on a storage backend has its variables set before its other fixtures run."""
    if "storage_backend" in request.fixturenames:
        request.getfixturevalue("storage_env")


_TINY_MODELS_CACHE = pytest.StashKey["Path | None"]()


def pytest_configure(config: pytest.Config) -> None:
    """The run's tiny-models cache (tests/support/tiny_models.py): made here, in the first process."""
    config.stash[_TINY_MODELS_CACHE] = open_run_cache()
    from django.test import TransactionTestCase

    TransactionTestCase._fixture_teardown = flush_retrying_deadlocks(TransactionTestCase._fixture_teardown)


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    cache = config.stash.get(_TINY_MODELS_CACHE, None)
    if cache is not None:  # only the process that made it removes it
        shutil.rmtree(cache, ignore_errors=True)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Every test has a node id of its own: pytest-xdist (`make test`) hands tests out by node id.

    schemathesis names each operation's case (`test_…[GET /api/v1/jobs/]`), but on pytest 9.2 (whose node ids are
    structured) all of its cases keep the function's id: xdist would run one and silently skip the others. The
    case's name makes it unique (`pytest_collection_modifyitems` refuses any repeat that is left).
    """
    head, _, last = item.nodeid.rpartition("::")
    if last != item.name and head:
        from _pytest.nodeid import coerce_node_id  # the structured id pytest 9.2 reads `nodeid` from

        item._id = coerce_node_id(f"{head}::{item.name}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test without the stack runs before the first stack test, and stack tests on s3 run last; the
    stack tests marked `heavy` (one test of tens of seconds) run first among the stack tests.

    The session's workers start with the first stack test and outlive it: a test
    that publishes to the real broker without them (e.g. a submit it expects to
    stay `queued`) would otherwise have its job taken by a live worker, depending
    on where it falls in the order. On s3 the stack reboots once, not per test.
    pytest-django's own ordering (tryfirst) stays within each group: the sort is stable.
    Under pytest-xdist (`make test`) each worker has its own database, Redis and stack
    (tests/support/parallel.py), and xdist hands tests out in this order, so each
    worker too runs every test it gets without the stack before its first stack test. A heavy test handed
    out near the end would leave the other worker idle while it runs (the two-node drill, ~1 minute, did:
    the workers ended 14 s apart); at the front of the stack tests the short ones even out the end.
    """

    def uses_stack(item: pytest.Item) -> bool:
        return "stack" in getattr(item, "fixturenames", ())

    def on_s3_stack(item: pytest.Item) -> bool:
        params = getattr(getattr(item, "callspec", None), "params", {})
        return params.get("storage_backend") == "s3" and uses_stack(item)

    def light(item: pytest.Item) -> bool:
        return item.get_closest_marker("heavy") is None

    items.sort(key=lambda item: (uses_stack(item), on_s3_stack(item), light(item)))
    repeated = [nodeid for nodeid, n in Counter(item.nodeid for item in items).items() if n > 1]
    if repeated:  # xdist would run one of each and report the rest as never collected
        raise pytest.UsageError(f"tests share a node id, give them distinct ids: {repeated[:5]}")


@pytest.fixture
def long_limit(settings) -> Iterator[Callable[[float], None]]:
    """Set the long class's admission limit (wall seconds) for one test: long_limit(seconds)."""
    from genserver import deployment

    def set_limit(seconds: float) -> None:
        settings.ADMIT_LONG_SECONDS = seconds
        deployment.limits.cache_clear()

    yield set_limit
    deployment.limits.cache_clear()


@pytest.fixture
def empty_broker() -> Iterator[None]:
    """The job queues' Redis lists empty before and after the test (tests/support/broker.py)."""
    clear_broker()
    yield
    clear_broker()


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


@pytest.fixture(autouse=True)
def _no_learned_stage_seconds(request) -> None:
    """Each test's ETAs start from the queue and the cost model alone: the stage seconds the service learned
    (services/estimates.py, kept in Redis) are its memory of earlier jobs, here other tests' jobs."""
    if request.node.get_closest_marker("django_db") is None:
        return  # no database, no service: nothing reads them (and Redis may not be configured)
    from genserver.redis_client import STAGE_SECONDS_KEY

    request.getfixturevalue("redis_conn").delete(STAGE_SECONDS_KEY)


@pytest.fixture(autouse=True)
def _no_access_copies_of_other_tests(request) -> None:
    """Each test starts without this process's copies of token and quota rows (selectors/access.py): a rolled-back
    test's rows send no signal, and the next test's user may get the same id."""
    if request.node.get_closest_marker("django_db") is None:
        return
    from genserver.jobs.selectors import access

    access.forget_this_process()


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


@pytest.fixture
def staff_api(make_user):
    """A staff user's client: GET /api/v1/workers/ and the workers of /queues/ are theirs only."""
    return make_user("root", staff=True)


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

    from genserver.jobs.services import tokens

    def token_for(username: str, staff: bool = False) -> str:
        user, _ = get_user_model().objects.get_or_create(username=username, defaults={"is_staff": staff})
        return tokens.issue(user, "tests")[1]

    return token_for
