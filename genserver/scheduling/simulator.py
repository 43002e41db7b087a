"""Discrete-event simulation of the scheduling policy, on the seed chapter's workload.

Two simulators live here:

* `seed_simulate` / `seed_waits`: a faithful reproduction of the seed chapter's
  `simulate()` (FCFS, SJF and static pools; non-preemptive, one request per
  card), including its loop, its generator and its percentile, so that its
  table (images P50/P99 FCFS 17/473 s, SJF 2/90 s, pools 0/7 s; videos 19/423,
  23/614, 152/745 s) comes out exactly.
* `simulate`: an event-driven model of the live service that calls the same
  scheduling core the service uses — `ClassThresholds.classify` for the
  duration class (= queue), `priority_for` for every message's priority,
  `chunking.steps_per_chunk` for the chunk length, the `PoolLayout` for which
  card consumes which queues in which order, and `admission.decide` on every
  arrival. A card takes the next message by kombu's Redis semantics
  (priority-major over all its queues, then its queue order, FIFO within a
  (queue, priority) list; an idle card blocked longest gets a new message
  first, as Redis serves BRPOP clients), runs one chunk, re-publishes the
  job's next chunk and goes back to the broker. It charges a checkpoint
  save + restore at each chunk boundary and a model switch whenever a card
  runs a chunk of a different model than its previous one. An optional cap
  bounds how many cards run long-class chunks at once.

Two metrics per class:

* `wait`: arrival → first denoising step (the seed's metric; includes a model
  switch before the first step).
* `delay`: completion − arrival − service seconds (the honest metric for a
  preemptive system: every second a job spends not computing its own steps,
  including preemption by other work, checkpoints and model switches).

Plain Python, no Django, deterministic for a given workload.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterable, Literal, Mapping, Sequence

from .admission import AdmissionLimits, WorkItem, decide, expected_wait
from .chunking import DEFAULT_CHUNK_SECONDS, steps_per_chunk
from .classes import CLASSES, LONG, ClassThresholds, priority_for
from .pools import PoolLayout, WorkerSpec, default_layout

IMAGE, VIDEO = "image", "video"
KINDS: tuple[str, ...] = (IMAGE, VIDEO)
SeedPolicy = Literal["fcfs", "sjf", "pools"]
SEED_POLICIES: tuple[str, ...] = ("fcfs", "sjf", "pools")

# The seed's durations and the step counts we give them: an image is 20-30 steps
# (0.1-0.2 s each), a video 50 steps (2.4 s or 6 s each).
IMAGE_SECONDS: tuple[float, ...] = (2.0, 3.0, 6.0)
VIDEO_SECONDS: tuple[float, ...] = (120.0, 300.0)
DEFAULT_STEPS: Mapping[float, int] = {2.0: 20, 3.0: 30, 6.0: 30, 120.0: 50, 300.0: 50}
DEFAULT_MODELS: Mapping[str, str] = {IMAGE: "sdxl", VIDEO: "wan"}


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Request:
    """One arrival of the seed's workload."""

    arrival: float
    kind: str  # IMAGE | VIDEO
    seconds: float  # expected (and, in the simulation, actual) denoising seconds


def seed_workload(arrivals: int = 400, rate: float = 0.06, seed: int = 0) -> list[Request]:
    """The seed chapter's generator, draw for draw.

    Poisson arrivals at `rate` per second; 80 % images of 2, 3 or 6 s, 20 %
    videos of 120 or 300 s. The same `seed` gives the same requests as the
    chapter's `simulate()`.
    """
    rng = random.Random(seed)
    t = 0.0
    requests: list[Request] = []
    for _ in range(arrivals):
        t += rng.expovariate(rate)
        if rng.random() < 0.8:
            requests.append(Request(t, IMAGE, rng.choice(list(IMAGE_SECONDS))))
        else:
            requests.append(Request(t, VIDEO, rng.choice(list(VIDEO_SECONDS))))
    return requests


def offered_load(requests: Sequence[Request], n_cards: int) -> float:
    """Work offered per second of arrival span, as a fraction of `n_cards` cards."""
    if not requests:
        return 0.0
    span = requests[-1].arrival
    return sum(r.seconds for r in requests) / span / n_cards if span > 0 else math.inf


def pct(xs: Iterable[float], q: float) -> float:
    """The seed's percentile: the element at index int(q·n) of the sorted values (0 if empty)."""
    values = sorted(xs)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


# --------------------------------------------------------------------------- the seed's policies


def seed_waits(policy: SeedPolicy, n_gpus: int = 4, arrivals: int = 400, rate: float = 0.06,
               seed: int = 0) -> dict[str, list[float]]:
    """Every request's queueing wait (seconds) under one of the seed's policies, per kind.

    A faithful port of the chapter's `simulate()` loop: requests that have
    arrived by `now` enter a heap keyed by arrival ('fcfs', 'pools') or by
    duration ('sjf'); the earliest-free card pops the heap only when it is free
    at `now`, otherwise time advances to that card's free time or the next
    arrival. 'pools' runs images on 1 card and videos on the other n_gpus − 1.
    Non-preemptive, so the wait is also completion − arrival − service.
    """
    if policy not in SEED_POLICIES:
        raise ValueError(f"unknown seed policy {policy!r}; known: {SEED_POLICIES}")
    reqs = [(r.arrival, r.kind, r.seconds) for r in seed_workload(arrivals, rate, seed)]
    waits: dict[str, list[float]] = {IMAGE: [], VIDEO: []}
    if policy == "pools":
        groups = [([r for r in reqs if r[1] == IMAGE], 1), ([r for r in reqs if r[1] == VIDEO], n_gpus - 1)]
    else:
        groups = [(reqs, n_gpus)]
    for rs, cards in groups:
        free = [0.0] * cards  # when each card frees up
        pending: list[tuple[float, tuple[float, str, float]]] = []
        i, now = 0, 0.0
        while i < len(rs) or pending:
            while i < len(rs) and rs[i][0] <= now:
                heapq.heappush(pending, ((rs[i][2] if policy == "sjf" else rs[i][0]), rs[i]))
                i += 1
            g = min(range(cards), key=lambda k: free[k])
            if pending and free[g] <= now:
                _, (arrival, kind, duration) = heapq.heappop(pending)
                waits[kind].append(now - arrival)
                free[g] = now + duration
            else:  # advance the time to the next event
                nxt = [free[g]] if pending else []
                if i < len(rs):
                    nxt.append(rs[i][0])
                now = max(now, min(nxt)) if nxt else now
    return waits


def seed_simulate(policy: SeedPolicy, n_gpus: int = 4, arrivals: int = 400, rate: float = 0.06,
                  seed: int = 0) -> dict[str, tuple[float, float]]:
    """The chapter's `simulate()`: {kind: (P50 wait, P99 wait)} in seconds."""
    waits = seed_waits(policy, n_gpus, arrivals, rate, seed)
    return {k: (pct(v, 0.5), pct(v, 0.99)) for k, v in waits.items()}


# --------------------------------------------------------------------------- our policy


@dataclass(frozen=True)
class SimConfig:
    """Everything the event-driven simulation of the service is parameterised by.

    `layout`: the pool layout (only workers consuming a duration-class queue
    count as denoise cards; encode/decode workers are ignored).
    `chunk_seconds`: CHUNK_SECONDS, the target GPU time of one chunk.
    `checkpoint_seconds`: save + restore at a chunk boundary (half charged at
    the end of a chunk that is not the last, half at the start of a chunk that
    is not the first).
    `switch_seconds`: charged before a chunk whose model differs from the
    card's previous chunk's model (a card's first chunk is free: warm start).
    `long_cap`: at most this many cards run long-class chunks at once (None:
    no cap); a card at the cap skips the long queue.
    `long_cap_engage_seconds`: engage the cap only while a new long job's
    expected wait (admission's estimate) exceeds this many seconds, i.e. only
    under overload (None: the cap always holds). While it is engaged,
    admission sees the layout with the capped cards not serving `long`.
    `yield_on_demand`: a proposed refinement of the denoise task, not what the
    service does today. At a chunk boundary the worker peeks at the broker and
    re-publishes (yields) only if a message it would take before its own
    continuation is waiting; otherwise it runs the next chunk in-process,
    paying `in_process_seconds` (the checkpoint save kept for crash recovery;
    None: half of `checkpoint_seconds`, a synchronous save; 0: an
    asynchronous save) instead of a save + restore, and no model switch. The
    order of work is the same as with re-publishing.
    `limits`: admission limits (None: admit everything).
    `steps`: steps given to a request of each duration (seconds → steps).
    """

    layout: PoolLayout = field(default_factory=lambda: default_layout(4))
    chunk_seconds: float = DEFAULT_CHUNK_SECONDS
    checkpoint_seconds: float = 0.3
    switch_seconds: float = 1.0
    long_cap: int | None = None
    long_cap_engage_seconds: float | None = None
    yield_on_demand: bool = False
    in_process_seconds: float | None = None
    thresholds: ClassThresholds = field(default_factory=ClassThresholds)
    limits: AdmissionLimits | None = field(default_factory=AdmissionLimits)
    steps: Mapping[float, int] = field(default_factory=lambda: dict(DEFAULT_STEPS))
    models: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_MODELS))

    def steps_for(self, seconds: float) -> int:
        if seconds in self.steps:
            return self.steps[seconds]
        return 50 if seconds >= self.thresholds.medium else 30


def mixed_layout(num_gpus: int = 4, image_only: int = 0) -> PoolLayout:
    """A layout where the first `image_only` cards take short+medium and the rest all three classes.

    `mixed_layout(4, 1)` is the denoise part of `default_layout(4)`;
    `mixed_layout(4, 0)` lets every card take video.
    """
    workers = [WorkerSpec(name=f"gpu{i}", queues=("short", "medium") if i < image_only
                          else ("short", "medium", "long"), devices=(i,)) for i in range(num_gpus)]
    workers.append(WorkerSpec(name="encode", queues=("encode", "control")))
    workers.append(WorkerSpec(name="decode", queues=("decode",)))
    return PoolLayout(tuple(workers))


@dataclass
class _Job:
    id: int
    request: Request
    duration_class: str
    model: str
    steps: int
    step_seconds: float
    priority: int
    steps_done: int = 0
    chunks: int = 0
    running: bool = False
    first_step: float | None = None
    completion: float | None = None

    @property
    def remaining_seconds(self) -> float:
        return (self.steps - self.steps_done) * self.step_seconds


@dataclass
class _Card:
    name: str
    queues: tuple[str, ...]
    idle_since: float = 0.0
    busy_until: float | None = None  # None: idle, blocked on the broker
    job: _Job | None = None
    chunk_steps: int = 0
    last_model: str | None = None
    busy_seconds: float = 0.0
    long_chunks: int = 0


@dataclass
class ClassResult:
    """Per-kind outcome of a simulation."""

    waits: list[float] = field(default_factory=list)  # arrival → first step
    delays: list[float] = field(default_factory=list)  # completion − arrival − service
    refused: int = 0
    accepted: int = 0

    def p(self, metric: str, q: float) -> float:
        return pct(self.waits if metric == "wait" else self.delays, q)


@dataclass
class SimResult:
    """What `simulate` measured."""

    classes: dict[str, ClassResult]
    makespan: float
    utilization: float  # busy card-seconds / (cards × makespan), overheads included
    switches: int
    checkpoints: int
    max_long_cards: int

    def summary(self, metric: str = "wait") -> dict[str, tuple[float, float]]:
        """{kind: (P50, P99)} of `metric` ('wait' or 'delay'), like the seed's table."""
        return {k: (c.p(metric, 0.5), c.p(metric, 0.99)) for k, c in self.classes.items()}


class _Broker:
    """The Redis lists: one FIFO per (queue, priority), popped the way kombu pops them."""

    def __init__(self) -> None:
        self.lists: dict[tuple[str, int], deque[_Job]] = {}

    def publish(self, job: _Job) -> None:
        self.lists.setdefault((job.duration_class, job.priority), deque()).append(job)

    def _first(self, queues: Sequence[str], long_blocked: bool,
               before: tuple[int, int] | None = None) -> tuple[str, int] | None:
        """The (queue, priority) list a worker consuming `queues` pops next: priority-major
        over all its queues, then its queue order. With `before` = (priority, queue index),
        only lists the worker would pop ahead of a message published there now."""
        for priority in range(10):
            for index, queue in enumerate(queues):
                if queue == LONG and long_blocked:
                    continue
                if before is not None and (priority, index) > before:
                    return None
                if self.lists.get((queue, priority)):
                    return queue, priority
        return None

    def pop(self, queues: Sequence[str], long_blocked: bool) -> _Job | None:
        key = self._first(queues, long_blocked)
        return self.lists[key].popleft() if key else None

    def ahead_of(self, queues: Sequence[str], job: _Job, long_blocked: bool) -> bool:
        """Whether a worker would take a waiting message before `job` re-published now
        (FIFO: a waiting message in the same list is ahead of it)."""
        return self._first(queues, long_blocked, (job.priority, queues.index(job.duration_class))) is not None


class _Simulation:
    """One run of the event-driven model; `simulate` is its public face."""

    def __init__(self, requests: Sequence[Request], cfg: SimConfig) -> None:
        self.requests = requests
        self.cfg = cfg
        self.cards = [_Card(w.name, tuple(q for q in w.queues if q in CLASSES))
                      for w in cfg.layout.workers if w.denoises]
        if not self.cards:
            raise ValueError("the layout has no denoise worker")
        self.broker = _Broker()
        self.jobs: dict[int, _Job] = {}  # accepted and not finished, by id
        self.result = {k: ClassResult() for k in KINDS}
        self.switches = self.checkpoints = self.max_long = 0
        # Events: (time, order, sequence, payload); chunk ends (order 0) before arrivals (1).
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = 0
        # A boundary's checkpoint cost is split between the end of a chunk (the save) and the
        # start of the next chunk elsewhere (the restore). With yield_on_demand, the save
        # charged at every chunk end is `in_process_seconds`; a yield costs the rest at resume.
        half = cfg.checkpoint_seconds / 2
        self._save = half if not cfg.yield_on_demand or cfg.in_process_seconds is None \
            else min(cfg.in_process_seconds, cfg.checkpoint_seconds)
        self._restore = cfg.checkpoint_seconds - self._save
        self._engaged_at: float | None = None
        self._engaged = False
        self.engaged_events = 0
        self._capped_layout: PoolLayout | None = None

    # -- helpers ---------------------------------------------------------------------------

    def _running_long(self, exclude: _Card | None = None) -> int:
        return sum(1 for c in self.cards if c is not exclude and c.job is not None
                   and c.job.duration_class == LONG)

    def _cap_engaged(self, now: float) -> bool:
        cfg = self.cfg
        if cfg.long_cap is None:
            return False
        if cfg.long_cap_engage_seconds is None:
            return True
        if self._engaged_at == now:  # cached within one step of one event
            return self._engaged
        new_long = priority_for(LONG, cfg.thresholds.medium, False, cfg.thresholds)
        wait = expected_wait(LONG, new_long, self.work_items(now), cfg.layout)
        self._engaged_at, self._engaged = now, wait > cfg.long_cap_engage_seconds
        if self._engaged:
            self.engaged_events += 1
        return self._engaged

    def _long_blocked(self, card: _Card, now: float) -> bool:
        cap = self.cfg.long_cap
        return cap is not None and self._running_long(exclude=card) >= cap and self._cap_engaged(now)

    def _admission_layout(self, now: float) -> PoolLayout:
        """The layout admission reasons with: with the cap engaged, the first cards beyond
        the cap stop serving `long` (the capacity a long job can count on)."""
        cfg = self.cfg
        if cfg.long_cap is None or not self._cap_engaged(now):
            return cfg.layout
        if self._capped_layout is None:
            excess = sum(1 for c in self.cards if LONG in c.queues) - cfg.long_cap
            workers = []
            for w in cfg.layout.workers:
                if excess > 0 and LONG in w.queues and w.denoises:
                    w = replace(w, queues=tuple(q for q in w.queues if q != LONG))
                    excess -= 1
                workers.append(w)
            self._capped_layout = PoolLayout(tuple(workers))
        return self._capped_layout

    def _start_chunk(self, card: _Card, job: _Job, now: float, in_process: bool = False) -> None:
        """Run the job's next chunk on `card` from `now`, charging the costs the service pays."""
        cfg = self.cfg
        k = min(steps_per_chunk(cfg.chunk_seconds, job.step_seconds), job.steps - job.steps_done)
        overhead = 0.0
        if card.last_model is not None and card.last_model != job.model:
            overhead += cfg.switch_seconds
            self.switches += 1
        if job.steps_done > 0 and not in_process:
            overhead += self._restore
        if job.first_step is None:
            job.first_step = now + overhead
        last = job.steps_done + k >= job.steps
        duration = overhead + k * job.step_seconds + (0.0 if last else self._save)
        card.busy_until = now + duration
        card.busy_seconds += duration
        card.job, card.chunk_steps, card.last_model = job, k, job.model
        job.running = True
        if job.duration_class == LONG:
            self.max_long = max(self.max_long, self._running_long())
        heapq.heappush(self.events, (card.busy_until, 0, self.seq, self.cards.index(card)))
        self.seq += 1

    def _dispatch(self, now: float) -> None:
        """Idle workers pop, the one blocked longest first (Redis serves BRPOP clients FIFO)."""
        for card in sorted((c for c in self.cards if c.job is None), key=lambda c: c.idle_since):
            job = self.broker.pop(card.queues, self._long_blocked(card, now))
            if job is not None:
                self._start_chunk(card, job, now)

    def work_items(self, now: float) -> list[WorkItem]:
        """What admission sees: every accepted, unfinished job, queued or running."""
        running = {c.job.id: c for c in self.cards if c.job is not None}
        items = []
        for job in self.jobs.values():
            card = running.get(job.id)
            if card is None:
                items.append(WorkItem(job.duration_class, job.priority, job.remaining_seconds))
                continue
            assert card.busy_until is not None
            in_chunk = max(0.0, card.busy_until - now)
            after = (job.steps - job.steps_done - card.chunk_steps) * job.step_seconds
            items.append(WorkItem(job.duration_class, job.priority, after + in_chunk,
                                  running=True, chunk_remaining_seconds=in_chunk))
        return items

    # -- events ----------------------------------------------------------------------------

    def _chunk_end(self, card: _Card, now: float) -> None:
        job = card.job
        assert job is not None
        job.steps_done += card.chunk_steps
        job.chunks += 1
        job.running = False
        card.busy_until, card.job, card.idle_since = None, None, now
        if job.steps_done >= job.steps:
            job.completion = now
            del self.jobs[job.id]
            res = self.result[job.request.kind]
            assert job.first_step is not None
            res.waits.append(job.first_step - job.request.arrival)
            res.delays.append(now - job.request.arrival - job.request.seconds)
            return
        self.checkpoints += 1
        job.priority = priority_for(job.duration_class, job.remaining_seconds, True, self.cfg.thresholds)
        if not self.cfg.yield_on_demand:
            self.broker.publish(job)
        elif not self.broker.ahead_of(card.queues, job, self._long_blocked(card, now)):
            self._start_chunk(card, job, now, in_process=True)
        else:
            self.broker.publish(job)

    def _arrival(self, index: int, now: float) -> None:
        cfg = self.cfg
        r = self.requests[index]
        cls = cfg.thresholds.classify(r.seconds)
        priority = priority_for(cls, r.seconds, False, cfg.thresholds)
        if cfg.limits is not None:
            decision = decide(cls, priority, self.work_items(now), self._admission_layout(now), cfg.limits)
            if not decision.accepted:
                self.result[r.kind].refused += 1
                return
        self.result[r.kind].accepted += 1
        steps = cfg.steps_for(r.seconds)
        job = _Job(id=index, request=r, duration_class=cls, model=cfg.models[r.kind], steps=steps,
                   step_seconds=r.seconds / steps, priority=priority)
        self.jobs[job.id] = job
        self.broker.publish(job)

    def run(self) -> SimResult:
        for index, r in enumerate(self.requests):
            heapq.heappush(self.events, (r.arrival, 1, index, index))
        self.seq = len(self.requests)
        now = 0.0
        while self.events:
            now, order, _, payload = heapq.heappop(self.events)
            self._engaged_at = None  # the state changes with every event
            if order == 0:
                self._chunk_end(self.cards[payload], now)
            else:
                self._arrival(payload, now)
            self._engaged_at = None
            self._dispatch(now)
        busy = sum(c.busy_seconds for c in self.cards)
        return SimResult(classes=self.result, makespan=now,
                         utilization=busy / (len(self.cards) * now) if now > 0 else 0.0,
                         switches=self.switches, checkpoints=self.checkpoints, max_long_cards=self.max_long)


def simulate(requests: Sequence[Request], config: SimConfig | None = None) -> SimResult:
    """Run the service's scheduling policy on `requests` (sorted by arrival)."""
    return _Simulation(requests, config or SimConfig()).run()


def simulate_rate(rate: float, config: SimConfig | None = None, arrivals: int = 400,
                  seed: int = 0) -> SimResult:
    """`simulate` on the seed's workload at `rate`."""
    return simulate(seed_workload(arrivals, rate, seed), config)
