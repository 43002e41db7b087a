"""The plans PostgreSQL takes for a list page's reads once their statements are prepared: over the indexes.

A statement a connection has run GENSERVER_DATABASE_PREPARE_AFTER times is prepared, and PostgreSQL may then
plan it once for any value of its parameters (its generic plan). The plans below are the generic ones, read
with EXPLAIN ANALYZE on a queue where the wrong plan reads every job: a page's own jobs older than another
user's burst, and a page's job in the middle of a deep priority.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.models import F
from django.utils import timezone
from psycopg.sql import Literal

from genserver.jobs.models import Job, JobStage, JobStatus
from tests.reliability.conftest import using_postgres

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(not using_postgres(), reason="PostgreSQL's plans (DATABASE_URL)"),
]

BURST = 600  # another user's queued jobs


def _copies(template: Job, owner: Any, count: int, first: Any) -> None:
    """`count` queued copies of `template` for `owner`, submitted (and published) a millisecond apart from `first`."""
    rows = []
    for i in range(count):
        copy = Job(**{f.attname: getattr(template, f.attname) for f in Job._meta.concrete_fields})
        copy.id, copy.owner_id, copy.held = uuid.uuid4(), owner.pk, False
        copy.status, copy.stage, copy.lease_owner = JobStatus.QUEUED, JobStage.QUEUED, ""
        copy.published_at = first + timedelta(milliseconds=i)
        rows.append(copy)
    Job.objects.bulk_create(rows)
    # auto_now_add stamped them all now: the submit time each would have had
    Job.objects.filter(pk__in=[r.pk for r in rows]).update(created_at=F("published_at"))


def _generic_plans(run: Any, wanted: str) -> Iterator[dict]:
    """The generic plan, as EXPLAIN ANALYZE's JSON, of each statement whose text holds `wanted` among those
    one call of `run` (a request) makes, run with the request's values."""
    statements: list[tuple[str, Any]] = []

    def capture(execute, sql, params, many, context):
        statements.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(capture):
        run()
    for sql, params in statements:
        if wanted in sql:
            yield _generic_plan(sql, params)


def _generic_plan(sql: str, params: Any) -> dict:
    """The statement prepared under a name, planned for any value of its parameters, run with `params`: its
    plan as EXPLAIN ANALYZE's JSON."""
    numbered = sql.split("%s")
    text = "".join(f"{part}${n}" for n, part in enumerate(numbered[:-1], 1)) + numbered[-1]
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        try:
            # through psycopg itself, with no parameters: Django's cursor would bind the $n as its own
            connection.connection.execute(f"PREPARE generic_plan AS {text.replace('%%', '%')}")
            # EXECUTE takes no bound parameters: the values as literals
            values = ", ".join(Literal(value).as_string(connection.connection) for value in params or ())
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE generic_plan" + (f"({values})" if values else ""))
            explained = cursor.fetchone()[0]
            return (json.loads(explained) if isinstance(explained, str) else explained)[0]["Plan"]
        finally:
            connection.connection.execute("DEALLOCATE generic_plan")
            cursor.execute("RESET plan_cache_mode")


def _nodes(plan: dict) -> Iterator[dict]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


def _job_rows_read(plan: dict) -> int:
    """The job table's rows the plan read: those its scans of the table returned and those their filters dropped."""
    return sum(
        node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        for node in _nodes(plan)
        if node.get("Relation Name") == Job._meta.db_table
    )


def test_a_users_page_reads_their_own_jobs_whatever_others_submitted_since(make_user):
    """The page's statement names its owner in its text, so that PostgreSQL plans each user's page for that
    user: with the owner bound, the generic plan reckoned each owner held an equal share of the jobs and, in
    bench.depth's queue (10,000 of another user's jobs, newer than four of the page's), walked the submit-time
    index through all of them (docs/BENCHMARKS.md, "A list page at 10,000 queued, stop 47"). This smaller
    queue does not tip the planner that way; it checks the statement and that its plan reads the owner's rows."""
    alice, bob = make_user("alice"), make_user("bob")
    response = alice.post("/api/v1/jobs/", {"model": "sdxl-sim", "prompt": "mine", "steps": 4}, format="json")
    assert response.status_code == 201, response.content
    template = Job.objects.get(pk=response.json()["id"])
    _copies(template, alice.user, 24, timezone.now() - timedelta(hours=1))
    _copies(template, bob.user, BURST, timezone.now())  # a burst newer than every job of alice's
    with connection.cursor() as cursor:  # as autovacuum would soon after the burst
        cursor.execute(f"ANALYZE {Job._meta.db_table}")

    def page() -> None:
        response = alice.get("/api/v1/jobs/?limit=20")
        assert response.status_code == 200 and len(response.json()["results"]) == 20

    plans = list(_generic_plans(page, 'INNER JOIN "auth_user"'))  # the page's jobs and their owner
    assert len(plans) == 1
    owner_conditions = [
        node.get("Index Cond", "") + node.get("Filter", "") for node in _nodes(plans[0]) if "owner_id" in str(node)
    ]
    assert owner_conditions and not any("$" in c for c in owner_conditions), owner_conditions  # not bound
    assert _job_rows_read(plans[0]) <= 25 + 20, json.dumps(plans[0])[:2000]  # alice's jobs, not bob's burst


def test_a_pages_job_in_the_middle_of_a_deep_priority_is_summed_over_the_waiting_index(make_user):
    """A page's job with NEAR_END or more waiting on both sides is summed in the database (`_middle_sums`):
    over job_waiting_order, the rows ahead of it and no others. Asked as one condition with an OR, and with
    the statuses bound, PostgreSQL's plan read the whole job table."""
    alice, bob = make_user("alice"), make_user("bob")
    response = alice.post("/api/v1/jobs/", {"model": "sdxl-sim", "prompt": "mine", "steps": 4}, format="json")
    assert response.status_code == 201, response.content
    template = Job.objects.get(pk=response.json()["id"])
    start = timezone.now() - timedelta(hours=1)
    _copies(template, bob.user, BURST, start)
    # alice's job halfway along bob's burst, its own neighbours on both sides more than NEAR_END
    _copies(template, alice.user, 1, start + timedelta(milliseconds=BURST // 2, microseconds=500))
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {Job._meta.db_table}")

    def page() -> None:
        response = alice.get("/api/v1/jobs/?limit=20")
        assert response.status_code == 200
        assert [job["queue_position"] for job in response.json()["results"]][-1] == BURST // 2 + 1

    plans = list(_generic_plans(page, "CASE WHEN"))
    assert plans  # it was summed
    for plan in plans:
        assert _job_rows_read(plan) <= BURST // 2 + 10, json.dumps(plan)[:2000]  # the rows ahead of it


def test_every_connection_of_the_service_plans_for_a_table_read_from_memory(settings):
    with connection.cursor() as cursor:
        cursor.execute("SHOW random_page_cost")
        assert float(cursor.fetchone()[0]) == settings.DATABASE_RANDOM_PAGE_COST == 1.1
