"""The queue picture at any depth: waiting sums per (queue, class, priority), running jobs, and each
job's position, ETA and quote (QueueSnapshot).

Over 800 lines: the tally reads, the neighbour counts, the middle sums, their held-job counterparts and
QueueSnapshot are one algorithm (a position at any depth in a few queries per priority, NEAR_END the knob they
share), with the headwind its ETAs share with admission.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_right
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connections, router
from django.db.models import (
    BooleanField,
    Case,
    Count,
    ExpressionWrapper,
    F,
    FloatField,
    IntegerField,
    Max,
    Q,
    QuerySet,
    Sum,
    Value,
    When,
)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from genserver.jobs.models import ACTIVE, HeldTally, Job, JobStatus, QueueTally
from genserver.redis_client import (
    BOUNDARY,
    DECODE,
    HOP,
    LEAD_IN,
    STEP,
    TAIL,
)
from genserver.scheduling.admission import CALM, HIGHER_CLASSES, Headwind, WorkItem, expected_start, headwind
from genserver.scheduling.fairness import held_jobs_ahead
from genserver.scheduling.pools import DECODE as DECODE_QUEUE, PoolLayout

from .capacity import cluster_reads, stage_seconds
from .compiled import CompiledRead, sql_words
from .decode_queue import DecodeQueue, as_line_row, decoding_rows, in_service, line


def _is_running(job: Job) -> bool:
    return bool(job.lease_owner) and job.status in (JobStatus.DENOISING,)


def _chunk_remaining(job: Job, now: datetime, step_overhead: float = 0.0) -> float:
    """Seconds of work before the card running the job reaches a boundary where it may take other work.

    Counted from when the chunk began (`chunk_started_at`), at the step time its last chunk measured (else the
    estimate): a video's chunk is often one step, which no heartbeat splits, so counted whole until its steps
    were reported, four cards mid-step all looked a step away (bench.replay: an image's estimated wait 2.7× the
    actual). A chunk past its length is at its boundary, where the card's yield test has as good as run: unless
    it was the job's last, the card kept the job for its next chunk (the boundary's record, which moves
    `chunk_started_at`, lags the test by its write), and only then frees. Without a start: its steps not yet
    reported. `step_overhead`: the wall seconds a step takes beyond its estimate (the model's learned STEP), counted
    until the card measured the job's steps. With a checkpoint interval (GENSERVER_CHECKPOINT_EVERY) a kept boundary
    moves `chunk_started_at` but not `checkpoint_step`, so only the clamp to the job's last steps is loose."""
    step_seconds = job.estimated_seconds / job.total_steps if job.steps else 0.0
    if step_seconds and job.clock_scale > 0:
        step_seconds += step_overhead / job.clock_scale
    if job.chunk_started_at is None or job.clock_scale <= 0:
        done_in_chunk = max(0, job.steps_done - job.checkpoint_step)
        return max(0, job.chunk_steps - done_in_chunk) * step_seconds
    if job.measured_step_seconds:
        step_seconds = job.measured_step_seconds / job.clock_scale  # wall → seconds of work
    elapsed = (now - job.chunk_started_at).total_seconds() / job.clock_scale
    this_chunk = min(job.chunk_steps, max(0, job.total_steps - job.checkpoint_step))
    if elapsed < this_chunk * step_seconds:
        return this_chunk * step_seconds - elapsed
    next_chunk = min(job.chunk_steps, max(0, job.total_steps - job.checkpoint_step - this_chunk))
    return next_chunk * step_seconds


def _work_item(job: Job, wall: bool, now: datetime | None = None, step_overhead: float = 0.0) -> WorkItem:
    """The job as the queue picture counts it; `step_overhead` as in `_chunk_remaining`, for every step left."""
    scale = job.clock_scale if wall else 1.0
    remaining = job.remaining_seconds
    if job.clock_scale > 0:
        remaining += max(0, job.total_steps - job.steps_done) * step_overhead / job.clock_scale
    return WorkItem(
        queue=job.queue or job.duration_class,
        priority=job.priority,
        remaining_seconds=remaining * scale,
        running=_is_running(job),
        chunk_remaining_seconds=_chunk_remaining(job, now or timezone.now(), step_overhead) * scale,
    )


# --- The queue picture at any depth --------------------------------------------------
# A running job holds a card (lease_owner set while denoising): there are at most as many as the cards
# (and their merged batches), so they are loaded one by one. Every other active job waits, and waiting
# jobs are only ever counted and summed: per (queue, class, priority) in QueueTally, which triggers on
# the job table keep in the same transaction as every write (migration 0013), and per job, for the part
# of its own priority that waits around it, in the database over the partial index of waiting jobs
# (migration 0012). A request reads a few tally rows, not the rows of the whole queue.
_RUNNING = Q(status=JobStatus.DENOISING) & ~Q(lease_owner="")
# Wall seconds of work left (Job.remaining_seconds × clock_scale), as the database computes it.
_WALL_REMAINING = ExpressionWrapper(
    F("estimated_seconds")
    * Greatest(Value(0), F("steps") * F("segment_count") - F("steps_done"))
    / (F("steps") * F("segment_count"))
    * F("clock_scale"),
    output_field=FloatField(),
)
# The order a job waits in at its priority: when its next task was published (else submitted).
_WAIT_KEY = Coalesce(F("published_at"), F("created_at"))
# A job's place among its priority's waiting jobs is counted from the nearer end when fewer than this
# many wait on that side (QueueSnapshot.prepare), else summed in the database.
NEAR_END = 100

_RUNNING_FIELDS = (
    "id",
    "model",
    "status",
    "duration_class",
    "queue",
    "priority",
    "estimated_seconds",
    "clock_scale",
    "steps",
    "steps_done",
    "checkpoint_step",
    "chunk_steps",
    "chunk_started_at",
    "lease_owner",
    "segment_count",
)


def _key(job: Job) -> Any:
    """Where a waiting job stands at its priority: when its next task was published (else submitted)."""
    return job.published_at or job.created_at


@dataclass(frozen=True)
class WaitingGroup:
    """The waiting jobs of one queue, class and priority: how many, and their wall seconds of work."""

    queue: str  # the broker queue (the class for a row recorded without one)
    duration_class: str
    priority: int
    count: int
    seconds: float

    def item(self) -> WorkItem:
        return WorkItem(queue=self.queue, priority=self.priority, remaining_seconds=self.seconds, count=self.count)


def _group_key(g: WaitingGroup) -> tuple[str, str, int]:
    return g.queue, g.duration_class, g.priority


_TALLY_ROWS = CompiledRead(
    QueueTally,
    lambda: QueueTally.objects.filter(count__gt=0).values_list(
        "queue", "duration_class", "priority", "count", "seconds"
    ),
)


def waiting_groups() -> list[WaitingGroup]:
    """Every waiting job, counted and summed per (queue, class, priority): the tally's few rows."""
    return [
        WaitingGroup(queue or duration_class, duration_class, priority, count, float(seconds or 0.0))
        for queue, duration_class, priority, count, seconds in _TALLY_ROWS.tuples()
    ]


@dataclass(frozen=True)
class HeldRow:
    """One row of the held tally: the jobs the fair window holds for one user in one (queue, class, priority)."""

    queue: str  # as recorded (blank for a row recorded without one)
    duration_class: str
    priority: int
    owner_id: Any
    count: int
    seconds: float


def held_rows() -> list[HeldRow]:
    """Every held job, counted and summed per (queue, class, priority, owner): the held tally's few rows."""
    return [HeldRow(*r) for r in _HELD_ROWS.tuples()]


_HELD_ROWS = CompiledRead(
    HeldTally,
    lambda: HeldTally.objects.filter(count__gt=0).values_list(
        "queue", "duration_class", "priority", "owner_id", "count", "seconds"
    ),
)


def _held_sums(rows: Iterable[HeldRow]) -> dict[tuple[str, str, int], WaitingGroup]:
    """Held tally rows summed over their owners, per (queue, class, priority)."""
    sums: dict[tuple[str, str, int], WaitingGroup] = {}
    for r in rows:
        k = (r.queue or r.duration_class, r.duration_class, r.priority)
        g = sums.get(k)
        sums[k] = (
            replace(g, count=g.count + r.count, seconds=g.seconds + r.seconds)
            if g
            else WaitingGroup(*k, r.count, r.seconds)
        )
    return sums


# The published, unstarted jobs read to weigh the users of a queue (the fair window keeps them few: at most
# the window per heavy user, and the light users' backlog); beyond it the counts are partial.
PUBLISHED_READ = 2000


@dataclass(frozen=True)
class FairPicture:
    """What the fair window reads of a queue: every held tally row (of every queue) and, per user, their
    published, not yet started jobs in this queue (`complete` unless the read stopped at PUBLISHED_READ rows).
    A submit places its new job with it and its answer reuses it (QueueSnapshot.with_new_job)."""

    queue: str
    held: list[HeldRow]
    published: dict[Any, int]
    complete: bool

    def unstarted(self) -> dict[Any, int]:
        """Per user with unstarted jobs in the queue, how many: published and not started, and held."""
        counts = dict(self.published)
        for r in self.held:
            if r.queue == self.queue:
                counts[r.owner_id] = counts.get(r.owner_id, 0) + r.count
        return counts


def _in_window(alias: str) -> str:
    """The published, unstarted jobs (a user's fair window), word for word job_fair_window's condition: its
    constants in the text, so that a prepared statement's generic plan matches it (PostgreSQL), and its terms
    as the index's, the only form SQLite recognises."""
    quote, column = connections[alias].ops.quote_name, _column_names()
    return (
        f"{quote(column['chunks_run'])} = 0 AND NOT {quote(column['held'])} "
        f"AND {quote(column['status'])} IN ({sql_words(ACTIVE)})"
    )


@functools.cache
def _published_by_owner_sql(alias: str) -> str:
    """Each user's count of their published, unstarted jobs in a queue (bound: the queue's name, then the read
    bound), over the first rows of the partial index job_fair_window: rows ('published', owner, count).

    SQL rather than the ORM's `pk__in` subquery, which PostgreSQL joined back to the table by key and planned
    again at every submit (0.47 ms, against 0.06 ms for this)."""
    quote, column = connections[alias].ops.quote_name, _column_names()
    owner = quote(column["owner"])
    return (
        f"SELECT 'published', NULL, NULL, NULL, {owner}, COUNT(*), NULL FROM (SELECT {owner} "
        f"FROM {quote(Job._meta.db_table)} WHERE {quote(column['queue'])} = %s AND {_in_window(alias)} "
        f"LIMIT %s) AS window_rows GROUP BY {owner}"
    )


@functools.cache
def _window_count_sql(alias: str) -> str:
    quote, column = connections[alias].ops.quote_name, _column_names()
    return (
        f"SELECT COUNT(*) FROM {quote(Job._meta.db_table)} "
        f"WHERE {quote(column['queue'])} = %s AND {quote(column['owner'])} = %s AND {_in_window(alias)}"
    )


def published_unstarted(owner_id: Any, queue: str) -> int:
    """How many of the user's jobs in the queue are published and not started yet (their fair window's), over
    job_fair_window: as many rows as that, whatever the queue or the user's history holds."""
    alias = router.db_for_read(Job)
    with connections[alias].cursor() as cursor:
        cursor.execute(_window_count_sql(alias), [queue, owner_id])
        return int(cursor.fetchone()[0])


@functools.cache
def _fair_picture_sql(alias: str) -> str:
    """The held tally's rows ('held', queue, class, priority, owner, count, seconds) and then the published
    counts of `_published_by_owner_sql`, in one statement: a submit reads them with its owner's row locked, where
    each round trip holds up that user's next submit."""
    quote = connections[alias].ops.quote_name
    column = {name: quote(HeldTally._meta.get_field(name).column) for name in HeldRow.__dataclass_fields__}
    return (
        f"SELECT 'held', {', '.join(column.values())} FROM {quote(HeldTally._meta.db_table)} "
        f"WHERE {column['count']} > 0 "
        f"UNION ALL {_published_by_owner_sql(alias)}"
    )


@functools.cache
def _waiting_in_text(alias: str) -> RawSQL:
    """The waiting jobs (active, on no card: job_waiting_order's condition), with the constants written into
    the statement's text, not bound: a prepared statement's generic plan can then match the index's condition,
    which bound constants hide from it. A page's middle sums (`_middle_sums`), prepared after a few runs, took
    a generic plan that scanned the whole job table (2.2 ms at 10,000 queued, against 0.3 ms over the index)."""
    quote = connections[alias].ops.quote_name
    table = quote(Job._meta.db_table)
    status, lease_owner = (f"{table}.{quote(Job._meta.get_field(n).column)}" for n in ("status", "lease_owner"))
    # Word for word the index's condition as its migration wrote it: SQLite uses a partial index only for a
    # query whose condition repeats the index's terms (PostgreSQL proves any equivalent form).
    return RawSQL(
        f"{status} IN ({sql_words(ACTIVE)}) AND NOT ({status} = '{JobStatus.DENOISING}' AND NOT ({lease_owner} = ''))",
        (),
        output_field=BooleanField(),
    )


@functools.cache
def _held_in_text(alias: str) -> RawSQL:
    """The active held jobs (job_held_order's condition), their constants in the text as `_waiting_in_text`'s."""
    quote = connections[alias].ops.quote_name
    table = quote(Job._meta.db_table)
    status, held = (f"{table}.{quote(Job._meta.get_field(n).column)}" for n in ("status", "held"))
    return RawSQL(f"{held} AND {status} IN ({sql_words(ACTIVE)})", (), output_field=BooleanField())


def _column_names() -> dict[str, str]:
    return {name: Job._meta.get_field(name).column for name in ("owner", "queue", "status", "held", "chunks_run")}


def fair_picture(queue: str, held: list[HeldRow] | None = None) -> FairPicture:
    """The queue's FairPicture: the published, unstarted jobs' owners over the partial index job_fair_window
    (at most PUBLISHED_READ rows), and the held tally's rows (`held` when the caller read them already; else
    read in the same statement)."""
    # Counted in the database, over at most PUBLISHED_READ rows: one row per user comes back, not one per job
    # (a heavy user's thousands of queued jobs cost a submit of theirs milliseconds in Python).
    alias = router.db_for_read(Job)
    sql = _published_by_owner_sql(alias) if held is not None else _fair_picture_sql(alias)
    with connections[alias].cursor() as cursor:
        cursor.execute(sql, [queue, PUBLISHED_READ])
        rows = cursor.fetchall()
    published = {row[4]: row[5] for row in rows if row[0] == "published"}
    if held is None:
        held = [HeldRow(*row[1:5], int(row[5]), float(row[6])) for row in rows if row[0] == "held"]
    complete = sum(published.values()) < PUBLISHED_READ
    return FairPicture(queue, held, published, complete)


def unstarted_by_owner(queue: str, held: list[HeldRow] | None = None) -> dict[Any, int]:
    """Per user with unstarted jobs in the queue, how many: published and not started (over the partial
    index job_fair_window, at most PUBLISHED_READ rows read) and held (the held tally's rows; `held` when the
    caller read them already)."""
    return fair_picture(queue, held).unstarted()


@dataclass
class _MiddleSums:
    """What `_middle_sums` answers per job: the waiting jobs at or before its key (itself excluded), and the
    other users' held jobs submitted at or before it, per (queue, class, priority)."""

    waiting: dict[Any, list[WaitingGroup]]
    held: dict[Any, dict[tuple[str, str, int], WaitingGroup]]


def _middle_read(count: int, held: bool) -> CompiledRead:
    """`_middle_sums`'s statement for `count` jobs, compiled once per connection: its part of the waiting rows
    up to the last job's key, or (`held`) its part of the held rows submitted up to it that wait after it."""
    read = _MIDDLE_READS.get((count, held))
    if read is None:
        build = functools.partial(_middle_queryset, count, held)
        ids, moments = tuple(f"job{i}" for i in range(count)), tuple(f"key{i}" for i in range(count))
        read = _MIDDLE_READS.setdefault(
            (count, held), CompiledRead(Job, build, ints=("priority",), ids=ids, moments=moments)
        )
    return read


_MIDDLE_READS: dict[tuple[int, bool], CompiledRead] = {}


def _middle_queryset(count: int, held: bool, priority: int, **values: Any) -> QuerySet:
    pks, keys = [values[f"job{i}"] for i in range(count)], [values[f"key{i}"] for i in range(count)]
    span = Case(
        *(When(pk=pk, then=Value(-1 - i)) for i, pk in enumerate(pks)),
        *(When(wait_key__lte=key, then=Value(i)) for i, key in enumerate(keys)),
        default=None,
        output_field=IntegerField(),
    )
    held_span = Case(
        *(When(held=True, created_at__lte=key, then=Value(i)) for i, key in enumerate(keys)),
        default=None,
        output_field=IntegerField(),
    )
    alias = router.db_for_read(Job)
    rows = Job.objects.filter(_waiting_in_text(alias), priority=priority).annotate(wait_key=_WAIT_KEY)
    if held:  # job_held_order's condition word for word, as for the held reads from the ends
        rows = rows.filter(_held_in_text(alias), created_at__lte=keys[-1], wait_key__gt=keys[-1])
    else:
        rows = rows.filter(wait_key__lte=keys[-1])
    return (
        rows.annotate(span=span, held_span=held_span, holder=Case(When(held=True, then=F("owner_id")), default=None))
        .order_by()
        .values("span", "held_span", "queue", "duration_class", "holder")
        .annotate(n=Count("id"), seconds=Sum(_WALL_REMAINING), last=Max("wait_key"))
    )


def _middle_sums(priority: int, jobs: list[Job], held_exist: bool = True) -> _MiddleSums:
    """For published waiting jobs of one priority (sorted by wait key), the waiting jobs of that priority at
    or before each one's key, itself excluded, and the other users' held jobs submitted at or before it: in
    one aggregate for all of them (a page's jobs in the middle of a deep priority), not one per job. The
    rows up to the last job's key fall into spans between successive jobs' keys (span i: after job i-1's
    key, up to job i's), each job of `jobs` into a span of its own (so that it can count for the others at
    the key the database holds, and not for itself); a job's answer is the spans up to its own plus those
    jobs that are not it and wait at or before its key. The held jobs among the rows (they wait too) also
    fall into spans by their submit time, and are grouped by owner.

    The rows are read in two parts: the waiting ones up to the last key, over job_waiting_order, and, when
    some job is held at the priority (`held_exist`), the held ones submitted up to it that wait after it (a
    held job published later, which the first part leaves out). Asked for as one condition with an OR,
    PostgreSQL scans the whole job table: 3-5 ms at 10,000 queued for a page's middle jobs with 500 ahead of
    them, against 0.3-0.5 ms over the index. Each part's statement is compiled once per connection and count
    of jobs (`_middle_read`): Django compiled its CASEs in 1-2 ms at each page."""
    keys = [_key(j) for j in jobs]
    values: dict[str, Any] = {"priority": priority}
    values |= {f"job{i}": job.pk for i, job in enumerate(jobs)} | {f"key{i}": key for i, key in enumerate(keys)}
    rows = [
        row
        for held in ((False, True) if held_exist else (False,))
        for row in _middle_read(len(jobs), held).dicts(**values)
    ]
    answers = _MiddleSums({}, {})
    for i, job in enumerate(jobs):
        sums: dict[tuple[str, str], tuple[int, float]] = {}
        for r in rows:
            s = r["span"]
            if s is not None and ((s >= 0 and s <= i) or (s < 0 and -1 - s != i and r["last"] <= keys[i])):
                group = (r["queue"] or r["duration_class"], r["duration_class"])
                count, seconds = sums.get(group, (0, 0.0))
                sums[group] = (count + r["n"], seconds + float(r["seconds"] or 0.0))
        answers.waiting[job.pk] = [WaitingGroup(q, c, priority, n, sec) for (q, c), (n, sec) in sums.items()]
        answers.held[job.pk] = _held_sums(
            HeldRow(r["queue"], r["duration_class"], priority, r["holder"], r["n"], float(r["seconds"] or 0.0))
            for r in rows
            if r["held_span"] is not None and r["held_span"] <= i and r["holder"] != job.owner_id
        )
    return answers


def running_jobs() -> list[Job]:
    """The jobs a card holds now (at most the cards, and the jobs merged into their batches)."""
    return _RUNNING_JOBS.instances()


_RUNNING_JOBS = CompiledRead(Job, lambda: Job.objects.filter(_RUNNING).only(*_RUNNING_FIELDS))


def backlog_items() -> list[WorkItem]:
    """The active jobs as admission sees them, in wall seconds (work × clock_scale): the clock of the
    estimates and ETAs the API shows and of the admission limits. Each running job is an item; the
    waiting ones are one item per (queue, priority), their work summed (admission adds work linearly,
    so the answer is the same as with one item per job)."""
    return _backlog(waiting_groups(), running_jobs())


def _backlog(groups: Iterable[WaitingGroup], running: Iterable[Job]) -> list[WorkItem]:
    return [*(g.item() for g in groups), *(_work_item(j, wall=True) for j in running)]


def headwind_for(duration_class: str, queue: str, capacity: PoolLayout) -> Headwind:
    """What stretches a new job's wait (admission.Headwind): the better classes' share of the cards serving
    `queue`, from the work (wall seconds) accepted over the last GENSERVER_HEADWIND_WINDOW seconds. A short
    job has no better class: no query. Boundaries add nothing here: a card continues in-process when nothing
    waits ahead (yield on demand), and the learned step-time correction carries the in-process save."""
    window = float(settings.HEADWIND_WINDOW_SECONDS)
    better = HIGHER_CLASSES.get(duration_class, ())
    if window <= 0 or not better:
        return CALM
    since = timezone.now() - timedelta(seconds=window)
    rows = (
        Job.objects.filter(created_at__gte=since, duration_class__in=better)
        .values("duration_class")
        .annotate(seconds=Sum(F("estimated_seconds") * F("clock_scale")))
    )
    recent = {row["duration_class"]: float(row["seconds"] or 0.0) for row in rows}
    return headwind(recent, duration_class, window, capacity.card_equivalents(queue))


@dataclass
class _Neighbours:
    """Up to NEAR_END waiting jobs of one priority read from one end of its order (the front: oldest
    first; the back: newest first), to answer many jobs of a page at once."""

    priority: int
    keys: list[Any]  # the rows' wait keys, ascending
    pks: list[Any]
    groups: list[tuple[str, str]]  # each row's (queue, class)
    walls: list[float]
    complete: bool  # fewer than NEAR_END: every row on that side was read

    @classmethod
    def read(cls, priority: int, key: Any, ascending: bool) -> _Neighbours:
        """From the front (`ascending`): the first rows at or before `key`; from the back: the last after it."""
        rows = _neighbours_read(ascending).dicts(priority=priority, key=key)
        if not ascending:
            rows.reverse()
        return cls(
            priority,
            [r["wait_key"] for r in rows],
            [r["id"] for r in rows],
            [(r["queue"] or r["duration_class"], r["duration_class"]) for r in rows],
            [float(r["wall"] or 0.0) for r in rows],
            len(rows) < NEAR_END,
        )

    def _sums(self, lo: int, hi: int, skip: Any = None) -> list[WaitingGroup]:
        sums: dict[tuple[str, str], tuple[int, float]] = {}
        for i in range(lo, hi):
            if self.pks[i] != skip:
                count, seconds = sums.get(self.groups[i], (0, 0.0))
                sums[self.groups[i]] = (count + 1, seconds + self.walls[i])
        return [WaitingGroup(q, c, self.priority, n, sec) for (q, c), (n, sec) in sums.items()]

    def ahead_of(self, job: Job) -> list[WaitingGroup] | None:
        """The rows at or before the job's key, itself excluded; None when the front read stops before
        them all (its last row does not come after the job)."""
        key = _key(job)
        if not self.complete and not (self.keys and self.keys[-1] > key):
            return None
        return self._sums(0, bisect_right(self.keys, key), skip=job.pk)

    def behind(self, job: Job) -> list[WaitingGroup] | None:
        """The rows after the job's key; None when the back read stops before them all."""
        key = _key(job)
        if not self.complete and not (self.keys and self.keys[0] <= key):
            return None
        return self._sums(bisect_right(self.keys, key), len(self.keys))


def _held_read(priority: int, key: Any, ascending: bool) -> tuple[list[tuple[datetime, HeldRow]], bool]:
    """Up to NEAR_END held jobs of one priority from one end of their submit order (job_held_order): from the
    front (`ascending`) those submitted at or before `key`, from the back those after it. Each job's submit
    time and the job as a held row of one, in the order read, and whether that was all of them."""
    rows = _held_end_read(ascending).dicts(priority=priority, key=key)
    read = [
        (r["created_at"], HeldRow(r["queue"], r["duration_class"], priority, r["owner_id"], 1, float(r["wall"] or 0.0)))
        for r in rows
    ]
    return read, len(read) < NEAR_END


# The reads from one end of a priority's order: per direction and NEAR_END (inlined as the statement's LIMIT),
# compiled once per connection, their constants in the text (`_waiting_in_text`).
_END_READS: dict[tuple[str, bool, int], CompiledRead] = {}


def _end_read(kind: str, ascending: bool, limit: int, build: Callable[..., QuerySet]) -> CompiledRead:
    read = _END_READS.get((kind, ascending, limit))
    if read is None:
        read = CompiledRead(Job, build, ints=("priority",), moments=("key",))
        read = _END_READS.setdefault((kind, ascending, limit), read)
    return read


def _neighbours_read(ascending: bool) -> CompiledRead:
    def build(priority: int, key: Any) -> QuerySet:
        # In the index's order (job_waiting_order): a planner guessing many rows on that side would
        # otherwise scan the table to stop at NEAR_END.
        side, order = (
            (Q(wait_key__lte=key), ("priority", "wait_key"))
            if ascending
            else (Q(wait_key__gt=key), ("-priority", "-wait_key"))
        )
        return (
            Job.objects.filter(_waiting_in_text(router.db_for_read(Job)), priority=priority)
            .annotate(wait_key=_WAIT_KEY, wall=_WALL_REMAINING)
            .filter(side)
            .order_by(*order)
            .values("wait_key", "id", "queue", "duration_class", "wall")[:limit]
        )

    limit = NEAR_END
    return _end_read("waiting", ascending, limit, build)


def _held_end_read(ascending: bool) -> CompiledRead:
    def build(priority: int, key: Any) -> QuerySet:
        side, order = (
            (Q(created_at__lte=key), ("priority", "created_at"))
            if ascending
            else (Q(created_at__gt=key), ("-priority", "-created_at"))
        )
        return (
            Job.objects.filter(_held_in_text(router.db_for_read(Job)), priority=priority)
            .filter(side)
            .annotate(wall=_WALL_REMAINING)
            .order_by(*order)
            .values("created_at", "queue", "duration_class", "owner_id", "wall")[:limit]
        )

    limit = NEAR_END
    return _end_read("held", ascending, limit, build)


def _less(
    sums: dict[tuple[str, str, int], WaitingGroup], less: dict[tuple[str, str, int], WaitingGroup]
) -> dict[tuple[str, str, int], WaitingGroup]:
    """`sums` less `less`, group by group, without the groups left empty."""
    out = {}
    for k, g in sums.items():
        b = less.get(k)
        left = g if b is None else replace(g, count=g.count - b.count, seconds=max(0.0, g.seconds - b.seconds))
        if left.count > 0:
            out[k] = left
    return out


@dataclass
class QueueSnapshot:
    """The queue's picture loaded once per request (the waiting jobs' sums per priority from the tally,
    the running jobs, the live cards), answering position and ETA for the jobs a response shows. What a
    waiting job adds is the part of its own priority ahead of it, read from the nearer end for all the
    jobs of a page at once (`prepare`: at most two indexed reads of NEAR_END rows per priority)."""

    groups: list[WaitingGroup]
    running: list[Job]
    layout: PoolLayout
    taken_at: datetime = field(default_factory=timezone.now)  # the clock of its quotes

    @classmethod
    def load(cls) -> QueueSnapshot:
        cluster = cluster_reads()
        snapshot = cls(waiting_groups(), running_jobs(), cluster.layout)
        snapshot._stages = cluster.stage_seconds
        return snapshot

    def backlog_items(self) -> list[WorkItem]:
        """The active jobs as admission sees them (`backlog_items`), from this snapshot's reads."""
        return _backlog(self.groups, self.running)

    def with_new_job(
        self, job: Job, fair: FairPicture | None = None, headwind: Headwind | None = None
    ) -> QueueSnapshot:
        """This snapshot as it is once `job`, just recorded and waiting, counts in the tally (its group one
        job and its wall seconds larger), on a clock taken now: what a fresh `load` would read, less what
        other requests recorded meanwhile, without reading it again (a submit's answer). What admission and
        the fair window read to place the job (before its insert; the job is not of a class better than its
        own, so its headwind is the same after it) go in too: its position and ETA then read nothing."""
        mine = (job.queue or job.duration_class, job.duration_class, job.priority)
        wall = job.remaining_seconds * job.clock_scale
        groups = [
            replace(g, count=g.count + 1, seconds=g.seconds + wall) if _group_key(g) == mine else g for g in self.groups
        ]
        if not any(_group_key(g) == mine for g in self.groups):
            groups.append(WaitingGroup(*mine, count=1, seconds=wall))
        snapshot = QueueSnapshot(groups, self.running, self.layout)
        snapshot._stages = self._stages
        if not job.held:
            # The newest at its priority: what waits there is ahead of it, and what was recorded after it is
            # not in this picture, so `prepare` has nothing to read for it (one indexed read less per submit).
            snapshot._peers[job.pk] = snapshot._all_but(job, [])
        if fair is not None:
            snapshot._take_fair_picture(job, wall, fair)
        if headwind is not None:
            snapshot._winds[(job.duration_class, job.queue or job.duration_class)] = headwind
        return snapshot

    def _take_fair_picture(self, job: Job, wall: float, fair: FairPicture) -> None:
        """The held rows and the queue's waiting users as the fair window read them, with `job` counted in. The
        job is the newest in this picture: for a held one, its owner's held jobs before it are every one they
        held (`_prepare_own_held`); for a published one, the other users' held jobs at its priority submitted
        up to its wait key are every one they hold there (`_prepare_held`)."""
        if job.held:  # its owner's in its queue and priority, of every class (as `_prepare_own_held` counts them)
            mine = (job.queue, job.owner_id, job.priority)
            earlier = [r for r in fair.held if (r.queue, r.owner_id, r.priority) == mine]
            self._own_earlier[job.pk] = (sum(r.count for r in earlier), sum(r.seconds for r in earlier))
            new_row = HeldRow(job.queue, job.duration_class, job.priority, job.owner_id, count=1, seconds=wall)
            self._held_rows = [*fair.held, new_row]  # every reader of the rows sums them
        else:
            self._held_rows = list(fair.held)
            others = (r for r in fair.held if r.priority == job.priority and r.owner_id != job.owner_id)
            self._held_peers[job.pk] = _held_sums(others)
        self._memo[("owners waiting", job.queue)] = set(fair.unstarted()) | {job.owner_id}

    def __post_init__(self) -> None:
        self._peers: dict[Any, list[WaitingGroup]] = {}
        self._ahead: dict[Any, list[WaitingGroup]] = {}
        self._held_rows: list[HeldRow] | None = None
        # Per published job, the other users' held jobs at its priority submitted up to its wait key.
        self._held_peers: dict[Any, dict[tuple[str, str, int], WaitingGroup]] = {}
        # Per held job, (count, wall seconds) of its owner's held jobs in its queue and priority before it.
        self._own_earlier: dict[Any, tuple[int, float]] = {}
        self._winds: dict[tuple[str, str], Headwind] = {}
        self._memo: dict[tuple[Any, ...], Any] = {}  # the fair window's reads that a page's jobs share
        self._stages: dict[str, float] | None = None  # the learned stage seconds, read on first use
        self._decoding: list[dict[str, Any]] | None = None  # the decode workers' queue, read on first use
        self._decode_line: DecodeQueue | None = None

    def prepare(self, jobs: Iterable[Job]) -> None:
        """Load what the positions and ETAs of these jobs (a page, or one job) need: per priority among
        them, the NEAR_END waiting jobs at the back of it and, for the jobs with more behind them, the
        NEAR_END at its front: at most two indexed reads. A job with fewer than NEAR_END behind is its
        priority's tally less those behind it; else one with fewer than NEAR_END ahead counts them from
        the front ones; the jobs with more on both sides (the middle of a very deep queue) are summed, in
        one aggregate for all of them (`_middle_sums`): at most three reads per priority. While some job is
        held, the held jobs around them are read the same way (`_prepare_held`, `_prepare_own_held`)."""
        jobs = [j for j in jobs if self._waits(j)]
        # A held job's place is the round-robin's (`_fair`), not first-come among its priority's waiting jobs.
        waiting = [j for j in jobs if not j.held and j.pk not in self._peers]
        for priority in sorted({j.priority for j in waiting}):
            mine = sorted((j for j in waiting if j.priority == priority), key=_key)
            # The back first: the jobs a response shows are mostly recent ones (a submit's, a page's).
            back = _Neighbours.read(priority, _key(mine[0]), ascending=False)
            rest = []
            for job in mine:
                behind = back.behind(job)
                if behind is None:
                    rest.append(job)
                else:
                    self._peers[job.pk] = self._all_but(job, behind)
            if not rest:
                continue
            front = _Neighbours.read(priority, _key(rest[-1]), ascending=True)
            middle = []
            for job in rest:
                ahead = front.ahead_of(job)
                if ahead is None:
                    middle.append(job)
                else:
                    self._peers[job.pk] = ahead
            if middle:  # NEAR_END or more on both sides: summed, all of them in one read
                sums = _middle_sums(priority, middle, held_exist=any(r.priority == priority for r in self._held()))
                self._peers.update(sums.waiting)
                self._held_peers.update(sums.held)  # the same read's: `_prepare_held` reads nothing for them
        if jobs and self._held_exist():
            self._prepare_held(jobs)
            self._prepare_own_held(jobs)

    def _prepare_held(self, jobs: Iterable[Job]) -> None:
        """For the published jobs among these, the other users' held jobs at their priority submitted up to
        their wait key, for all of them at once, per priority: the held tally less those submitted after
        the oldest of them, read from the newest end; for the jobs that read does not reach, the held jobs
        up to the newest of them, read from the oldest end; the jobs with NEAR_END or more on both sides
        summed in one aggregate (`_middle_sums`): at most three reads per priority."""
        published = [j for j in jobs if not j.held and j.pk not in self._held_peers]
        for priority in sorted({j.priority for j in published}):
            tally = [r for r in self._held() if r.priority == priority]
            owners = {r.owner_id for r in tally}
            mine = []
            for job in sorted((j for j in published if j.priority == priority), key=_key):
                if owners - {job.owner_id}:
                    mine.append(job)
                else:  # nobody else holds a job at its priority
                    self._held_peers[job.pk] = {}
            if not mine:
                continue
            newer, complete = _held_read(priority, _key(mine[0]), ascending=False)
            rest = []
            for job in mine:
                key = _key(job)
                if complete or key >= newer[-1][0]:  # every held job submitted after it was read
                    self._held_peers[job.pk] = _less(
                        _held_sums(r for r in tally if r.owner_id != job.owner_id),
                        _held_sums(r for at, r in newer if at > key and r.owner_id != job.owner_id),
                    )
                else:
                    rest.append(job)
            if not rest:
                continue
            front, complete = _held_read(priority, _key(rest[-1]), ascending=True)
            middle = []
            for job in rest:
                key = _key(job)
                if complete or front[-1][0] > key:  # every held job submitted up to it was read
                    upto = (r for at, r in front if at <= key and r.owner_id != job.owner_id)
                    self._held_peers[job.pk] = _held_sums(upto)
                else:
                    middle.append(job)
            if middle:  # NEAR_END or more on both sides: one read (prepare's own gave most of these already)
                self._held_peers.update(_middle_sums(priority, middle).held)

    def _waits(self, job: Job) -> bool:
        return not job.is_terminal and not _is_running(job) and job.status != JobStatus.DECODING

    def _same_priority_ahead(self, job: Job) -> list[WaitingGroup]:
        """The waiting jobs at the job's priority that wait at least as long as it (itself excluded)."""
        self.prepare([job])
        return self._peers[job.pk]

    def _all_but(self, job: Job, behind: list[WaitingGroup]) -> list[WaitingGroup]:
        """The job's priority's groups less the jobs behind it and the job itself: those ahead of it."""
        less = {(g.queue, g.duration_class): g for g in behind}
        mine = (job.queue or job.duration_class, job.duration_class)
        own = job.remaining_seconds * job.clock_scale
        ahead = []
        for g in self.groups:
            if g.priority != job.priority:
                continue
            b = less.get((g.queue, g.duration_class))
            count = g.count - (b.count if b else 0) - (1 if (g.queue, g.duration_class) == mine else 0)
            seconds = g.seconds - (b.seconds if b else 0.0) - (own if (g.queue, g.duration_class) == mine else 0.0)
            if count > 0:
                ahead.append(replace(g, count=count, seconds=max(0.0, seconds)))
        return ahead

    def _waiting_ahead(self, job: Job) -> list[WaitingGroup]:
        if job.pk not in self._ahead:
            if job.held and not job.is_terminal:  # not published yet: everything published at its priority is ahead
                plain = [g for g in self.groups if g.priority <= job.priority]
            else:
                plain = [g for g in self.groups if g.priority < job.priority] + self._same_priority_ahead(job)
            held = job.held and not job.is_terminal  # itself: some job is held
            self._ahead[job.pk] = self._fair(job, plain) if held or self._held_exist() else plain
        return self._ahead[job.pk]

    # The fair window (services/fairness.py) holds a burst's jobs unpublished: they are counted in the tally
    # (real work, for admission), but a job another user published is not behind them, and a held job waits
    # about round-robin behind the other users, not first-come. Read from the held tally (HeldTally: per
    # queue, class, priority and owner, kept by triggers), once per snapshot, and only while some job is held.
    def _held(self) -> list[HeldRow]:
        if self._held_rows is None:
            self._held_rows = held_rows()
        return self._held_rows

    def _held_exist(self) -> bool:
        return bool(self._held())

    def _fair(self, job: Job, plain: list[WaitingGroup]) -> list[WaitingGroup]:
        """`plain` (the waiting jobs ahead, first-come) without the held jobs that are not ahead of `job`
        (another user's for a published job, every one for a held job), and for a held job the round-robin
        share of the other users' jobs that go before it (scheduling.fairness.held_jobs_ahead)."""
        if job.held:  # every held job at its priority or better (itself included: the tally counts it)
            less = _held_sums(r for r in self._held() if r.priority <= job.priority)
        else:
            less = self._other_users_held_ahead(job)
        out = list(_less({_group_key(g): g for g in plain}, less).values())  # one group per key in `plain`
        if job.held:
            out += self._round_robin(job)
        return out

    def _prepare_own_held(self, jobs: Iterable[Job]) -> None:
        """For the held jobs among these, how many of their owner's held jobs in their queue and priority were
        submitted before them (released first), and their wall seconds, for all of them at once, per (queue,
        owner, priority): the held tally less the ones from the oldest of them on, read from the newest end
        (job_held_order); the jobs that read does not reach summed in one aggregate: at most two reads per
        (queue, owner, priority)."""
        groups: dict[tuple[str, Any, int], list[Job]] = {}
        for job in jobs:
            if job.held and job.pk not in self._own_earlier:
                groups.setdefault((job.queue, job.owner_id, job.priority), []).append(job)
        for (queue, owner_id, priority), mine in groups.items():
            mine.sort(key=lambda j: j.created_at)
            tally = [r for r in self._held() if (r.queue, r.owner_id, r.priority) == (queue, owner_id, priority)]
            n_all, s_all = sum(r.count for r in tally), sum(r.seconds for r in tally)
            own_at = Job.objects.filter(held=True, status__in=ACTIVE, queue=queue, owner_id=owner_id, priority=priority)
            newer = list(
                own_at.filter(created_at__gte=mine[0].created_at)
                .annotate(wall=_WALL_REMAINING)
                .order_by("-created_at")
                .values_list("created_at", "wall")[:NEAR_END]
            )
            middle = []
            for job in mine:
                if len(newer) < NEAR_END or job.created_at > newer[-1][0]:  # every one from it on was read
                    from_it = [float(wall or 0.0) for at, wall in newer if at >= job.created_at]
                    self._own_earlier[job.pk] = (n_all - len(from_it), max(0.0, s_all - sum(from_it)))
                else:
                    middle.append(job)
            if middle:  # NEAR_END or more from it on: the ones before each summed, all of them in one read
                keys = [j.created_at for j in middle]
                span = Case(
                    *(When(created_at__lt=k, then=Value(i)) for i, k in enumerate(keys)), output_field=IntegerField()
                )
                spans = list(
                    own_at.filter(created_at__lt=keys[-1])
                    .annotate(span=span)
                    .order_by()
                    .values_list("span")
                    .annotate(n=Count("id"), seconds=Sum(_WALL_REMAINING))
                )
                for i, job in enumerate(middle):
                    upto = [(n, float(sec or 0.0)) for at_span, n, sec in spans if at_span <= i]
                    self._own_earlier[job.pk] = (sum(n for n, _ in upto), sum(sec for _, sec in upto))

    def _other_users_held_ahead(self, job: Job) -> dict[tuple[str, str, int], WaitingGroup]:
        """The other users' held jobs that `plain` counts ahead of a published job: every one at a better
        priority (the held tally's rows), and at its own those submitted up to its wait key (`_prepare_held`)."""
        better = _held_sums(r for r in self._held() if r.owner_id != job.owner_id and r.priority < job.priority)
        self._prepare_held([job])
        return {**better, **self._held_peers[job.pk]}

    def _round_robin(self, job: Job) -> list[WaitingGroup]:
        """A held job's share of what waits before it: its owner's held jobs released first, and about one
        job of every other user waiting in its queue per one of those (capped by what the others hold)."""
        queue = job.queue or job.duration_class
        same = [r for r in self._held() if r.queue == job.queue and r.priority <= job.priority]
        others = [r for r in same if r.owner_id != job.owner_id]
        n_others, s_others = sum(r.count for r in others), sum(r.seconds for r in others)
        # Its owner's held jobs ahead of it: every one at a better priority, and at its own those submitted
        # before it (`_prepare_own_held`).
        self._prepare_own_held([job])
        n_earlier, s_earlier = self._own_earlier[job.pk]
        mine = [r for r in same if r.owner_id == job.owner_id and r.priority < job.priority]
        n_own, s_own = sum(r.count for r in mine) + n_earlier, sum(r.seconds for r in mine) + s_earlier
        key = ("owners waiting", job.queue)
        if key not in self._memo:  # the users with unstarted jobs in the queue (published, or held)
            self._memo[key] = set(unstarted_by_owner(job.queue, self._held()))
        users = len(self._memo[key] - {job.owner_id}) + 1
        # Their published jobs are counted already; their turns beyond those come from what they hold.
        from_held = min(held_jobs_ahead(n_own, users) - n_own, n_others)
        seconds = s_own + (s_others * from_held / n_others if n_others else 0.0)
        count = n_own + from_held
        return [WaitingGroup(queue, job.duration_class, job.priority, count, seconds)] if count else []

    def queue_position(self, job: Job) -> int | None:
        """Jobs that will take a card before this one (0: it runs, or runs next). None once terminal."""
        if job.is_terminal:
            return None
        if _is_running(job) or job.status == JobStatus.DECODING:
            return 0
        mine = {w.name for w in self.layout.workers if (job.queue or job.duration_class) in w.consumed_queues()}
        shared = {q for w in self.layout.workers if w.name in mine for q in w.consumed_queues()}
        return sum(g.count for g in self._waiting_ahead(job) if g.queue in shared)

    def _wait_and_own(self, job: Job) -> tuple[float, float] | None:
        """(wall seconds until its first step, wall seconds from then until it is done); None once terminal.

        Besides the work ahead and its own denoising, its model's learned stage seconds (`stage_seconds`):
        before its first step, what is left of its encode hop (not yet encoded) and the dispatch hop to the
        card; after each of its chunks left, a boundary; after its denoising, the decode (what is left of it,
        for a job decoding now). The better classes' work that arrives while it waits stretches its wait
        (admission's headwind), and what arrives while it runs stretches its denoising: a card hands its chunk
        over at a boundary when a better message waits, so the job advances on the rest of the card's time
        (bench.replay: videos ran 4 % longer than their ETAs counted, a median 2.3 s of 60)."""
        if job.is_terminal:
            return None
        if job.status == JobStatus.DECODING:
            return 0.0, self._decode_left(job)
        queue = job.queue or job.duration_class
        wind = self._headwind(job.duration_class, queue)
        own = self._denoise_left(job) / (1.0 - wind.higher_share)
        if _is_running(job):
            return 0.0, own + self._tail(job, own)
        before = 0.0
        if job.status in (JobStatus.QUEUED, JobStatus.ENCODING):  # its encode hop is still (partly) ahead
            before = max(0.0, self._stage(job.model, LEAD_IN) - self._since(job.published_at))
        if job.steps_done == 0:
            before += self._stage(job.model, HOP)
        items = [g.item() for g in self._waiting_ahead(job)]
        items += [
            _work_item(o, wall=True, now=self.taken_at, step_overhead=self._stage(o.model, STEP))
            for o in self.running
            if o.pk != job.pk
        ]
        wait = expected_start(queue, job.priority, items, self.layout, wind)
        return wait + before, own + self._tail(job, wait + before + own)

    def _denoise_left(self, job: Job) -> float:
        """Wall seconds of its denoising left: its work at its queue's speed-up, what each step takes beyond it
        (STEP), and a boundary per chunk. A job on a queue only card groups read runs group_speedup(k) times
        faster than one card."""
        own = job.remaining_seconds * job.clock_scale / self.layout.job_speedup(job.queue or job.duration_class)
        steps_left = max(0, job.total_steps - job.steps_done)
        chunks_left = math.ceil(steps_left / max(1, job.chunk_steps))
        return own + steps_left * self._stage(job.model, STEP) + chunks_left * self._stage(job.model, BOUNDARY)

    def _tail(self, job: Job, denoised_in: float) -> float:
        """Wall seconds from the end of its denoising (in `denoised_in`) until its outputs are stored.

        Its model's decode hop, the wait for a decode worker behind the decodes that reach one first
        (decode_queue.py), and its decode. Until its model learned its decode alone (DECODE), the learned
        tail, which is a median of those three: a rare long wait behind a video's decode does not show in it.
        """
        tail, decode = self._stage(job.model, TAIL), self._stage(job.model, DECODE)
        if not decode:
            return tail
        hop = max(0.0, tail - decode)
        earlier = [
            (self._denoise_left(o) + self._decode_hop(o.model), self._stage(o.model, DECODE))
            for o in self.running
            if o.pk != job.pk
        ]
        return hop + self._line().wait(denoised_in + hop, earlier) + decode

    def _decode_left(self, job: Job) -> float:
        """Wall seconds until a job published to a decode worker is done: what is left of its decode, in service;
        queued, what is left of its hop, the wait behind the decodes published before it, and its decode."""
        tail, decode = self._stage(job.model, TAIL), self._stage(job.model, DECODE)
        if not decode:
            return max(0.0, tail - self._since(job.published_at))
        rows = self._decoding_rows()
        mine = next((r for r in rows if r["id"] == job.pk), None)
        if mine is not None and in_service(mine):
            return max(0.0, decode - self._since(mine["chunk_started_at"]))
        ahead = rows if mine is None else rows[: rows.index(mine)]  # first published first
        line = DecodeQueue.of(
            map(as_line_row, ahead), self._decoders(), self._decode_seconds, self.taken_at, self._decode_hop
        )
        return max(0.0, self._decode_hop(job.model) - self._since(job.published_at)) + line.wait(0.0) + decode

    def _decode_hop(self, model: str) -> float:
        """Its decode's publish → a decode worker taking it, without a queue: the learned tail less the decode."""
        return max(0.0, self._stage(model, TAIL) - self._stage(model, DECODE))

    def _longest_decode_hop(self) -> float:
        """The longest decode hop of any model that learned one: a decode published longer ago reached the queue."""
        models = {key.rpartition(":")[0] for key in self._stage_table()}
        return max((self._decode_hop(model) for model in models), default=0.0)

    def _decode_seconds(self, model: str) -> float:
        return self._stage(model, DECODE)

    def _decoders(self) -> int:
        """The live decode workers (one per node in the generated layout)."""
        return sum(1 for w in self.layout.workers if DECODE_QUEUE in w.consumed_queues()) or 1

    def _decoding_rows(self) -> list[dict[str, Any]]:
        if self._decoding is None:
            self._decoding = decoding_rows()
        return self._decoding

    def _line(self) -> DecodeQueue:
        """The decode workers' queue of what is published now, read once per snapshot."""
        if self._decode_line is None:
            # The whole rows when a decoding job of the page read them already, else the line's bounded reads.
            if self._decoding is None:
                read = line(self.taken_at - timedelta(seconds=self._longest_decode_hop()))
                rows, settled = read.rows, read.settled
            else:
                rows, settled = list(map(as_line_row, self._decoding)), []
            self._decode_line = DecodeQueue.of(
                rows, self._decoders(), self._decode_seconds, self.taken_at, self._decode_hop, settled
            )
        return self._decode_line

    def _stage(self, model: str, stage: str) -> float:
        """The model's learned seconds of `stage` (0 until one of its jobs measured it), read once per snapshot."""
        return self._stage_table().get(f"{model}:{stage}", 0.0)

    def _stage_table(self) -> dict[str, float]:
        if self._stages is None:
            self._stages = stage_seconds()
        return self._stages

    def _since(self, moment: datetime | None) -> float:
        """Seconds from `moment` to this snapshot's clock (0 when unset: a held job was never published)."""
        return max(0.0, (self.taken_at - moment).total_seconds()) if moment is not None else 0.0

    def _headwind(self, duration_class: str, queue: str) -> Headwind:
        """As admission decides (headwind_for), once per queue for this snapshot."""
        key = (duration_class, queue)
        if key not in self._winds:
            self._winds[key] = headwind_for(duration_class, queue, self.layout)
        return self._winds[key]

    def eta_seconds(self, job: Job) -> float | None:
        """Expected wall seconds until the job is done (its outputs stored). None once terminal."""
        return self.times(job)[0]

    def quote(self, job: Job) -> tuple[datetime | None, datetime | None]:
        """(expected_start_at, expected_finish_at): when its first denoising step is expected (the moment it
        took it, once it did) and when it is done, from the numbers of `eta_seconds` on this
        snapshot's clock. (None, None) once terminal, or while no live card serves its queue."""
        return self.times(job)[1:]

    def times(self, job: Job) -> tuple[float | None, datetime | None, datetime | None]:
        """(eta_seconds, expected_start_at, expected_finish_at) from one reckoning of the job's wait and work:
        a job's answer shows all three."""
        parts = self._wait_and_own(job)
        if parts is None or math.isinf(parts[0]):
            return None, None, None
        eta = round(parts[0] + parts[1], 3)
        if math.isinf(eta):
            return eta, None, None
        start = job.started_at or self.taken_at + timedelta(seconds=round(parts[0], 3))
        return eta, start, self.taken_at + timedelta(seconds=eta)
