"""The queue picture from aggregates (selectors) gives the full scan's answers under random transitions.

The reference below is the scan the selectors did before issue 16 item 8: every active job loaded and
turned into a WorkItem, per request and per listed job. The jobs move through the job service's own
transitions (submit, encode, chunks with and without keeping the card, progress, decode, cancel,
failed attempts, reprioritising), in an order hypothesis draws; after each move every answer the API
gives from the queue (positions, ETAs, admission's expected wait, the overview's counts and sums) must
be the reference's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from datetime import datetime, timedelta
from unittest import mock

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from genserver import deployment
from genserver.jobs import selectors, services
from genserver.jobs.models import ACTIVE, Job, JobStatus
from genserver.jobs.services import transitions
from genserver.jobs.services.priority import priority_bounds
from genserver.scheduling.admission import WorkItem, expected_start, expected_wait
from genserver.scheduling.pools import PoolLayout
from tests.conftest import submit

pytestmark = pytest.mark.django_db

MODELS = ("sdxl-sim", "flux-sim", "sdxl-turbo-sim", "wan-sim")
WORKERS = ("gpu0@depth", "gpu1@depth")


# --- The reference: the full scan -------------------------------------------------------
def _running(job: Job) -> bool:
    return bool(job.lease_owner) and job.status == JobStatus.DENOISING


def _item(job: Job, now: datetime) -> WorkItem:
    step_seconds = job.estimated_seconds / job.total_steps
    chunk_left = max(0, job.chunk_steps - max(0, job.steps_done - job.checkpoint_step)) * step_seconds
    if job.chunk_started_at is not None:  # the chunk less the work time since it began; past it, the next chunk
        step_seconds = job.measured_step_seconds / job.clock_scale if job.measured_step_seconds else step_seconds
        elapsed = (now - job.chunk_started_at).total_seconds() / job.clock_scale
        steps_left = job.total_steps - job.checkpoint_step
        this_chunk = min(job.chunk_steps, steps_left)
        if elapsed < this_chunk * step_seconds:
            chunk_left = this_chunk * step_seconds - elapsed
        else:
            chunk_left = min(job.chunk_steps, steps_left - this_chunk) * step_seconds
    return WorkItem(
        queue=job.queue or job.duration_class,
        priority=job.priority,
        remaining_seconds=job.remaining_seconds * job.clock_scale,
        running=_running(job),
        chunk_remaining_seconds=chunk_left * job.clock_scale,
    )


def _ahead(jobs: Iterable[Job], job: Job) -> list[Job]:
    key = (job.priority, job.published_at or job.created_at)
    return [o for o in jobs if o.pk != job.pk and (_running(o) or (o.priority, o.published_at or o.created_at) <= key)]


def scan_position(jobs: list[Job], job: Job, layout: PoolLayout) -> int | None:
    if job.is_terminal:
        return None
    if _running(job) or job.status == JobStatus.DECODING:
        return 0
    mine = {w.name for w in layout.workers if (job.queue or job.duration_class) in w.consumed_queues()}
    return sum(
        1
        for o in _ahead(jobs, job)
        if not _running(o)
        and any((o.queue or o.duration_class) in w.consumed_queues() for w in layout.workers if w.name in mine)
    )


def scan_eta(jobs: list[Job], job: Job, layout: PoolLayout, now: datetime) -> float | None:
    if job.is_terminal:
        return None
    own = job.remaining_seconds * job.clock_scale / layout.job_speedup(job.queue or job.duration_class)
    if _running(job) or job.status == JobStatus.DECODING:
        return round(own, 3)
    items = [_item(o, now) for o in _ahead(jobs, job)]
    wait = expected_start(job.queue or job.duration_class, job.priority, items, layout)
    return None if math.isinf(wait) else round(wait + own, 3)


# --- The moves ----------------------------------------------------------------------------
def _submit(owner, rng: random.Random, model: str = "") -> None:
    data = {
        "model": model or rng.choice(MODELS),
        "prompt": "depth",
        "steps": rng.choice((2, 3, 4, 8)),  # within every model's limits (sdxl-turbo-sim: 8)
        "seed": rng.randrange(1000),
    }
    from genserver.jobs.api.serializers import JobCreateSerializer

    serializer = JobCreateSerializer(data=data)
    serializer.is_valid(raise_exception=True)
    job = services.submit_job(owner, serializer.validated_data)
    if rng.random() < 0.3:  # a tie: two jobs whose next tasks were published at the same moment
        others = list(Job.objects.exclude(pk=job.pk).order_by("created_at"))
        if others:
            other = rng.choice(others)
            Job.objects.filter(pk=job.pk).update(published_at=other.published_at or other.created_at)


def _move(job: Job, rng: random.Random) -> None:
    worker = rng.choice(WORKERS)
    held = job.lease_owner or worker
    if rng.random() < 0.05:
        services.cancel_job(job)
    elif rng.random() < 0.05:
        services.reprioritise(job, rng.randint(*priority_bounds(job)))  # staff move it within its class
    elif rng.random() < 0.05 and job.lease_owner:
        services.fail_attempt(job.pk, job.lease_owner, "RuntimeError: a drawn failure")
    elif job.status == JobStatus.QUEUED:
        services.start_encoding(job.pk, worker)
    elif job.status == JobStatus.ENCODING:
        services.finish_encoding(job.pk, held, f"embeddings/{job.pk}")
    elif job.status == JobStatus.DENOISING and not job.lease_owner:
        services.claim_chunk(job.pk, worker, job.checkpoint_step)
    elif job.status == JobStatus.DENOISING and rng.random() < 0.5:
        end = min(job.total_steps, job.checkpoint_step + job.chunk_steps)
        services.heartbeat(job.pk, held, rng.randint(job.checkpoint_step, end))
    elif job.status == JobStatus.DENOISING:
        end = min(job.total_steps, job.checkpoint_step + job.chunk_steps)
        services.finish_chunk(job.pk, held, end, f"checkpoints/{job.pk}/{end}", None, keep_lease=rng.random() < 0.5)
    elif job.status == JobStatus.DECODING and not job.lease_owner:
        services.start_decoding(job.pk, worker)
    elif job.status == JobStatus.DECODING:
        services.finish_decoding(job.pk, held, [])


def _assert_same_answers(layout: PoolLayout) -> None:
    # One moment for every answer and the reference: a running chunk's rest is counted from when it began.
    now = timezone.now()
    with mock.patch("django.utils.timezone.now", return_value=now):
        _assert_same_answers_at(layout, now)


def _assert_same_answers_at(layout: PoolLayout, now: datetime) -> None:
    jobs = list(Job.objects.all())
    active = [j for j in jobs if j.status in ACTIVE]
    one_by_one = selectors.QueueSnapshot(selectors.waiting_groups(), selectors.running_jobs(), layout, taken_at=now)
    page = selectors.QueueSnapshot(selectors.waiting_groups(), selectors.running_jobs(), layout, taken_at=now)
    page.prepare(jobs)  # as the list view does: every job's neighbours in one query
    for snapshot in (one_by_one, page):
        for job in jobs:
            assert snapshot.queue_position(job) == scan_position(active, job, layout), job
            fast, scan = snapshot.eta_seconds(job), scan_eta(active, job, layout, now)
            assert (fast is None) == (scan is None), job
            if scan is not None:
                assert fast == pytest.approx(scan, rel=1e-9, abs=2e-3), job  # both rounded to the millisecond
    backlog, items = selectors.backlog_items(), [_item(j, now) for j in active]
    assert sum(1 for i in backlog if i.running) == sum(1 for i in items if i.running)
    for queue in layout.all_queues():
        for priority in range(10):
            fast_wait = expected_wait(queue, priority, backlog, layout)
            scan_wait = expected_wait(queue, priority, items, layout)
            assert fast_wait == pytest.approx(scan_wait, rel=1e-9, abs=1e-9), (queue, priority)
    overview = {entry["name"]: entry for entry in selectors.queue_overview()}
    for cls, entry in overview.items():
        mine = [j for j in active if j.duration_class == cls]
        assert entry["depth"] == sum(1 for j in mine if not _running(j))
        assert entry["running"] == sum(1 for j in mine if _running(j))
        assert entry["backlog_seconds"] == pytest.approx(
            round(sum(j.remaining_seconds * j.clock_scale for j in mine), 3), abs=2e-3
        )


@hsettings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(min_value=0, max_value=2**32),
    submits=st.integers(min_value=4, max_value=16),
    near_end=st.sampled_from([1, 3, selectors.NEAR_END]),  # count from the front, from the back, or either
)
def test_positions_etas_and_backlog_equal_the_full_scan_under_random_transitions(
    django_user_model, settings, monkeypatch, seed, submits, near_end
):
    rng = random.Random(seed)  # every later choice from the seed: a failure replays
    monkeypatch.setattr(selectors.positions, "NEAR_END", near_end)
    # The scan counts the queue and the denoising, not the stage seconds the service learns from finished
    # stages (tests/jobs/test_stage_seconds.py): none is learned here. Without this, a decode finished in one
    # example taught its model a tail (up to seconds, after a tie moved its `published_at` back) that every
    # later example's ETAs then counted and the scan did not.
    monkeypatch.setattr(transitions, "learn_stage_seconds", lambda *args: None)  # (the fixture emptied them)
    settings.MAX_JOBS_IN_FLIGHT = 0
    # One owner's 16 submits would be a burst the fair window holds, and the positions of held jobs (and of
    # jobs behind them) are the round-robin's, not this first-come scan's: tests/jobs/test_fairness.py.
    settings.FAIR_WINDOW = 0
    with transaction.atomic():  # each example starts from an empty queue and leaves nothing behind
        Job.objects.all().delete()
        owner, _ = django_user_model.objects.get_or_create(username="depth")
        layout = deployment.layout()
        for _ in range(submits):
            _submit(owner, rng)
        _assert_same_answers(layout)
        for _ in range(submits * 3):
            job = rng.choice(list(Job.objects.filter(status__in=ACTIVE).order_by("created_at")) or [None])
            if job is None:
                break
            if rng.random() < 0.2:
                _submit(owner, rng)
            else:
                _move(job, rng)
            _assert_same_answers(layout)
        transaction.set_rollback(True)


def test_a_job_waits_behind_its_priority_and_ahead_of_later_ties(api):
    """A hand-made case the random one may miss: equal publish times count as ahead (`<=`), both ways."""
    Job.objects.all().delete()  # an empty queue (the test's transaction rolls it back)
    ids = [submit(api, prompt=f"p{i}").json()["id"] for i in range(3)]
    first = Job.objects.get(pk=ids[0])
    later = first.published_at + timedelta(seconds=1)
    Job.objects.filter(pk__in=ids[1:]).update(published_at=later)
    positions = [api.get(f"/api/v1/jobs/{pk}/").json()["queue_position"] for pk in ids]
    layout = selectors.live_capacity()
    active = list(Job.objects.filter(status__in=ACTIVE))
    assert positions == [scan_position(active, j, layout) for j in (Job.objects.get(pk=pk) for pk in ids)]
    assert positions == [0, 2, 2]


@pytest.mark.parametrize("seed", [7, 11, 23])
def test_a_submits_answer_counts_the_new_job_as_a_fresh_read_does(django_user_model, settings, seed):
    """submit's answer (QueueSnapshot.with_new_job on admission's and the fair window's reads) gives the new job
    the position and ETA a fresh read of the queue gives it, without a read of its own: published and held jobs
    (the fair window), two users, two classes."""
    from genserver.jobs.api.serializers import JobCreateSerializer

    settings.FAIR_WINDOW = 1  # alice's burst: one published, the rest held; bob goes ahead
    settings.MAX_JOBS_IN_FLIGHT, settings.SUBMIT_RATE_LIMIT = 0, 0
    alice, bob = (django_user_model.objects.create_user(name) for name in ("alice", "bob"))
    rng = random.Random(seed)
    for i in range(12):
        owner = bob if i % 4 == 3 else alice
        data = {"model": rng.choice(MODELS), "prompt": f"answer {i}", "steps": rng.choice((2, 4, 8)), "seed": i}
        serializer = JobCreateSerializer(data=data)
        serializer.is_valid(raise_exception=True)
        job, answer = services.submit(owner, serializer.validated_data)
        with CaptureQueriesContext(connection) as answering:  # the fair window's reads at submit are reused
            position, eta = answer.queue_position(job), answer.eta_seconds(job)
        assert [q["sql"] for q in answering.captured_queries] == [], (i, job.held)
        fresh = selectors.QueueSnapshot.load()
        assert position == fresh.queue_position(job), (i, job.held)
        assert eta == pytest.approx(fresh.eta_seconds(job), abs=2e-3), (i, job.held)
    assert Job.objects.filter(held=True).exists() and Job.objects.filter(held=False).exists()


# --- The fair window's held jobs (migration 0015's tally) -------------------------------
def _held_by_rows() -> dict[tuple, tuple[int, float]]:
    """The held tally as a scan of the rows would give it: every active held job per (queue, class, priority, owner)."""
    sums: dict[tuple, tuple[int, float]] = {}
    for job in Job.objects.filter(held=True, status__in=ACTIVE):
        key = (job.queue, job.duration_class, job.priority, job.owner_id)
        count, seconds = sums.get(key, (0, 0.0))
        sums[key] = (count + 1, seconds + job.remaining_seconds * job.clock_scale)
    return sums


def _answers(layout: PoolLayout, jobs: list[Job], now: datetime, page: bool = False) -> list[tuple]:
    snapshot = selectors.QueueSnapshot(selectors.waiting_groups(), selectors.running_jobs(), layout, taken_at=now)
    if page:  # as the list view does: the neighbours of all of them read together
        snapshot.prepare(jobs)
    return [(job.pk, snapshot.queue_position(job), snapshot.eta_seconds(job)) for job in jobs]


@hsettings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(min_value=0, max_value=2**32), submits=st.integers(min_value=6, max_value=10))
def test_the_held_tally_and_the_positions_read_from_it_agree_with_the_rows_under_random_transitions(
    django_user_model, settings, monkeypatch, seed, submits
):
    """Three users' bursts under the fair window (1): held, released as their jobs start or end, cancelled,
    reprioritised. After every move the held tally is the rows' grouped sums, and every position and ETA is
    the same whether the held jobs around a job are read from the newest end (NEAR_END as set), from the oldest
    (3), or summed in the database (1: any job with one held after it and one before), for each job alone
    and for all of them read as one page."""
    rng = random.Random(seed)
    default = selectors.positions.NEAR_END
    monkeypatch.setattr(transitions, "learn_stage_seconds", lambda *args: None)
    settings.MAX_JOBS_IN_FLIGHT, settings.SUBMIT_RATE_LIMIT, settings.FAIR_WINDOW = 0, 0, 1
    with transaction.atomic():
        Job.objects.all().delete()
        owners = [django_user_model.objects.get_or_create(username=f"held{i}")[0] for i in range(3)]
        layout = deployment.layout()
        for _ in range(3):  # a burst in one queue: its first job fills the owner's window, the next two are held
            _submit(owners[0], rng, MODELS[0])
        most_held = sum(count for count, _ in _held_by_rows().values())
        for step in range(submits * 4):
            active = list(Job.objects.filter(status__in=ACTIVE).order_by("created_at"))
            if step < submits or not active or rng.random() < 0.2:
                _submit(rng.choice(owners), rng)
                if rng.random() < 0.2 and active:  # a tie in submit time with an earlier job
                    newest = Job.objects.order_by("-created_at").first()
                    Job.objects.filter(pk=newest.pk).update(created_at=rng.choice(active).created_at)
            else:
                _move(rng.choice(active), rng)
            tally = {
                (t.queue, t.duration_class, t.priority, t.owner_id): (t.count, t.seconds) for t in selectors.held_rows()
            }
            rows = _held_by_rows()
            most_held = max(most_held, sum(count for count, _ in rows.values()))
            assert tally.keys() == rows.keys(), step
            for key, (count, seconds) in rows.items():
                assert tally[key][0] == count and tally[key][1] == pytest.approx(seconds, abs=1e-6), (step, key)
            jobs, now = list(Job.objects.all()), timezone.now()  # one moment for all five readings
            near = _answers(layout, jobs, now)
            # 3: some from the oldest end; 1: summed in the database; each job alone, and all as one page
            for near_end, page in ((default, True), (3, True), (1, False), (1, True)):
                monkeypatch.setattr(selectors.positions, "NEAR_END", near_end)
                other = _answers(layout, jobs, now, page)
                monkeypatch.setattr(selectors.positions, "NEAR_END", default)
                for a, b in zip(near, other, strict=True):
                    assert a[:2] == b[:2], (step, near_end, page, a, b)
                    assert (a[2] is None) == (b[2] is None), (step, near_end, page, a, b)
                    assert a[2] is None or a[2] == pytest.approx(b[2], abs=2e-3), (step, near_end, page, a, b)
        assert most_held >= 2  # the burst was held (its first job fills the window), whatever the random moves did
        transaction.set_rollback(True)


def test_a_held_job_published_after_a_middle_jobs_key_counts_as_submitted_before_it(
    django_user_model, settings, monkeypatch
):
    """The middle sums (`_middle_sums`: a job with NEAR_END or more on both sides) take the other users' held
    jobs by submit time, in a read of their own for the held jobs whose wait key comes after the job's: a
    held job published later than the middle job but submitted before it counts for it as the reads from
    the ends count it."""
    from genserver.jobs.api.serializers import JobCreateSerializer

    settings.FAIR_WINDOW = 1  # alice's burst: her first job published, the next two held
    settings.MAX_JOBS_IN_FLIGHT, settings.SUBMIT_RATE_LIMIT = 0, 0
    alice, bob, carol = (django_user_model.objects.create_user(name) for name in ("alice", "bob", "carol"))
    jobs = {}
    for name, owner in (("a1", alice), ("a2", alice), ("a3", alice), ("b1", bob), ("c1", carol)):
        serializer = JobCreateSerializer(data={"model": MODELS[0], "prompt": name, "steps": 4, "seed": 1})
        serializer.is_valid(raise_exception=True)
        jobs[name] = services.submit_job(owner, serializer.validated_data)
    assert [jobs[n].held for n in ("a1", "a2", "a3", "b1", "c1")] == [False, True, True, False, False]
    # a2, submitted before b1, waits after every other job: its next task published last.
    Job.objects.filter(pk=jobs["a2"].pk).update(published_at=timezone.now() + timedelta(seconds=1))
    layout, now = deployment.layout(), timezone.now()
    middle = [Job.objects.get(pk=jobs["b1"].pk)]  # a1 and a3 before it, a2 and c1 after
    from_the_ends = _answers(layout, middle, now, page=True)
    monkeypatch.setattr(selectors.positions, "NEAR_END", 1)  # one row from each end: b1 is in the middle
    with CaptureQueriesContext(connection) as reads:
        summed = _answers(layout, middle, now, page=True)
    assert any("CASE WHEN" in q["sql"] for q in reads.captured_queries)  # it was summed
    assert summed == from_the_ends
