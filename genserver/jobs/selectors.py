"""Reads: which jobs a user sees, the queue picture (positions, ETAs, backlog) from the database, and
the capacity that serves it (the cards whose workers heartbeat, on every node)."""

from __future__ import annotations

import json
import math
import time
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, ExpressionWrapper, F, FloatField, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from genserver import deployment
from genserver.jobs.broker import broker_depth
from genserver.jobs.models import ACTIVE, ApiToken, Job, JobStatus, QueueTally
from genserver.redis_client import CORRECTION_KEY, LONG_CAP_KEY, WORKER_KEY, client as redis_client
from genserver.scheduling.admission import CALM, HIGHER_CLASSES, Headwind, WorkItem, expected_wait, headwind
from genserver.scheduling.classes import CLASSES, LONG, priority_for
from genserver.scheduling.cost import StepTimeCorrection
from genserver.scheduling.fairness import held_jobs_ahead
from genserver.scheduling.overload import capped_layout
from genserver.scheduling.pools import DECODE, ENCODE, PoolLayout, class_of, worker_from_queues


def jobs_visible_to(user: Any) -> QuerySet[Job]:
    """Staff see every job; a user sees only their own (another's is a 404, not a 403)."""
    qs = Job.objects.all()
    return qs if user.is_staff else qs.filter(owner=user)


def model_of(job_id) -> str | None:
    """The job's model name (None if there is no such job), read without taking it."""
    return Job.objects.filter(pk=job_id).values_list("model", flat=True).first()


def _is_running(job: Job) -> bool:
    return bool(job.lease_owner) and job.status in (JobStatus.DENOISING,)


def _chunk_remaining(job: Job) -> float:
    step_seconds = job.estimated_seconds / job.total_steps if job.steps else 0.0
    done_in_chunk = max(0, job.steps_done - job.checkpoint_step)
    return max(0, job.chunk_steps - done_in_chunk) * step_seconds


def _work_item(job: Job, wall: bool) -> WorkItem:
    scale = job.clock_scale if wall else 1.0
    return WorkItem(
        queue=job.queue or job.duration_class,
        priority=job.priority,
        remaining_seconds=job.remaining_seconds * scale,
        running=_is_running(job),
        chunk_remaining_seconds=_chunk_remaining(job) * scale,
    )


# --- The queue picture at any depth --------------------------------------------------
# A running job holds a card (lease_owner set while denoising): there are at most as many as the cards
# (and their merged batches), so they are loaded one by one. Every other active job waits, and waiting
# jobs are only ever counted and summed: per (queue, class, priority) in QueueTally, which triggers on
# the job table keep in the same transaction as every write (migration 0013), and per job, for the part
# of its own priority that waits around it, in the database over the partial index of waiting jobs
# (migration 0012). A request reads a few tally rows, not the rows of the whole queue.
_RUNNING = Q(status=JobStatus.DENOISING) & ~Q(lease_owner="")
_WAITING = Q(status__in=ACTIVE) & ~_RUNNING
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
NEAR_END = 500

_RUNNING_FIELDS = (
    "id",
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
        return WorkItem(queue=self.queue, priority=self.priority, remaining_seconds=self.seconds)


def _groups(rows: Iterable[dict[str, Any]]) -> list[WaitingGroup]:
    return [
        WaitingGroup(
            r["queue"] or r["duration_class"], r["duration_class"], r["priority"], r["n"], float(r["seconds"] or 0.0)
        )
        for r in rows
    ]


def waiting_groups() -> list[WaitingGroup]:
    """Every waiting job, counted and summed per (queue, class, priority): the tally's few rows."""
    rows = QueueTally.objects.filter(count__gt=0).values("queue", "duration_class", "priority", "count", "seconds")
    return _groups({**r, "n": r["count"]} for r in rows)


def _waiting_sums(priority: int, wait_key: Q) -> list[WaitingGroup]:
    rows = (
        Job.objects.filter(_WAITING, priority=priority)
        .annotate(wait_key=_WAIT_KEY)
        .filter(wait_key)
        .order_by()
        .values("queue", "duration_class", "priority")
        .annotate(n=Count("id"), seconds=Sum(_WALL_REMAINING))
    )
    return _groups(rows)


def running_jobs() -> list[Job]:
    """The jobs a card holds now (at most the cards, and the jobs merged into their batches)."""
    return list(Job.objects.filter(_RUNNING).only(*_RUNNING_FIELDS))


def backlog_items() -> list[WorkItem]:
    """The active jobs as admission sees them, in wall seconds (work × clock_scale): the clock of the
    estimates and ETAs the API shows and of the admission limits. Each running job is an item; the
    waiting ones are one item per (queue, priority), their work summed (admission adds work linearly,
    so the answer is the same as with one item per job)."""
    return [*(g.item() for g in waiting_groups()), *(_work_item(j, wall=True) for j in running_jobs())]


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
    def read(cls, priority: int, side: Q, ascending: bool) -> _Neighbours:
        # In the index's order (job_waiting_order): a planner guessing many rows on that side would
        # otherwise scan the table to stop at NEAR_END.
        order = ("priority", "wait_key") if ascending else ("-priority", "-wait_key")
        rows = list(
            Job.objects.filter(_WAITING, priority=priority)
            .annotate(wait_key=_WAIT_KEY, wall=_WALL_REMAINING)
            .filter(side)
            .order_by(*order)
            .values_list("wait_key", "pk", "queue", "duration_class", "wall")[:NEAR_END]
        )
        if not ascending:
            rows.reverse()
        return cls(
            priority,
            [r[0] for r in rows],
            [r[1] for r in rows],
            [(r[2] or r[3], r[3]) for r in rows],
            [float(r[4] or 0.0) for r in rows],
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
    taken_at: datetime = field(default_factory=timezone.now)  # the clock of its quotes

    @classmethod
    def load(cls) -> QueueSnapshot:
        return cls(waiting_groups(), running_jobs(), live_capacity())

    def __post_init__(self) -> None:
        self._peers: dict[Any, list[WaitingGroup]] = {}
        self._ahead: dict[Any, list[WaitingGroup]] = {}
        self._any_held: bool | None = None

    def prepare(self, jobs: Iterable[Job]) -> None:
        """Load what the positions and ETAs of these jobs (a page, or one job) need: per priority among
        them, the NEAR_END waiting jobs at the back of it and, for the jobs with more behind them, the
        NEAR_END at its front: at most two indexed reads. A job with fewer than NEAR_END behind is its
        priority's tally less those behind it; else one with fewer than NEAR_END ahead counts them from
        the front ones; a job with more on both sides (the middle of a very deep queue) is summed on its
        own (`_same_priority_ahead`)."""
        waiting = [j for j in jobs if self._waits(j) and j.pk not in self._peers]
        for priority in sorted({j.priority for j in waiting}):
            mine = sorted((j for j in waiting if j.priority == priority), key=_key)
            # The back first: the jobs a response shows are mostly recent ones (a submit's, a page's).
            back = _Neighbours.read(priority, Q(wait_key__gt=_key(mine[0])), ascending=False)
            rest = []
            for job in mine:
                behind = back.behind(job)
                if behind is None:
                    rest.append(job)
                else:
                    self._peers[job.pk] = self._all_but(job, behind)
            if not rest:
                continue
            front = _Neighbours.read(priority, Q(wait_key__lte=_key(rest[-1])), ascending=True)
            for job in rest:
                ahead = front.ahead_of(job)
                if ahead is not None:
                    self._peers[job.pk] = ahead

    def _waits(self, job: Job) -> bool:
        return not job.is_terminal and not _is_running(job) and job.status != JobStatus.DECODING

    def _same_priority_ahead(self, job: Job) -> list[WaitingGroup]:
        """The waiting jobs at the job's priority that wait at least as long as it (itself excluded)."""
        self.prepare([job])
        if job.pk not in self._peers:  # NEAR_END or more on both sides: sum those ahead
            self._peers[job.pk] = _waiting_sums(job.priority, Q(wait_key__lte=_key(job)) & ~Q(pk=job.pk))
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
            self._ahead[job.pk] = self._fair(job, plain) if self._held_exist() else plain
        return self._ahead[job.pk]

    # The fair window (services/fairness.py) holds a burst's jobs unpublished: they are counted in the tally
    # (real work, for admission), but a job another user published is not behind them, and a held job waits
    # about round-robin behind the other users, not first-come. Only read while some job is held.
    def _held_exist(self) -> bool:
        if self._any_held is None:
            self._any_held = Job.objects.filter(held=True, status__in=ACTIVE).exists()
        return self._any_held

    def _fair(self, job: Job, plain: list[WaitingGroup]) -> list[WaitingGroup]:
        """`plain` (the waiting jobs ahead, first-come) without the held jobs that are not ahead of `job`
        (another user's for a published job, every one for a held job), and for a held job the round-robin
        share of the other users' jobs that go before it (scheduling.fairness.held_jobs_ahead)."""
        if job.held:  # every held job at its priority or better (itself included: the tally counts it)
            held = Job.objects.filter(held=True, status__in=ACTIVE, priority__lte=job.priority)
        else:  # the other users' held jobs that `plain` counts ahead of it
            ahead = Q(priority__lt=job.priority) | Q(priority=job.priority, created_at__lte=_key(job))
            held = Job.objects.filter(ahead, held=True, status__in=ACTIVE).exclude(owner_id=job.owner_id)
        less = {
            (g.queue, g.duration_class, g.priority): g
            for g in _groups(
                held.order_by()
                .values("queue", "duration_class", "priority")
                .annotate(n=Count("id"), seconds=Sum(_WALL_REMAINING))
            )
        }
        out = []
        for g in plain:
            b = less.get((g.queue, g.duration_class, g.priority))
            if b is None:
                out.append(g)
            elif g.count - b.count > 0:
                out.append(replace(g, count=g.count - b.count, seconds=max(0.0, g.seconds - b.seconds)))
        if job.held:
            out += self._round_robin(job)
        return out

    def _round_robin(self, job: Job) -> list[WaitingGroup]:
        """A held job's share of what waits before it: its owner's held jobs released first, and about one
        job of every other user waiting in its queue per one of those (capped by what the others hold)."""
        queue = job.queue or job.duration_class
        same = Job.objects.filter(held=True, status__in=ACTIVE, queue=job.queue, priority__lte=job.priority)
        own = same.filter(owner_id=job.owner_id).filter(Q(priority__lt=job.priority) | Q(created_at__lt=job.created_at))
        own_ahead = own.aggregate(n=Count("id"), seconds=Sum(_WALL_REMAINING))
        others = same.exclude(owner_id=job.owner_id).aggregate(n=Count("id"), seconds=Sum(_WALL_REMAINING))
        # The users with unstarted jobs in the queue, over the partial indexes job_fair_window and job_held.
        unstarted = Job.objects.filter(queue=job.queue, status__in=ACTIVE).order_by()
        owners = set(unstarted.filter(held=False, chunks_run=0).values_list("owner_id", flat=True).distinct())
        owners |= set(unstarted.filter(held=True).values_list("owner_id", flat=True).distinct())
        users = len(owners - {job.owner_id}) + 1
        n_own, s_own = own_ahead["n"] or 0, float(own_ahead["seconds"] or 0.0)
        n_others, s_others = others["n"] or 0, float(others["seconds"] or 0.0)
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
        """(wall seconds until it takes a card, wall seconds of its own work left); None once terminal."""
        if job.is_terminal:
            return None
        # A job on a queue only card groups read runs group_speedup(k) times faster than one card.
        own = job.remaining_seconds * job.clock_scale / self.layout.job_speedup(job.queue or job.duration_class)
        if _is_running(job) or job.status == JobStatus.DECODING:
            return 0.0, own
        items = [g.item() for g in self._waiting_ahead(job)]
        items += [_work_item(o, wall=True) for o in self.running if o.pk != job.pk]
        return expected_wait(job.queue or job.duration_class, job.priority, items, self.layout), own

    def eta_seconds(self, job: Job) -> float | None:
        """Expected wall seconds until the job finishes denoising. None once terminal."""
        parts = self._wait_and_own(job)
        if parts is None or math.isinf(parts[0]):
            return None
        return round(parts[0] + parts[1], 3)

    def quote(self, job: Job) -> tuple[datetime | None, datetime | None]:
        """(expected_start_at, expected_finish_at): when its first denoising step is expected (the moment it
        took it, once it did) and when its denoising ends, from the numbers of `eta_seconds` on this
        snapshot's clock. (None, None) once terminal, or while no live card serves its queue."""
        parts = self._wait_and_own(job)
        eta = self.eta_seconds(job)
        if parts is None or eta is None:
            return None, None
        start = job.started_at or self.taken_at + timedelta(seconds=round(parts[0], 3))
        return start, self.taken_at + timedelta(seconds=eta)


def live_workers() -> list[dict[str, Any]]:
    """Workers that sent a heartbeat recently (see workers/heartbeat.py), every node's, by name
    (`gpu0@NODE`): each with its node, pool entry, queues, cards and loaded models."""
    r = redis_client()
    found = []
    for key in r.scan_iter(match=WORKER_KEY.format(name="*"), count=200):
        raw = r.get(key)
        if raw:
            worker = json.loads(raw)
            name = str(worker.get("name", ""))
            worker.setdefault("worker", name.partition("@")[0])
            worker.setdefault("node", name.partition("@")[2])
            found.append(worker)
    return sorted(found, key=lambda w: (w.get("node", ""), w.get("name", "")))


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


def _devices(worker: dict[str, Any]) -> tuple[int, ...]:
    text = str(worker.get("devices", "") or "")
    return tuple(int(d) for d in text.split(",") if d.strip().isdigit())


def capacity_of(workers: list[dict[str, Any]]) -> PoolLayout:
    """The capacity these live workers are: one pool entry per worker, named `gpu0@NODE`."""
    specs = []
    for worker in workers:
        try:
            specs.append(worker_from_queues(str(worker["name"]), list(worker.get("queues", [])), _devices(worker)))
        except (KeyError, ValueError):  # a malformed or foreign heartbeat is no capacity
            continue
    return PoolLayout(tuple(specs), complete=False)


def live_capacity(workers: list[dict[str, Any]] | None = None, capped: bool = True) -> PoolLayout:
    """What admission, queue positions and ETAs count: the cards whose workers heartbeat now, on every
    node. A node that dies stops counting when its heartbeats expire (3 intervals, within the lease);
    a new node counts from its first heartbeat. With no worker reporting (before the first heartbeat,
    or Redis unreachable) the configured layout is the estimate, so the service keeps accepting work
    for the nodes that are starting. While the overload cap holds (`capped`), the long class counts the
    cards it may use only (scheduling/overload.py)."""
    if workers is None:
        try:
            workers = live_workers()
        except Exception:  # noqa: BLE001 - admission must answer when Redis is down: the layout estimates
            workers = []
    capacity = capacity_of(workers) if workers else deployment.layout()
    if capped:
        state = long_cap_state()
        if state.engaged:
            return capped_layout(capacity, state.cap)
    return capacity


def nodes_overview(workers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per live node: its workers' names and the denoising cards they are (GET /api/v1/workers/)."""
    nodes: dict[str, dict[str, Any]] = {}
    for spec in capacity_of(workers).workers:
        entry = nodes.setdefault(spec.name.partition("@")[2], {"workers": [], "cards": 0})
        entry["workers"].append(spec.name)
        entry["cards"] += spec.group_size if spec.denoises else 0
    return nodes


def _cards(capacity: PoolLayout, duration_class: str) -> tuple[int, dict[str, int]]:
    """The cards serving a class (any of its queues: plain, a model's, a lane's), in all and per node."""
    by_node: dict[str, int] = {}
    for spec in capacity.workers:
        if any(class_of(q) == duration_class for q in spec.consumed_queues()):
            node = spec.name.partition("@")[2]
            by_node[node] = by_node.get(node, 0) + spec.group_size
    return sum(by_node.values()), by_node


# What a user who is not staff sees of a class: its summary, nothing that names a worker or a machine.
QUEUE_SUMMARY_FIELDS = (
    "name",
    "depth",
    "running",
    "backlog_seconds",
    "capacity_source",
    "cards",
    "expected_wait_seconds",
    "wait_limit_seconds",
    "accepting",
    "capped",
)


def queue_overview(staff: bool = True) -> list[dict[str, Any]]:
    """Per duration class: depth, backlog, the cards serving it (live, per node), and whether a new job
    would be accepted now (every figure in wall seconds, like the jobs' estimates and ETAs).

    `staff` False: the class summary only (QUEUE_SUMMARY_FIELDS): no worker names, nodes or
    broker internals."""
    full = _queue_overview()
    if staff:
        return full
    return [{k: entry[k] for k in QUEUE_SUMMARY_FIELDS} for entry in full]


def _queue_overview() -> list[dict[str, Any]]:
    thresholds, limits = deployment.thresholds(), deployment.limits()
    groups, running = waiting_groups(), running_jobs()
    items = [*(g.item() for g in groups), *(_work_item(j, wall=True) for j in running)]
    try:
        workers = live_workers()
    except Exception:  # noqa: BLE001 - the overview must answer even when Redis is down
        workers = None
    layout = live_capacity(workers or [])
    capped = long_cap_state().engaged
    result = []
    for cls in CLASSES:
        waiting = [g for g in groups if g.duration_class == cls]
        mine = [j for j in running if j.duration_class == cls]
        # A typical new job of the class: its worst (latest-served) new-job priority.
        typical = {
            "short": thresholds.short * 0.99,
            "medium": thresholds.medium * 0.99,
            "long": thresholds.medium * 20,
        }[cls]
        wind = headwind_for(cls, cls, layout)  # as admission decides
        wait = expected_wait(cls, priority_for(cls, typical, False, thresholds), items, layout, wind)
        limit = limits.for_class(cls)
        entry: dict[str, Any] = {
            "name": cls,
            "depth": sum(g.count for g in waiting),
            "running": len(mine),
            "backlog_seconds": round(
                sum(g.seconds for g in waiting) + sum(j.remaining_seconds * j.clock_scale for j in mine), 3
            ),
            "workers": [w.name for w in layout.workers if cls in w.queues],  # dedicated ones included
            # live: counted from heartbeats; layout: nothing reports yet, the configured layout estimates
            "capacity_source": "live" if workers else "layout",
            "cards": _cards(layout, cls)[0],
            "cards_by_node": _cards(layout, cls)[1],
            "expected_wait_seconds": None if math.isinf(wait) else round(wait, 3),
            "wait_limit_seconds": limit,
            "accepting": wait <= limit,
            "capped": cls == LONG and capped,
        }
        if workers is not None:
            entry["live_workers"] = [w["name"] for w in workers if cls in w.get("queues", [])]
            try:
                entry["broker_messages"] = broker_depth(cls)
            except Exception:  # noqa: BLE001 - the overview answers without the depth when Redis is down
                entry["broker_messages"] = None
        result.append(entry)
    return result


# --- The overload cap (scheduling/overload.py; written by services/overload.py on every reaper tick) ------
@dataclass(frozen=True)
class LongCapState:
    """The overload cap as beat last decided it (off when beat has not written it lately)."""

    engaged: bool = False
    cap: int = 0  # cards that may run long work while engaged
    long_cards: int = 0  # live cards that take long work
    long_wait_seconds: float = 0.0  # a new long job's expected wait, over every card, when decided
    changed_at: str = ""  # when it last engaged or let go (ISO 8601)


def long_cap_state() -> LongCapState:
    try:
        raw = redis_client().get(LONG_CAP_KEY)
        return LongCapState(**json.loads(raw)) if raw else LongCapState()
    except Exception:  # noqa: BLE001 - Redis down or a foreign value: fail open, every card takes long work
        return LongCapState()


def cards_running_long(exclude_worker: str = "") -> int:
    """Workers (by lease owner) running a long job's chunk now, other than `exclude_worker`."""
    return (
        Job.objects.filter(duration_class=LONG, status=JobStatus.DENOISING, lease_expires_at__gt=timezone.now())
        .exclude(lease_owner__in=["", exclude_worker])
        .values("lease_owner")
        .distinct()
        .count()
    )


def must_leave_long(worker: str) -> bool:
    """Whether `worker` must not run long work now: the cap holds and its share of cards is taken."""
    state = long_cap_state()
    return state.engaged and cards_running_long(exclude_worker=worker) >= state.cap


def queue_and_priority(job_id: Any) -> tuple[str, int] | None:
    """The job's queue and current priority (None: no such job)."""
    row = Job.objects.filter(pk=job_id).values_list("queue", "priority").first()
    return (row[0], row[1]) if row else None


# --- Bounded waits (Prefer: wait, the OpenAI images endpoint) ------------------------
WAIT_POLL_FIRST_SECONDS = 0.05  # short work ends within a few polls
WAIT_POLL_MAX_SECONDS = 0.5  # one indexed primary-key read per waiter at most twice a second


WAIT_SERVED_CHECK_SECONDS = 1.0  # how often a waiter checks that some live worker can still run its job


def _queue_it_waits_on(job: Job) -> str:
    """The queue whose worker runs the job's next stage."""
    if job.status == JobStatus.QUEUED:
        return ENCODE
    if job.status == JobStatus.DECODING:
        return DECODE
    return job.queue


def nobody_serves(job: Job) -> bool:
    """No live worker (on any node) consumes the queue of the job's next stage: waiting for it is in vain
    until one starts. Redis unreachable counts as served (the wait stays bounded by its deadline)."""
    try:
        workers = live_workers()
    except Exception:  # noqa: BLE001 - a wait is no place to fail a request for Redis
        return False
    wanted = _queue_it_waits_on(job)
    return not any(wanted in spec.consumed_queues() for spec in capacity_of(workers).workers)


def wait_for_terminal(job_id: Any, seconds: float) -> Job:
    """The job's row once it is terminal, or as it is when `seconds` have passed (never longer), or as soon
    as no live worker serves the stage it waits for (nothing could end it: the caller answers at once).

    Polls the row by primary key with a growing interval: a job that ends in a
    fraction of a second answers that quickly, a long wait costs one small read
    every WAIT_POLL_MAX_SECONDS, and a look at the workers' heartbeats every
    WAIT_SERVED_CHECK_SECONDS.
    """
    start = time.monotonic()
    deadline = start + max(0.0, seconds)
    interval = WAIT_POLL_FIRST_SECONDS
    next_check = start
    while True:
        job = Job.objects.get(pk=job_id)
        now = time.monotonic()
        left = deadline - now
        if job.is_terminal or left <= 0:
            return job
        if now >= next_check:
            if nobody_serves(job):
                return job
            next_check = now + WAIT_SERVED_CHECK_SECONDS
        time.sleep(min(interval, left))
        interval = min(interval * 2, WAIT_POLL_MAX_SECONDS)


# --- Quotas (issue 17): a user's effective quota and their usage of it -----------------------------
@dataclass(frozen=True)
class EffectiveQuota:
    """The limits that apply to one user (0: no limit; an empty tuple: every model / lane)."""

    source: str  # "user" (their own row), "groups: a, b" (combined), or "default" (settings)
    max_jobs_in_flight: int
    submits_per_minute: int  # per SUBMIT_RATE_WINDOW seconds (60 by default)
    card_seconds_per_day: float
    models: tuple[str, ...] = ()
    lanes: tuple[str, ...] = ()

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    def allows_lane(self, lane: str) -> bool:
        """A job without a lane is always allowed; a lane must be listed when lanes are restricted."""
        return not lane or not self.lanes or lane in self.lanes


def _quota_of_row(row: Any) -> EffectiveQuota:
    """A Quota row's limits, its blank ones taken from the settings."""
    from django.conf import settings

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    return EffectiveQuota(
        source="",
        max_jobs_in_flight=pick(row.max_jobs_in_flight, settings.MAX_JOBS_IN_FLIGHT),
        submits_per_minute=pick(row.submits_per_minute, settings.SUBMIT_RATE_LIMIT),
        card_seconds_per_day=float(pick(row.card_seconds_per_day, settings.QUOTA_CARD_SECONDS_PER_DAY)),
        models=tuple(sorted(set(row.allowed_models or ()))),
        lanes=tuple(sorted(set(row.allowed_lanes or ()))),
    )


def _most_generous(values: list[Any]) -> Any:
    """0 (no limit) wins; otherwise the largest."""
    return 0 if any(v == 0 for v in values) else max(values)


def _widest(lists: list[tuple[str, ...]]) -> tuple[str, ...]:
    """An empty list (all) wins; otherwise the union."""
    return () if any(not names for names in lists) else tuple(sorted(set().union(*lists)))


def effective_quota(user: Any) -> EffectiveQuota:
    """The user's own Quota row; else their groups' rows, each limit the most generous of them (no limit
    beats any number, the union of allowed models and lanes, an empty list beats any list); else the
    defaults from settings (GENSERVER_MAX_JOBS_IN_FLIGHT, GENSERVER_SUBMIT_RATE_LIMIT,
    GENSERVER_QUOTA_CARD_SECONDS_PER_DAY, every model and lane)."""
    from django.conf import settings

    from genserver.jobs.models import Quota

    own = Quota.objects.filter(user_id=user.pk).first()
    if own is not None:
        return replace(_quota_of_row(own), source="user")
    rows = list(Quota.objects.filter(group__user__pk=user.pk).select_related("group").order_by("group__name"))
    if rows:
        each = [_quota_of_row(row) for row in rows]
        return EffectiveQuota(
            source="groups: " + ", ".join(row.group.name for row in rows),
            max_jobs_in_flight=_most_generous([q.max_jobs_in_flight for q in each]),
            submits_per_minute=_most_generous([q.submits_per_minute for q in each]),
            card_seconds_per_day=_most_generous([q.card_seconds_per_day for q in each]),
            models=_widest([q.models for q in each]),
            lanes=_widest([q.lanes for q in each]),
        )
    return EffectiveQuota(
        source="default",
        max_jobs_in_flight=settings.MAX_JOBS_IN_FLIGHT,
        submits_per_minute=settings.SUBMIT_RATE_LIMIT,
        card_seconds_per_day=settings.QUOTA_CARD_SECONDS_PER_DAY,
    )


def next_utc_midnight(now: datetime) -> datetime:
    """When the daily card-seconds quota resets: the next 00:00 UTC."""
    today = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today + timedelta(days=1)


@dataclass(frozen=True)
class Usage:
    """A user's counts against their quota at `now`."""

    now: datetime
    in_flight: int  # unfinished jobs whose cancel was not asked
    submits_in_window: int  # accepted submits in the last SUBMIT_RATE_WINDOW seconds
    oldest_submit_in_window: datetime | None
    window_seconds: float
    card_seconds_today: float  # the day's jobs' charges (estimates of those running, measured of those ended)

    @property
    def submits_reset_at(self) -> datetime | None:
        """When the oldest submit of the window leaves it (a place frees up); None when the window is empty."""
        if self.oldest_submit_in_window is None:
            return None
        return self.oldest_submit_in_window + timedelta(seconds=self.window_seconds)

    @property
    def day_resets_at(self) -> datetime:
        return next_utc_midnight(self.now)


def charged_card_seconds() -> Any:
    """A job's charge against the daily quota, as an expression: its measured card time once it ended
    (the same moment as its status changes, before `quotas.settle` writes it down), else its estimate."""
    from django.db.models import Case, F, When

    from genserver.jobs.models import TERMINAL

    return Case(When(status__in=TERMINAL, then=F("card_seconds")), default=F("charged_card_seconds"))


def in_flight_jobs(user: Any) -> QuerySet[Job]:
    """The user's jobs that count against their jobs-in-flight limit (a cancel asked no longer counts)."""
    return Job.objects.filter(owner_id=user.pk, status__in=ACTIVE, cancel_requested=False)


def usage_of(user: Any, now: datetime | None = None) -> Usage:
    """The user's in-flight jobs, submits in the rate window and card-seconds charged today (UTC)."""
    from django.conf import settings
    from django.db.models import Sum

    now = now or timezone.now()
    window = settings.SUBMIT_RATE_WINDOW
    recent = Job.objects.filter(owner_id=user.pk, created_at__gte=now - timedelta(seconds=window))
    day_start = next_utc_midnight(now) - timedelta(days=1)
    charged = Job.objects.filter(owner_id=user.pk, created_at__gte=day_start).aggregate(
        total=Sum(charged_card_seconds())
    )["total"]
    return Usage(
        now=now,
        in_flight=in_flight_jobs(user).count(),
        submits_in_window=recent.count(),
        oldest_submit_in_window=recent.order_by("created_at").values_list("created_at", flat=True).first(),
        window_seconds=window,
        card_seconds_today=float(charged or 0.0),
    )


def _limit(limit: float, used: float, resets_at: datetime | None) -> dict[str, Any]:
    unlimited = limit == 0
    return {
        "limit": None if unlimited else limit,
        "used": used,
        "remaining": None if unlimited else max(0, limit - used),
        "resets_at": resets_at,
    }


def usage_report(user: Any, now: datetime | None = None) -> dict[str, Any]:
    """GET /api/v1/usage/: the user's counts, their quota's limits (None: no limit), what remains, and
    when each resets (jobs in flight: as they end; submits: the oldest leaving the window; card-seconds:
    00:00 UTC)."""
    quota, usage = effective_quota(user), usage_of(user, now)
    names = deployment.registry().names()
    return {
        "user": user.get_username(),
        "quota": quota.source,
        "jobs_in_flight": _limit(quota.max_jobs_in_flight, usage.in_flight, None),
        "submits_per_minute": _limit(quota.submits_per_minute, usage.submits_in_window, usage.submits_reset_at)
        | {"window_seconds": usage.window_seconds},
        "card_seconds_per_day": _limit(
            quota.card_seconds_per_day, round(usage.card_seconds_today, 3), usage.day_resets_at
        ),
        "allowed_models": [n for n in names if quota.allows_model(n)],
        "allowed_lanes": list(quota.lanes) if quota.lanes else None,
    }


# --- API tokens (genserver/jobs/services/tokens.py writes them) ---------------------------------------------
def api_tokens_of(user: Any) -> QuerySet[ApiToken]:
    """The user's tokens not revoked (expired ones included, newest first): GET /api/v1/tokens/."""
    return ApiToken.objects.filter(user=user, revoked_at__isnull=True).order_by("-created_at", "-pk")


def live_api_tokens(user: Any, now: datetime | None = None) -> QuerySet[ApiToken]:
    """The user's tokens that authenticate now (neither expired nor revoked)."""
    from django.db.models import Q

    return api_tokens_of(user).filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now or timezone.now()))


def step_time_corrections() -> dict[str, dict[str, float]]:
    """The step-time factors the service has learned (measured / modelled step seconds), by model, then by
    shape bucket (`family:log2(tokens)`): {} for a model that has none yet (simulated ones never learn).
    Redis unreachable: {} (a read for display must not fail the request)."""
    try:
        raw = redis_client().hgetall(CORRECTION_KEY)
    except Exception:  # noqa: BLE001 - the factors are shown, never needed
        return {}
    learned: dict[str, dict[str, float]] = {}
    for key, value in raw.items():
        model, bucket = StepTimeCorrection.split(key.decode() if isinstance(key, bytes) else key)
        learned.setdefault(model, {})[bucket] = round(float(value), 4)
    return learned
