"""bench.depth: the table of request costs against queue depth, at tiny sizes (no timing asserted)."""

from __future__ import annotations

import io

import pytest

from bench.depth import PAGE, run
from genserver import deployment
from genserver.jobs.models import ACTIVE, Job

pytestmark = pytest.mark.django_db


@pytest.fixture
def lifted(settings):
    """The limits the command lifts through its environment, lifted in the test's settings."""
    settings.MAX_JOBS_IN_FLIGHT = 0
    settings.SUBMIT_RATE_LIMIT = 0
    settings.ADMIT_SHORT_SECONDS = settings.ADMIT_MEDIUM_SECONDS = settings.ADMIT_LONG_SECONDS = 1e12
    deployment.limits.cache_clear()
    yield
    deployment.limits.cache_clear()


def test_each_size_is_a_row_of_three_requests_with_their_queries_and_the_queue_is_left_empty(lifted):
    Job.objects.all().delete()  # an empty queue to start from (the test's transaction rolls it back)
    out = io.StringIO()
    rows = run([0, 3, 8], samples=2, out=out, rounds=2)
    assert [size for size, _ in rows] == [0, 3, 8]
    for _, figures in rows:
        for name in ("submit", "get", "list"):
            assert figures[name] > 0
            assert figures[f"{name}_queries"] >= 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("# bench.depth on ") and "submit" in lines[1] and "list" in lines[1]
    assert [line.split("|")[0].strip() for line in lines[2:]] == ["0", "3", "8"]
    # Ratios are against the empty queue: its row says 1.00 three times.
    assert lines[2].count("1.00") == 3
    # The bench deletes what it filled: no job of its user remains, active or not.
    assert not Job.objects.filter(owner__username__in=("bench-depth", "bench-depth-others")).exists()
    assert not Job.objects.filter(status__in=ACTIVE).exists()


def test_the_fill_queues_exactly_the_asked_number_of_jobs_with_distinct_submit_times(lifted, redis_conn, settings):
    from bench.depth import Bench
    from genserver.jobs.events import log_key

    Job.objects.all().delete()
    bench = Bench()
    assert Job.objects.filter(owner=bench.user).count() == len(bench.templates) + PAGE  # the history, all ended
    assert not Job.objects.filter(status__in=ACTIVE).exists()
    bench.fill_to(7)
    queued = list(Job.objects.filter(status__in=ACTIVE).values_list("created_at", flat=True))
    assert len(queued) == 7 and len(set(queued)) == 7
    logs = [log_key(pk) for pk in Job.objects.filter(status__in=ACTIVE).values_list("pk", flat=True)]
    assert redis_conn.exists(*logs) == 7  # as their submits would have left them: one event log each
    assert all(0 < redis_conn.ttl(key) <= settings.EVENTS_TTL_SECONDS for key in logs)
    bench.fill_to(7)  # already filled: nothing added
    assert Job.objects.filter(status__in=ACTIVE).count() == 7
    assert set(Job.objects.filter(status__in=ACTIVE).values_list("owner", flat=True)) == {bench.others.pk}
    bench.clear()
    assert not Job.objects.filter(owner__in=(bench.user, bench.others)).exists()
    assert redis_conn.exists(*logs) == 0


def test_without_redis_url_the_command_gets_a_broker_of_its_own(monkeypatch):
    """`python -m bench.depth` with REDIS_URL unset (docs/BENCHMARKS.md): its submits reach a broker
    instead of timing out on a refused connection."""
    import os

    import redis

    from bench import depth

    monkeypatch.delenv("REDIS_URL")
    monkeypatch.setattr("django.setup", lambda: None)  # this process is set up already
    monkeypatch.setattr("django.core.management.call_command", lambda *args, **kwargs: None)
    for name in depth.LIFTED:
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    depth._setup()
    assert redis.Redis.from_url(os.environ["REDIS_URL"]).ping()
