"""Reads compiled once per connection (selectors/compiled.py): the same rows and values as Django's own
evaluation of the queryset, with the SQL compiled at the first use only."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.db.models import Count
from django.db.models.sql.compiler import SQLCompiler
from django.test.utils import CaptureQueriesContext

from genserver.jobs import selectors, services
from genserver.jobs.models import Job, QueueTally
from genserver.jobs.selectors import positions
from genserver.jobs.selectors.compiled import CompiledRead
from tests.conftest import submit

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("empty_broker")]


@pytest.fixture
def compilations(monkeypatch) -> list[str]:
    """The SQL of every select Django compiles from here on."""
    seen: list[str] = []
    original = SQLCompiler.as_sql

    def as_sql(self, *args, **kwargs):
        sql, params = original(self, *args, **kwargs)
        seen.append(sql)
        return sql, params

    monkeypatch.setattr(SQLCompiler, "as_sql", as_sql)
    return seen


def _running_and_waiting(api, settings) -> None:
    settings.FAIR_WINDOW, settings.MAX_JOBS_IN_FLIGHT, settings.SUBMIT_RATE_LIMIT = 0, 0, 0
    ids = [submit(api, prompt=f"compiled {i}", steps=4 + i).json()["id"] for i in range(4)]
    submit(api, prompt="a long one", steps=4, width=1024, height=1024, num_frames=33)
    for job_id in ids[:2]:  # two of them run on a card
        assert services.start_encoding(job_id, "encode@test") is not None
        assert services.finish_encoding(job_id, "encode@test", f"embeddings/{job_id}")
        assert services.claim_chunk(job_id, f"gpu-{job_id}@test", 0) is not None


def test_the_queue_reads_answer_as_django_evaluates_them(api, settings):
    _running_and_waiting(api, settings)
    fields = positions._RUNNING_FIELDS
    expected = list(Job.objects.filter(positions._RUNNING).only(*fields).order_by("pk"))
    running = sorted(positions.running_jobs(), key=lambda job: job.pk)
    assert len(running) == 2
    for job, want in zip(running, expected, strict=True):
        assert {f: getattr(job, f) for f in fields} == {f: getattr(want, f) for f in fields}
        assert job.get_deferred_fields() == want.get_deferred_fields()  # the others load on access, as Django's
        assert job.prompt == want.prompt
    columns = ("queue", "duration_class", "priority", "count", "seconds")
    tally = QueueTally.objects.filter(count__gt=0).values_list(*columns)
    assert sorted(positions._TALLY_ROWS.tuples()) == sorted(tally)
    assert {(g.queue, g.priority, g.count) for g in selectors.waiting_groups()} == {
        (queue or duration_class, priority, count) for queue, duration_class, priority, count, _ in tally
    }


def test_a_compiled_read_compiles_once_per_connection_and_still_reads_each_time(api, settings, compilations):
    _running_and_waiting(api, settings)
    read = CompiledRead(QueueTally, lambda: QueueTally.objects.filter(count__gt=0).values_list("queue", "count"))
    first = read.tuples()
    compilations.clear()
    with CaptureQueriesContext(connection) as queries:
        assert read.tuples() == first
    assert compilations == [] and len(queries) == 1  # executed, not compiled
    submit(api, prompt="one more")
    assert sum(n for _, n in read.tuples()) == sum(n for _, n in first) + 1  # it reads the rows of now

    compiled_elsewhere: list[int] = []

    def in_another_thread() -> None:  # another thread's connection compiles its own
        compilations.clear()
        read.tuples()
        compiled_elsewhere.append(len(compilations))
        connection.close()

    thread = threading.Thread(target=in_another_thread)
    thread.start()
    thread.join(30)
    assert compiled_elsewhere == [1]


def test_instances_need_a_queryset_of_the_models_own_columns(api, settings):
    _running_and_waiting(api, settings)
    read = CompiledRead(Job, lambda: Job.objects.values_list("owner_id").annotate(n=Count("pk")))
    with pytest.raises(TypeError, match="own columns"):
        read.instances()


def test_a_named_value_is_bound_at_each_call_into_the_statement_compiled_once(api, settings, compilations):
    _running_and_waiting(api, settings)
    read = CompiledRead(
        Job,
        lambda status: Job.objects.filter(status=status).order_by().values_list("status").annotate(n=Count("pk")),
        names=("status",),
    )
    expected = dict(Job.objects.order_by().values_list("status").annotate(n=Count("pk")))
    assert len(expected) >= 2  # running and waiting
    compilations.clear()
    for status, n in expected.items():
        assert read.tuples(status=status) == [(status, n)]
    assert read.tuples(status="no such status") == []
    assert len(compilations) == 1
    with pytest.raises(TypeError, match="takes"):
        read.tuples()
    with pytest.raises(TypeError, match="takes"):
        read.tuples(status="queued", model="x")


def test_a_priority_and_a_job_id_are_bound_at_each_call_and_the_rows_answered_as_values_gives_them(
    api, settings, compilations
):
    _running_and_waiting(api, settings)
    fields = ("id", "priority", "queue", "steps")
    read = CompiledRead(
        Job,
        lambda priority, job: (
            Job.objects.filter(priority=priority).exclude(pk=job).order_by("created_at").values(*fields)
        ),
        ints=("priority",),
        ids=("job",),
    )
    jobs = list(Job.objects.order_by("created_at").values(*fields))
    compilations.clear()
    for job in jobs:
        expected = [j for j in jobs if j["priority"] == job["priority"] and j["id"] != job["id"]]
        assert read.dicts(priority=job["priority"], job=job["id"]) == expected
    assert read.dicts(priority=9, job=jobs[0]["id"]) == [j for j in jobs if j["priority"] == 9]
    assert len(compilations) == 1


def test_the_decode_queue_read_answers_as_django_evaluates_it(api, settings):
    from datetime import timedelta

    from django.db.models import F
    from django.utils import timezone

    from genserver.jobs.models import JobStage, JobStatus
    from genserver.jobs.selectors import decode_queue

    _running_and_waiting(api, settings)
    now = timezone.now()
    ids = list(Job.objects.order_by("created_at").values_list("pk", flat=True))[:3]
    for i, (job_id, stage, owner) in enumerate(
        zip(ids, (JobStage.DECODING, JobStage.QUEUED, JobStage.QUEUED), ("decode@test", "", ""), strict=True)
    ):
        published = None if i == 2 else now - timedelta(seconds=10 - i)  # one never published: last
        Job.objects.filter(pk=job_id).update(
            status=JobStatus.DECODING, stage=stage, lease_owner=owner, published_at=published, chunk_started_at=now
        )
    expected = list(
        Job.objects.filter(status=JobStatus.DECODING)
        .order_by(F("published_at").asc(nulls_last=True), "id")
        .values(*decode_queue._FIELDS)
    )
    rows = decode_queue.decoding_rows()
    assert rows == expected and [r["id"] for r in rows] == ids
    assert [decode_queue.in_service(r) for r in rows] == [True, False, False]
    # The line's reads: the one in service and those published from `since` on one row each, the rest per model.
    every = [decode_queue.as_line_row(r) for r in expected]
    assert decode_queue.line(now - timedelta(seconds=11)) == decode_queue.Line(every, [])
    model = expected[1]["model"]
    assert decode_queue.line(now - timedelta(seconds=5)) == decode_queue.Line([every[0], every[2]], [(model, 1)])


def test_a_compiled_read_binds_a_moment_as_its_column_adapts_it(api, settings, compilations):
    from datetime import timedelta

    from django.utils import timezone

    _running_and_waiting(api, settings)
    read = CompiledRead(
        Job,
        lambda since: Job.objects.filter(created_at__gte=since).order_by("created_at").values_list("pk"),
        moments=("since",),
    )
    created = list(Job.objects.order_by("created_at").values_list("pk", "created_at"))
    compilations.clear()
    for i, (_, at) in enumerate(created):
        assert read.tuples(since=at) == [(pk,) for pk, _ in created[i:]]
    assert read.tuples(since=timezone.now() + timedelta(days=1)) == []
    assert len(compilations) == 1


def test_the_decode_line_is_reused_for_cluster_read_seconds(db, django_user_model, monkeypatch):
    """What GENSERVER_CLUSTER_READ_SECONDS trades for the decode line too: within it a process's ETAs reuse one
    read (a decode published meanwhile is not seen yet), for its own `since` or a later one; past it, or for an
    earlier `since` (rows the kept read counted per model or left out), the line is read again."""
    from datetime import timedelta

    from django.utils import timezone

    from genserver.jobs.models import JobStage, JobStatus
    from genserver.jobs.selectors import decode_queue
    from genserver.jobs.selectors.kept import KeptRead
    from tests.support.jobs import make_job

    monkeypatch.setenv("GENSERVER_CLUSTER_READ_SECONDS", "0.5")
    monkeypatch.setattr(decode_queue, "_LINE_READ", KeptRead())  # none kept, and restored after
    owner = django_user_model.objects.create(username="line-reuse")
    now, clock = timezone.now(), [1000.0]

    def publish_decode(seconds_ago: float) -> None:
        make_job(
            owner, status=JobStatus.DECODING, stage=JobStage.QUEUED, published_at=now - timedelta(seconds=seconds_ago)
        )

    def decodes(since_ago: float) -> int:
        read = decode_queue.line(now - timedelta(seconds=since_ago), clock=lambda: clock[0])
        return len(read.rows) + sum(n for _, n in read.settled)

    publish_decode(5)
    assert decodes(10) == 1
    publish_decode(4)
    clock[0] += 0.4
    assert decodes(10) == 1 and decodes(8) == 1  # reused: the second decode not seen yet
    assert decodes(20) == 2  # an earlier `since` than the kept read's: read again
    clock[0] += 0.6
    publish_decode(3)
    assert decodes(20) == 3  # past the window
    monkeypatch.setenv("GENSERVER_CLUSTER_READ_SECONDS", "0")  # the suite's setting: every call reads
    publish_decode(2)
    assert decodes(20) == 4
