"""Discrete-event simulation of the scheduling policy, on the seed chapter's workload.

Two simulators live here:

* `seed_simulate` / `seed_waits`: a faithful port of the seed chapter's
  `simulate()` (FCFS, SJF and static pools; non-preemptive, one request per
  card), with its loop, its generator and its percentile, so that its table
  (images P50/P99 FCFS 17/473 s, SJF 2/90 s, pools 0/7 s; videos 19/423,
  23/614, 152/745 s) comes out exactly.
* `simulate`: an event-driven model of the live service that calls the
  scheduling core the service uses: `ClassThresholds.classify` for the
  duration class (= queue), `priority_for` for every message's priority,
  `chunking.steps_per_chunk` for the chunk length, the `PoolLayout` for which
  card consumes which queues in which order, and `admission.decide` on every
  arrival. A card takes the next message by kombu's Redis semantics
  (priority-major over all its queues, then its queue order, FIFO within one
  (queue, priority) list; of several idle cards the one blocked longest gets
  a new message, as Redis serves BRPOP clients), runs one chunk, re-publishes
  the job's next chunk with `priority_for(..., started=True)` and goes back to
  the broker (chunk-level preemption). It charges a checkpoint save + restore
  at every chunk boundary and a model switch whenever a card runs a chunk of
  another model than its previous chunk's. A worker with k devices is a card
  group (sequence parallelism): it runs one job at a time, `group_speedup(k)`
  times faster than one card (a step of S single-card seconds takes
  S / speedup there).
* `group_table` / `group_layouts` / `simulate_groups`: the seed's "several
  cards" trade-off (one request per card or per group of cards) as its
  closed-form table and as layouts run through `simulate` on a video workload.

Two metrics per class:

* `wait`: arrival → first denoising step (the seed's metric; a model switch
  before the first step counts).
* `delay`: completion − arrival − service seconds (the honest metric for a
  preemptive system: every second a job is not computing its own steps,
  including preemption by other work, checkpoints and model switches).

Plain Python, no Django, deterministic for a given workload and config.
"""
from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Literal, Mapping, Sequence

from .admission import AdmissionLimits, WorkItem, decide, expected_wait
from .chunking import DEFAULT_CHUNK_SECONDS, steps_per_chunk
from .classes import CLASSES, LONG, MEDIUM, SHORT, ClassThresholds, priority_for
from .pools import (
    CONTROL, DECODE, ENCODE, GROUP_EFFICIENCY, INTERACTIVE, PoolLayout, WorkerSpec, class_of, default_layout,
    group_speedup,
)

IMAGE, VIDEO = "image", "video"
KINDS: tuple[str, ...] = (IMAGE, VIDEO)
SeedPolicy = Literal["fcfs", "sjf", "pools"]
SEED_POLICIES: tuple[SeedPolicy, ...] = ("fcfs", "sjf", "pools")
Metric = Literal["wait", "delay"]

# The seed's durations, and the steps we give them: an image is 20-30 steps
# (0.1-0.2 s each, one chunk at the default chunk length or two for a 6-s one),
# a video 50 steps (2.4 s or 6 s each).
IMAGE_SECONDS: tuple[float, ...] = (2.0, 3.0, 6.0)
VIDEO_SECONDS: tuple[float, ...] = (120.0, 300.0)
DEFAULT_STEPS: Mapping[float, int] = {2.0: 20, 3.0: 30, 6.0: 30, 120.0: 50, 300.0: 50}
DEFAULT_MODELS: Mapping[str, str] = {IMAGE: "sdxl", VIDEO: "wan"}

# Modelled costs (seconds of card time). A checkpoint of a Wan 480p job (latents
# 16×21×60×104 fp32 plus a two-entry multistep history, 25 MB) saved atomically and
# loaded back took 0.05 s on local disk (bench notes in docs/BENCHMARKS.md); with the
# task round trip and host↔device copies, 0.2 s is a conservative save + restore.
# A model switch costs ~0 when both models stay resident on the card and ~0.2 s
# (SDXL UNet, 5 GB) to ~1.1 s (Wan 14B, 29 GB) when weights come from pinned host
# memory; 0.5 s is charged per switch. docs/BENCHMARKS.md shows the sensitivity.
DEFAULT_CHECKPOINT_SECONDS = 0.2
DEFAULT_SWITCH_SECONDS = 0.5
# Our policy lends every card to video and caps long work at N−1 cards only under
# overload: while a new long job's expected wait exceeds this share of its limit.
OVERLOAD_ENGAGE_SHARE = 0.5


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Request:
    """One arrival of the seed's workload."""

    arrival: float
    kind: str  # IMAGE | VIDEO
    seconds: float  # expected (in the simulation also actual) denoising seconds
    lane: str = ""  # the lane it was submitted with ("interactive"), routed like the service does


def seed_workload(arrivals: int = 400, rate: float = 0.06, seed: int = 0) -> list[Request]:
    """The seed chapter's generator, draw for draw.

    Poisson arrivals at `rate` per second; 80 % images of 2, 3 or 6 s, 20 %
    videos of 120 or 300 s. The same `seed` gives the chapter's requests.
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


def offered_load(rate: float, n_cards: int = 4) -> float:
    """Expected work offered per second by the seed's mix at `rate`, as a share of `n_cards`."""
    mean_seconds = 0.8 * sum(IMAGE_SECONDS) / len(IMAGE_SECONDS) + 0.2 * sum(VIDEO_SECONDS) / len(VIDEO_SECONDS)
    return rate * mean_seconds / n_cards


def pct(xs: Iterable[float], q: float) -> float:
    """The seed's percentile: element int(q·n) of the sorted values (0 if there are none)."""
    values = sorted(xs)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


# --------------------------------------------------------------------------- the seed's policies


def seed_waits(policy: SeedPolicy, n_gpus: int = 4, arrivals: int = 400, rate: float = 0.06,
               seed: int = 0) -> dict[str, list[float]]:
    """Every request's queueing wait (seconds) under one of the seed's policies, per kind.

    The chapter's `simulate()` loop: requests that have arrived by `now` enter
    a heap keyed by arrival ('fcfs', 'pools') or by duration ('sjf'); the
    earliest-free card pops the heap only when it is free at `now`, otherwise
    time advances to that card's free time or to the next arrival. 'pools'
    runs images on 1 card and videos on the other n_gpus − 1. Non-preemptive
    and without overheads, so the wait is also completion − arrival − service.
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


# --------------------------------------------------------------------------- the service's policy


def mixed_layout(num_gpus: int = 4, image_only: int = 0) -> PoolLayout:
    """Cards 0..image_only-1 take short+medium, the others short+medium+long; plus encode/decode.

    `mixed_layout(4, 1)` has the denoise workers of `default_layout(4)`;
    `mixed_layout(4, 0)` lends every card to video.
    """
    if not 0 <= image_only <= num_gpus:
        raise ValueError(f"image_only must be within 0..{num_gpus}, got {image_only}")
    workers = [WorkerSpec(name=f"gpu{i}", devices=(i,),
                          queues=(SHORT, MEDIUM) if i < image_only else (SHORT, MEDIUM, LONG))
               for i in range(num_gpus)]
    workers.append(WorkerSpec(name="encode", queues=(ENCODE, CONTROL)))
    workers.append(WorkerSpec(name="decode", queues=(DECODE,)))
    return PoolLayout(tuple(workers))


@dataclass(frozen=True)
class SimConfig:
    """What the event-driven model of the service is parameterised by.

    layout: the pool layout; only workers consuming a duration-class queue are
        denoise cards (encode/decode workers are ignored).
    chunk_seconds: CHUNK_SECONDS, the target GPU time of one chunk.
    checkpoint_seconds: save + restore at a chunk boundary; the save is charged
        at the end of a chunk that is not the last, the restore at the start of
        the next chunk.
    switch_seconds: charged before a chunk whose model differs from the card's
        previous chunk's (a card's first chunk is free: warm start).
    long_cap: at most this many cards run long-class chunks at once (None: no
        cap); a card at the cap does not take from the long queue.
    long_cap_engage_seconds: engage the cap only while a new long job's expected
        wait (admission's estimate over the full layout) exceeds this (None: the
        cap always holds). While engaged, admission sees the layout without
        `long` on the cards beyond the cap: the capacity a long job can count on.
    yield_on_demand: a proposed refinement of the denoise task, not what the
        service does today. At a chunk boundary the worker looks at the broker
        and re-publishes (yields) only if a message it would take before its
        own continuation is waiting (or the long cap asks it to stop); otherwise
        it runs the next chunk in-process with no restore and no model switch,
        paying `in_process_seconds` for the save kept for crash recovery (None:
        a synchronous save, half of `checkpoint_seconds`; 0: an asynchronous
        one). A yield costs a full save + restore. The order of work is the
        same as with re-publishing every chunk.
    limits: admission limits (None: admit everything).
    steps: steps given to a request of each duration (seconds → steps).
    models: the model of each kind (a change of model on a card is a switch).
    """

    layout: PoolLayout = field(default_factory=lambda: default_layout(4))
    chunk_seconds: float = DEFAULT_CHUNK_SECONDS
    checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS
    switch_seconds: float = DEFAULT_SWITCH_SECONDS
    long_cap: int | None = None
    long_cap_engage_seconds: float | None = None
    yield_on_demand: bool = False
    in_process_seconds: float | None = None
    thresholds: ClassThresholds = field(default_factory=ClassThresholds)
    limits: AdmissionLimits | None = field(default_factory=AdmissionLimits)
    steps: Mapping[float, int] = field(default_factory=lambda: dict(DEFAULT_STEPS))
    models: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_MODELS))

    def __post_init__(self) -> None:
        if self.chunk_seconds <= 0:
            raise ValueError(f"chunk_seconds must be positive, got {self.chunk_seconds}")
        if self.checkpoint_seconds < 0 or self.switch_seconds < 0:
            raise ValueError("checkpoint_seconds and switch_seconds must be >= 0")
        if self.in_process_seconds is not None and not 0 <= self.in_process_seconds <= self.checkpoint_seconds:
            raise ValueError("in_process_seconds must be within 0..checkpoint_seconds")
        if self.long_cap is not None and self.long_cap < 0:
            raise ValueError(f"long_cap must be >= 0, got {self.long_cap}")

    def steps_for(self, seconds: float) -> int:
        if seconds in self.steps:
            return self.steps[seconds]
        return 50 if seconds >= self.thresholds.medium else 30


def service_policy_config(num_gpus: int = 4, *, yield_on_demand: bool = False, **overrides: Any) -> SimConfig:
    """The service's scheduling policy as deployed, with its chosen defaults
    (docs/BENCHMARKS.md, "Scheduling policy (simulator)").

    Every card consumes short, medium and long (the image card is lent to
    video), CHUNK_SECONDS = `chunking.DEFAULT_CHUNK_SECONDS`, and under overload
    (a new long job's expected wait above half the long admission limit) at
    most N−1 cards run long work. `yield_on_demand` adds the proposed
    denoise-task refinement with an asynchronous in-process save.
    """
    limits = overrides.get("limits", AdmissionLimits())
    long_limit = limits.long if limits is not None else AdmissionLimits().long
    params: dict[str, Any] = dict(
        layout=mixed_layout(num_gpus, 0),
        chunk_seconds=DEFAULT_CHUNK_SECONDS,
        long_cap=max(1, num_gpus - 1),
        long_cap_engage_seconds=OVERLOAD_ENGAGE_SHARE * long_limit,
        yield_on_demand=yield_on_demand,
        in_process_seconds=0.0 if yield_on_demand else None,
    )
    params.update(overrides)
    return SimConfig(**params)


@dataclass(eq=False)
class _Job:
    id: int
    request: Request
    duration_class: str
    queue: str  # the broker queue, `PoolLayout.queue_for` (class, lane or dedicated model)
    model: str
    steps: int
    step_seconds: float
    priority: int  # of its current (or next) message
    steps_done: int = 0
    first_step: float | None = None

    @property
    def remaining_seconds(self) -> float:
        return (self.steps - self.steps_done) * self.step_seconds


@dataclass(eq=False)
class _Card:
    index: int
    name: str
    queues: tuple[str, ...]  # the denoise queues it consumes (class, lane or model queues), in order
    idle_since: float = 0.0
    busy_until: float = 0.0
    job: _Job | None = None  # None: idle, blocked on the broker
    chunk_steps: int = 0
    last_model: str | None = None
    busy_seconds: float = 0.0
    speedup: float = 1.0  # a group of k cards: group_speedup(k)


@dataclass
class ClassResult:
    """One kind's outcome: per finished job, its wait and its delay."""

    waits: list[float] = field(default_factory=list)  # arrival → first step
    delays: list[float] = field(default_factory=list)  # completion − arrival − service
    latencies: list[float] = field(default_factory=list)  # completion − arrival
    accepted: int = 0
    refused: int = 0

    def p(self, metric: Metric, q: float) -> float:
        return pct(self.waits if metric == "wait" else self.delays, q)


@dataclass
class SimResult:
    """What one run of `simulate` measured."""

    classes: dict[str, ClassResult]
    makespan: float
    utilization: float  # busy card-seconds (overheads included) / (cards × makespan)
    switches: int  # model switches
    republished: int  # boundaries that paid a full save + restore
    in_process: int  # boundaries run on in-process (yield_on_demand)
    max_long_cards: int  # most cards running long work at once
    cap_engaged_share: float  # share of events at which the overload cap was engaged
    lanes: dict[str, ClassResult] = field(default_factory=dict)  # per request lane ("" = none)

    def summary(self, metric: Metric = "wait") -> dict[str, tuple[float, float]]:
        """{kind: (P50, P99)} of `metric`, like the seed's table."""
        return {k: (c.p(metric, 0.5), c.p(metric, 0.99)) for k, c in self.classes.items()}


class _Broker:
    """The Redis lists: one FIFO per (queue, priority), popped the way kombu pops them."""

    def __init__(self) -> None:
        self.lists: dict[tuple[str, int], deque[_Job]] = {}

    def publish(self, job: _Job) -> None:
        self.lists.setdefault((job.queue, job.priority), deque()).append(job)

    def _first(self, queues: Sequence[str], long_blocked: bool,
               before: tuple[int, int] | None = None) -> tuple[str, int] | None:
        """The (queue, priority) list a worker consuming `queues` pops next: priority-major
        over all its queues, then its queue order. With `before` = (priority, queue index):
        only a list it would pop ahead of a message published there now."""
        for priority in range(10):
            for index, queue in enumerate(queues):
                if long_blocked and class_of(queue) == LONG:
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
        """Whether the worker would take a waiting message before `job` re-published now
        (FIFO: a message already waiting in the same list is ahead of it)."""
        before = (job.priority, queues.index(job.queue))
        return self._first(queues, long_blocked, before) is not None


class _Simulation:
    """One run of the event-driven model; `simulate` is its public face."""

    def __init__(self, requests: Sequence[Request], cfg: SimConfig) -> None:
        self.requests = requests
        self.cfg = cfg
        denoisers = [w for w in cfg.layout.workers if w.denoises]
        if not denoisers:
            raise ValueError("the layout has no denoise worker")
        self.cards = [_Card(i, w.name, tuple(q for q in w.consumed_queues() if class_of(q) in CLASSES),
                            speedup=group_speedup(w.group_size))
                      for i, w in enumerate(denoisers)]
        self.broker = _Broker()
        self.jobs: dict[int, _Job] = {}  # accepted and unfinished, by id
        self.result = {k: ClassResult() for k in KINDS}
        self.lane_result: dict[str, ClassResult] = {}
        self.switches = self.republished = self.in_process = self.max_long = 0
        self.events: list[tuple[float, int, int, int]] = []  # (time, order, seq, payload)
        self.seq = 0
        # A boundary's save is charged at the end of the chunk, its restore at the start
        # of the next one; with yield_on_demand the end pays the in-process save and a
        # yield pays the rest of a full save + restore when the job resumes.
        half = cfg.checkpoint_seconds / 2
        if cfg.yield_on_demand and cfg.in_process_seconds is not None:
            self.save_seconds = cfg.in_process_seconds
        else:
            self.save_seconds = half
        self.restore_seconds = cfg.checkpoint_seconds - self.save_seconds
        self._engaged_cache: tuple[float, bool] | None = None
        self._engaged_checks = self._engaged_hits = 0
        self._capped_layout: PoolLayout | None = None

    # -- the long cap --------------------------------------------------------------------

    def _running_long(self, exclude: _Card | None = None) -> int:
        return sum(1 for c in self.cards if c is not exclude and c.job is not None
                   and c.job.duration_class == LONG)

    def _cap_engaged(self, now: float) -> bool:
        cfg = self.cfg
        if cfg.long_cap is None:
            return False
        if cfg.long_cap_engage_seconds is None:
            return True
        if self._engaged_cache is not None and self._engaged_cache[0] == now:
            return self._engaged_cache[1]
        new_long = priority_for(LONG, cfg.thresholds.medium, False, cfg.thresholds)
        engaged = expected_wait(LONG, new_long, self.work_items(now), cfg.layout) > cfg.long_cap_engage_seconds
        self._engaged_cache = (now, engaged)
        return engaged

    def _long_blocked(self, card: _Card, now: float) -> bool:
        cap = self.cfg.long_cap
        return cap is not None and self._running_long(exclude=card) >= cap and self._cap_engaged(now)

    def _admission_layout(self, now: float) -> PoolLayout:
        cfg = self.cfg
        if cfg.long_cap is None or not self._cap_engaged(now):
            return cfg.layout
        if self._capped_layout is None:
            excess = sum(1 for c in self.cards if any(class_of(q) == LONG for q in c.queues)) - cfg.long_cap
            workers = []
            for w in cfg.layout.workers:
                if excess > 0 and w.denoises and LONG in w.queues:
                    w = replace(w, queues=tuple(q for q in w.queues if q != LONG))
                    excess -= 1
                workers.append(w)
            self._capped_layout = PoolLayout(tuple(workers))
        return self._capped_layout

    # -- cards and admission -------------------------------------------------------------

    def _start_chunk(self, card: _Card, job: _Job, now: float, in_process: bool = False) -> None:
        """Run the job's next chunk on `card` from `now`, charging what the service pays."""
        cfg = self.cfg
        step_seconds = job.step_seconds / card.speedup  # wall seconds of one step on this card (group)
        k = min(steps_per_chunk(cfg.chunk_seconds, step_seconds), job.steps - job.steps_done)
        overhead = 0.0
        if card.last_model is not None and card.last_model != job.model:
            overhead += cfg.switch_seconds
            self.switches += 1
        if job.steps_done > 0 and not in_process:
            overhead += self.restore_seconds
        if job.first_step is None:
            job.first_step = now + overhead
        last = job.steps_done + k >= job.steps
        duration = overhead + k * step_seconds + (0.0 if last else self.save_seconds)
        card.job, card.chunk_steps, card.last_model = job, k, job.model
        card.busy_until = now + duration
        card.busy_seconds += duration
        if job.duration_class == LONG:
            self.max_long = max(self.max_long, self._running_long())
        heapq.heappush(self.events, (card.busy_until, 0, self.seq, card.index))
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
                items.append(WorkItem(job.queue, job.priority, job.remaining_seconds))
                continue
            in_chunk = max(0.0, card.busy_until - now)
            after = (job.steps - job.steps_done - card.chunk_steps) * job.step_seconds
            items.append(WorkItem(job.queue, job.priority, after + in_chunk,
                                  running=True, chunk_remaining_seconds=in_chunk))
        return items

    # -- events --------------------------------------------------------------------------

    def _chunk_end(self, card: _Card, now: float) -> None:
        job = card.job
        assert job is not None
        job.steps_done += card.chunk_steps
        card.job, card.idle_since = None, now
        if job.steps_done >= job.steps:
            del self.jobs[job.id]
            res = self.result[job.request.kind]
            assert job.first_step is not None
            res.waits.append(job.first_step - job.request.arrival)
            res.delays.append(now - job.request.arrival - job.request.seconds)
            res.latencies.append(now - job.request.arrival)
            lane = self.lane_result.setdefault(job.request.lane, ClassResult())
            lane.waits.append(res.waits[-1])
            lane.delays.append(res.delays[-1])
            lane.latencies.append(res.latencies[-1])
            return
        job.priority = priority_for(job.duration_class, job.remaining_seconds, True, self.cfg.thresholds)
        if self.cfg.yield_on_demand:
            blocked = self._long_blocked(card, now)
            must_stop = job.duration_class == LONG and blocked
            if not must_stop and not self.broker.ahead_of(card.queues, job, blocked):
                self.in_process += 1
                self._start_chunk(card, job, now, in_process=True)
                return
        self.republished += 1
        self.broker.publish(job)

    def _arrival(self, index: int, now: float) -> None:
        cfg = self.cfg
        r = self.requests[index]
        cls = cfg.thresholds.classify(r.seconds)
        priority = priority_for(cls, r.seconds, False, cfg.thresholds)
        queue = cfg.layout.queue_for(cls, cfg.models[r.kind], r.lane)
        if cfg.limits is not None:
            decision = decide(queue, priority, self.work_items(now), self._admission_layout(now), cfg.limits)
            if not decision.accepted:
                self.result[r.kind].refused += 1
                return
        self.result[r.kind].accepted += 1
        steps = cfg.steps_for(r.seconds)
        job = _Job(id=index, request=r, duration_class=cls, queue=queue, model=cfg.models[r.kind], steps=steps,
                   step_seconds=r.seconds / steps, priority=priority)
        self.jobs[job.id] = job
        self.broker.publish(job)

    def run(self) -> SimResult:
        for index, r in enumerate(self.requests):
            heapq.heappush(self.events, (r.arrival, 1, index, index))  # chunk ends (0) go first
        self.seq = len(self.requests)
        now = 0.0
        while self.events:
            now, order, _, payload = heapq.heappop(self.events)
            self._engaged_cache = None  # every event changes the state
            if order == 0:
                self._chunk_end(self.cards[payload], now)
            else:
                self._arrival(payload, now)
            self._engaged_cache = None
            self._dispatch(now)
            if self.cfg.long_cap is not None:
                self._engaged_checks += 1
                self._engaged_hits += self._cap_engaged(now)
        busy = sum(c.busy_seconds for c in self.cards)
        return SimResult(
            classes=self.result, makespan=now,
            utilization=busy / (len(self.cards) * now) if now > 0 else 0.0,
            switches=self.switches, republished=self.republished, in_process=self.in_process,
            max_long_cards=self.max_long,
            cap_engaged_share=self._engaged_hits / self._engaged_checks if self._engaged_checks else 0.0,
            lanes=self.lane_result,
        )


def simulate(requests: Sequence[Request], config: SimConfig | None = None) -> SimResult:
    """Run the service's scheduling policy on `requests` (sorted by arrival)."""
    if any(b.arrival < a.arrival for a, b in zip(requests, requests[1:])):
        raise ValueError("requests must be sorted by arrival")
    return _Simulation(requests, config or SimConfig()).run()


def simulate_rate(rate: float, config: SimConfig | None = None, arrivals: int = 400,
                  seed: int = 0) -> SimResult:
    """`simulate` on the seed's workload at `rate`."""
    return simulate(seed_workload(arrivals, rate, seed), config)


# --------------------------------------------------------------------------- card groups

SEED_VIDEO_SECONDS = 25 * 60.0  # the seed's 5-second 720p Wan video: 25 minutes on one card


@dataclass(frozen=True)
class GroupRow:
    """One line of the seed's "several cards" table: `cards` split into groups of `group`."""

    group: int  # cards per group
    groups: int  # groups on the machine
    latency_minutes: float  # one video, alone on a group
    videos_per_hour: float  # the whole machine, every group busy


def group_table(single_seconds: float = SEED_VIDEO_SECONDS, cards: int = 8) -> list[GroupRow]:
    """The seed's closed-form table: latency = single / (k × eff), throughput = cards / k / latency.

    One row per group size of `GROUP_EFFICIENCY` that divides `cards`; with the
    defaults: 25.0 min / 19.2 videos/h (k=1), 13.2 / 18.2, 7.1 / 16.9, 3.9 / 15.4 (k=8).
    """
    rows = []
    for k in sorted(GROUP_EFFICIENCY):
        if k > cards or cards % k:
            continue
        latency = single_seconds / group_speedup(k)
        rows.append(GroupRow(k, cards // k, latency / 60, cards / k / latency * 3600))
    return rows


def group_layout(groups: Sequence[int], group_lane: str = "") -> PoolLayout:
    """A layout of denoise workers, one per entry of `groups` (its card count), on consecutive
    devices, every one consuming short, medium and long; plus encode/decode on the CPU.
    With `group_lane`, the groups (k > 1) serve only that lane (as `default_layout(group_cards=k)`
    does), the single cards everything else."""
    workers, first = [], 0
    for i, k in enumerate(groups):
        group_speedup(k)  # refuse an unknown group size here, not mid-simulation
        workers.append(WorkerSpec(name=f"g{i}x{k}", queues=(SHORT, MEDIUM, LONG),
                                  devices=tuple(range(first, first + k)), lane=group_lane if k > 1 else ""))
        first += k
    workers.append(WorkerSpec(name="encode", queues=(ENCODE, CONTROL)))
    workers.append(WorkerSpec(name="decode", queues=(DECODE,)))
    return PoolLayout(tuple(workers))


def group_layouts(cards: int = 8) -> dict[str, PoolLayout]:
    """The layouts compared for `cards` cards: every uniform split, and the seed's pooled one
    (one group of half the cards beside single cards; "two groups of 4 serving interactive
    requests and the rest ... a card at a time" scaled to one machine)."""
    layouts = {f"{cards // k}×{k}": group_layout([k] * (cards // k))
               for k in sorted(GROUP_EFFICIENCY) if k <= cards and cards % k == 0}
    half = cards // 2
    if half in GROUP_EFFICIENCY and half > 1:
        layouts[f"pooled: 1×{half} + {cards - half}×1"] = group_layout([half] + [1] * (cards - half))
        layouts[f"pooled, routed: 1×{half} {INTERACTIVE} + {cards - half}×1"] = group_layout(
            [half] + [1] * (cards - half), group_lane=INTERACTIVE)
    return layouts


def video_workload(arrivals: int = 400, rate: float = 0.7 * 8 / SEED_VIDEO_SECONDS, seed: int = 0,
                   seconds: float = SEED_VIDEO_SECONDS, interactive_share: float = 0.0) -> list[Request]:
    """Poisson arrivals at `rate` per second of videos of `seconds` single-card seconds each
    (the default rate offers 70 % of 8 single cards). A share `interactive_share` of them is
    submitted on the interactive lane (drawn from a second generator, so the arrivals are the
    same whatever the share)."""
    rng, lanes = random.Random(seed), random.Random(seed + 1)
    t, requests = 0.0, []
    for _ in range(arrivals):
        t += rng.expovariate(rate)
        lane = INTERACTIVE if lanes.random() < interactive_share else ""
        requests.append(Request(t, VIDEO, seconds, lane))
    return requests


@dataclass(frozen=True)
class GroupResult:
    """One layout on the video workload."""

    layout: str
    capacity_per_hour: float  # videos/hour with every worker busy
    load: float  # offered work / capacity
    p50_minutes: float  # completion − arrival
    p99_minutes: float
    videos_per_hour: float  # finished / (last completion − first arrival)
    interactive_p50_minutes: float = 0.0  # the requests submitted on the interactive lane
    interactive_p99_minutes: float = 0.0
    other_p50_minutes: float = 0.0  # the others (offline)
    other_p99_minutes: float = 0.0


def simulate_groups(cards: int = 8, load: float = 0.7, arrivals: int = 400, seed: int = 0,
                    single_seconds: float = SEED_VIDEO_SECONDS,
                    interactive_share: float = 0.4) -> list[GroupResult]:
    """Every layout of `group_layouts(cards)` on one video workload offering `load` of `cards`
    single cards: latency P50/P99 (minutes, arrival → completion) and throughput, overall and
    for the `interactive_share` of requests submitted on the interactive lane and the others.

    Everything is admitted (no admission limits, no long cap), so the layouts are
    compared on the same requests; checkpoint costs are the defaults. In every layout but
    the routed one all workers consume the same queue (the lane has no worker, so its
    requests go to the class queue, as in the service), idle workers popping the way
    Redis serves them (the one blocked longest first): the unrouted pooled layout's group
    takes whichever video comes when it is the longest idle. In the routed one the group
    serves only the interactive lane and the single cards the rest.
    """
    rate = load * cards / single_seconds
    requests = video_workload(arrivals, rate, seed, single_seconds, interactive_share)
    results = []
    for name, layout in group_layouts(cards).items():
        cfg = SimConfig(layout=layout, limits=None, steps={single_seconds: 50})
        run = simulate(requests, cfg)
        res = run.classes[VIDEO]
        capacity = sum(group_speedup(w.group_size) for w in layout.workers if w.denoises) * 3600 / single_seconds
        span = run.makespan - requests[0].arrival  # the last event is the last completion
        lanes = {lane: r.latencies for lane, r in run.lanes.items()}
        fast, rest = lanes.get(INTERACTIVE, []), lanes.get("", [])
        results.append(GroupResult(name, capacity, rate * 3600 / capacity, pct(res.latencies, 0.5) / 60,
                                   pct(res.latencies, 0.99) / 60, len(res.latencies) / span * 3600,
                                   pct(fast, 0.5) / 60, pct(fast, 0.99) / 60, pct(rest, 0.5) / 60,
                                   pct(rest, 0.99) / 60))
    return results



__all__ = [
    "IMAGE", "VIDEO", "KINDS", "SEED_POLICIES", "Request", "seed_workload", "offered_load", "pct",
    "seed_waits", "seed_simulate", "mixed_layout", "SimConfig", "service_policy_config", "ClassResult",
    "SimResult", "simulate", "simulate_rate", "DEFAULT_CHECKPOINT_SECONDS", "DEFAULT_SWITCH_SECONDS",
    "SEED_VIDEO_SECONDS", "GroupRow", "group_table", "group_layout", "group_layouts", "video_workload",
    "GroupResult", "simulate_groups",
]
