"""A worker's tasks keep their database connection between tasks (DATABASE_CONN_MAX_AGE), as Django keeps a
request's: Celery's Django fixup, which closed it around every task, is told not to (CELERY_DB_REUSE_MAX), and
tasks/common.py closes it only when it broke or aged out."""

from __future__ import annotations

import time

import pytest
from celery.fixups.django import DjangoWorkerFixup
from django.db import connection

from genserver.celery import app
from tasks.common import keep_or_close_the_connection
from tasks.denoise import run_chunk

pytestmark = pytest.mark.django_db(transaction=True)  # the connection is used in autocommit, as a worker's is


def around_a_task(fixup: DjangoWorkerFixup) -> None:
    """What a worker runs around each task: Celery's fixup and ours, before and after."""
    for signal_handler in (fixup.on_task_prerun, fixup.on_task_postrun):
        signal_handler(sender=run_chunk)
        keep_or_close_the_connection(task=run_chunk)


def test_a_tasks_connection_is_kept_for_the_next_task():
    fixup = DjangoWorkerFixup(app)
    connection.ensure_connection()
    kept = connection.connection
    for _ in range(3):
        around_a_task(fixup)
        assert connection.connection is kept  # closed and opened again before: 2.4 ms of each chunk's dispatch


def test_a_connection_that_aged_out_or_broke_is_closed_between_tasks():
    fixup = DjangoWorkerFixup(app)
    connection.ensure_connection()
    connection.close_at = time.monotonic() - 1  # older than DATABASE_CONN_MAX_AGE
    around_a_task(fixup)
    assert connection.connection is None
    connection.ensure_connection()
    connection.errors_occurred = True
    connection.is_usable = lambda: False  # the server dropped it (a restart)
    try:
        around_a_task(fixup)
        assert connection.connection is None
    finally:
        del connection.is_usable
