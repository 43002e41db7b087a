"""The plans SQLite takes for the queue's reads: over their partial indexes, not the status index or the table.

SQLite uses a partial index only for a query whose condition repeats the index's terms, and never where they
are bound parameters: the reads write them into their text, word for word (selectors/positions.py). Led by
the owner, job_fair_window could not serve a queue's read of every user's published jobs (migration 0018)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from django.db import connection

from genserver.jobs.selectors import positions
from tests.reliability.conftest import using_postgres

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(using_postgres(), reason="SQLite's plans (no DATABASE_URL)"),
]


def _plan(sql: str, params: list) -> str:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
        return " | ".join(row[-1] for row in cursor.fetchall())


def _compiled(read: positions.CompiledRead, **values) -> tuple[str, list]:
    alias, statement = read._statement()
    params = list(statement.params)
    for name, value in values.items():
        for index in statement.positions[name]:
            params[index] = statement._adapted(value)
    return statement.sql, params


@pytest.mark.parametrize("ascending", [True, False])
def test_a_priority_read_from_either_end_goes_over_the_waiting_order(ascending):
    sql, params = _compiled(positions._neighbours_read(ascending), priority=3, key=datetime.now(UTC))
    assert "USING INDEX job_waiting_order" in _plan(sql, params)


def test_the_middle_sums_go_over_the_waiting_order():
    values = {"priority": 3, "job0": uuid.uuid4(), "job1": uuid.uuid4()}
    values |= {"key0": datetime(2026, 1, 1, tzinfo=UTC), "key1": datetime.now(UTC)}
    sql, params = _compiled(positions._middle_read(2, held=False), **values)
    assert "USING INDEX job_waiting_order" in _plan(sql, params)


def test_the_fair_windows_reads_go_over_its_index():
    alias = connection.alias
    assert "USING INDEX job_fair_window (queue=?)" in _plan(positions._published_by_owner_sql(alias), ["short", 2000])
    plan = _plan(positions._window_count_sql(alias), ["short", 1])
    assert "job_fair_window (queue=? AND owner_id=?)" in plan
