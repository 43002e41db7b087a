"""Shared fixtures: the real database (migrated once), real Redis, real Celery workers and beat."""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
from django.conf import settings
from django.core.management import call_command

STACK_BOOT_SECONDS = 90


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


class Stack:
    """The worker side of the service, as `make up` runs it: the launcher's workers and beat."""

    def __init__(self) -> None:
        from workers.launcher import current_layout, start_workers
        from workers.supervise import Supervisor, python

        self.supervisor = Supervisor(stop_timeout=10)
        self.layout = current_layout()
        start_workers(self.supervisor, self.layout, loglevel="WARNING")
        self.supervisor.add("beat", [python(), "-m", "celery", "-A", "genserver", "beat", "--loglevel", "WARNING",
                                     "--schedule", settings.CELERY_BEAT_SCHEDULE_FILENAME])
        try:
            self.wait_ready()
        except BaseException:  # no fixture teardown runs for a failed setup: don't leave processes behind
            self.supervisor.stop()
            raise

    def wait_ready(self, timeout: float = STACK_BOOT_SECONDS) -> None:
        """Every worker of the layout has sent its liveness heartbeat."""
        from genserver.jobs.selectors import live_workers

        wanted = {w.name for w in self.layout.workers}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.supervisor.poll()
            alive = {w["name"] for w in live_workers()}
            if wanted <= alive:
                return
            time.sleep(0.3)
        raise RuntimeError(f"workers not ready after {timeout} s: have {alive}, want {wanted}")

    def child(self, worker: str):
        return next(c for c in self.supervisor.children if c.name == f"worker {worker}")

    def kill(self, worker: str) -> None:
        """SIGKILL a worker's whole process group (main process and pool child): no cleanup runs."""
        from genserver.redis_client import WORKER_KEY, client

        os.killpg(self.child(worker).process.pid, signal.SIGKILL)
        self.child(worker).process.wait()
        client().delete(WORKER_KEY.format(name=worker))

    def stop(self) -> None:
        self.supervisor.stop()


@pytest.fixture(scope="session")
def stack(django_db_setup, redis_conn) -> Iterator[Stack]:
    s = Stack()
    yield s
    s.stop()


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


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = ""):
    """Poll until predicate() is truthy; its value is returned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")


def job_row(job_id):
    from genserver.jobs.models import Job

    return Job.objects.get(pk=job_id)


def submit(client, **fields):
    body = {"model": "sdxl-sim", "prompt": "a lighthouse at dusk"} | fields
    return client.post("/api/v1/jobs/", data=json.dumps(body), content_type="application/json")
