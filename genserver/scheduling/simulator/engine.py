"""The event-driven model of the live service: cards taking chunks from kombu-ordered Redis lists.

It calls the scheduling core the service uses: `ClassThresholds.classify` for
the duration class (= queue), `priority_for` for every message's priority,
`chunking.steps_per_chunk` for the chunk length, the `PoolLayout` for which card
consumes which queues in which order, and `admission.decide` on every arrival.

Over 400 lines because it is one event loop (`_Simulation`) whose handlers share its state; the policy
it models lives in the scheduling core it calls, and the parameters in service_policy.py.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..admission import CALM, AdmissionLimits, Headwind, WorkItem, decide, expected_wait, headwind
from ..chunking import steps_per_chunk
from ..classes import CLASSES, LONG, priority_for, yields_to_equal_priority
from ..fairness import FairWindow, ahead_priority, next_held, release_key
from ..overload import capped_layout
from ..pools import PoolLayout, class_of, group_speedup
from .service_policy import SimConfig
from .workload import KINDS, Request, pct, seed_workload

Metric = Literal["wait", "delay"]


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
    windowed: bool = False  # published and not yet started: counts in its user's fair window
    ahead: bool = False  # published one step ahead as the lightest user's (fairness.ahead_priority)

    @property
    def fair_key(self) -> tuple[str, str]:
        return (self.request.user, self.queue)

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
    resident: OrderedDict[str, float] = field(default_factory=OrderedDict)  # model → GiB, least recently used first
    busy_seconds: float = 0.0
    speedup: float = 1.0  # a group of k cards: group_speedup(k)
    steps_from: float = 0.0  # when the running chunk's first step begins (after its restore or switch)
    step_wall: float = 0.0  # wall seconds of one step of the running chunk
    cut: bool = False  # the running chunk was cut short for a better message (SimConfig.cut_chunks)


@dataclass
class ClassResult:
    """One kind's outcome: per finished job, its wait and its delay."""

    waits: list[float] = field(default_factory=list)  # arrival → first step
    delays: list[float] = field(default_factory=list)  # completion − arrival − service
    latencies: list[float] = field(default_factory=list)  # completion − arrival
    ends: list[float] = field(default_factory=list)  # completion times
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
    users: dict[str, ClassResult] = field(default_factory=dict)  # per request user ("" = none)
    max_held: int = 0  # most jobs held by the fair window at once
    cuts: int = 0  # chunks cut short for a job placed ahead (SimConfig.cut_chunks)

    def summary(self, metric: Metric = "wait") -> dict[str, tuple[float, float]]:
        """{kind: (P50, P99)} of `metric`, like the seed's table."""
        return {k: (c.p(metric, 0.5), c.p(metric, 0.99)) for k, c in self.classes.items()}


class _Broker:
    """The Redis lists: one FIFO per (queue, priority), popped the way kombu pops them."""

    def __init__(self) -> None:
        self.lists: dict[tuple[str, int], deque[_Job]] = {}

    def publish(self, job: _Job) -> None:
        self.lists.setdefault((job.queue, job.priority), deque()).append(job)

    def _first(
        self, queues: Sequence[str], long_blocked: bool, before: tuple[int, int] | None = None
    ) -> tuple[str, int] | None:
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
        (FIFO: a message already waiting in the same list is ahead of it), counting a message at the
        job's own priority only where `yields_to_equal_priority` says (the denoise task's yield test)."""
        if yields_to_equal_priority(job.duration_class):
            before = (job.priority, queues.index(job.queue))
        else:
            before = (job.priority - 1, len(queues))  # every queue, strictly better priorities
        return self._first(queues, long_blocked, before) is not None


class _Simulation:
    """One run of the event-driven model; `simulate` is its public face."""

    def __init__(self, requests: Sequence[Request], cfg: SimConfig) -> None:
        self.requests = requests
        self.cfg = cfg
        denoisers = [w for w in cfg.layout.workers if w.denoises]
        if not denoisers:
            raise ValueError("the layout has no denoise worker")
        self.cards = [
            _Card(
                i,
                w.name,
                tuple(q for q in w.consumed_queues() if class_of(q) in CLASSES),
                speedup=group_speedup(w.group_size),
            )
            for i, w in enumerate(denoisers)
        ]
        self.broker = _Broker()
        self.jobs: dict[int, _Job] = {}  # accepted and unfinished, by id
        self.result = {k: ClassResult() for k in KINDS}
        self.lane_result: dict[str, ClassResult] = {}
        self.user_result: dict[str, ClassResult] = {}
        self.window = FairWindow(cfg.fair_window)
        self.in_window: dict[tuple[str, str], int] = {}  # (user, queue) → jobs published, not started
        self.held: dict[tuple[str, str], list[_Job]] = {}  # (user, queue) → jobs the window holds
        self.held_count = self.max_held = 0
        self.switches = self.republished = self.in_process = self.max_long = self.cuts = 0
        self.now = 0.0  # the event being handled
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
        self._engaged = False  # the long cap's state (its policy has hysteresis)
        self._engaged_checks = self._engaged_hits = 0
        self._capped_layout: PoolLayout | None = None
        self.recent: deque[tuple[float, str, float]] = deque()  # accepted arrivals: (time, class, seconds)

    # -- the long cap --------------------------------------------------------------------

    def _running_long(self, exclude: _Card | None = None) -> int:
        return sum(1 for c in self.cards if c is not exclude and c.job is not None and c.job.duration_class == LONG)

    def _cap_engaged(self, now: float) -> bool:
        cfg = self.cfg
        if cfg.long_cap is None:
            return False
        if cfg.long_cap_policy is None:
            return True
        if self._engaged_cache is not None and self._engaged_cache[0] == now:
            return self._engaged_cache[1]
        new_long = priority_for(LONG, cfg.thresholds.medium, False, cfg.thresholds)
        wait = expected_wait(LONG, new_long, self.work_items(now), cfg.layout)
        self._engaged = cfg.long_cap_policy.engaged(self._engaged, wait, (cfg.limits or AdmissionLimits()).long)
        self._engaged_cache = (now, self._engaged)
        return self._engaged

    def _long_blocked(self, card: _Card, now: float) -> bool:
        cap = self.cfg.long_cap
        return cap is not None and self._running_long(exclude=card) >= cap and self._cap_engaged(now)

    def _admission_layout(self, now: float) -> PoolLayout:
        cfg = self.cfg
        if cfg.long_cap is None or not self._cap_engaged(now):
            return cfg.layout
        if self._capped_layout is None:
            self._capped_layout = capped_layout(cfg.layout, cfg.long_cap)
        return self._capped_layout

    # -- cards and admission -------------------------------------------------------------

    def _start_chunk(self, card: _Card, job: _Job, now: float, in_process: bool = False) -> None:
        """Run the job's next chunk on `card` from `now`, charging what the service pays."""
        cfg = self.cfg
        step_seconds = job.step_seconds / card.speedup  # wall seconds of one step on this card (group)
        k = min(steps_per_chunk(cfg.chunk_seconds, step_seconds), job.steps - job.steps_done)
        overhead = 0.0
        if self._load(card, job.model):
            overhead += cfg.switch_seconds
            self.switches += 1
        if job.steps_done > 0 and not in_process:
            overhead += self.restore_seconds
        if job.first_step is None:
            job.first_step = now + overhead
            if job.windowed:  # it started: its place in the window goes to the user's best held job
                job.windowed = False
                self.in_window[job.fair_key] -= 1
                self._release(job.fair_key)
        last = job.steps_done + k >= job.steps
        duration = overhead + k * step_seconds + (0.0 if last else self.save_seconds)
        card.job, card.chunk_steps = job, k
        card.steps_from, card.step_wall, card.cut = now + overhead, step_seconds, False
        card.busy_until = now + duration
        card.busy_seconds += duration
        if job.duration_class == LONG:
            self.max_long = max(self.max_long, self._running_long())
        heapq.heappush(self.events, (card.busy_until, 0, self.seq, card.index))
        self.seq += 1

    def _load(self, card: _Card, model: str) -> bool:
        """Make `model` the card's most recently used one; whether that costs a switch (it was not
        resident, and the card had run something before: its first model is warm)."""
        cached = card.resident
        if model in cached:
            cached.move_to_end(model)
            return False
        switch = bool(cached)
        cached[model] = self.cfg.model_gib.get(model, math.inf)
        while len(cached) > 1 and sum(cached.values()) > self.cfg.cache_gib:
            cached.popitem(last=False)  # least recently used out; the model just loaded stays
        return switch

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
            items.append(
                WorkItem(job.queue, job.priority, after + in_chunk, running=True, chunk_remaining_seconds=in_chunk)
            )
        return items

    def _cut_for(self, job: _Job, now: float) -> None:
        """SimConfig.cut_chunks: an unstarted job published ahead (the lightest user's), still waiting
        `cut_after` seconds after it was published, ends one busy card's chunk at that card's next step, a
        card whose running job's continuation comes after the job's message (the first step boundary among
        them wins: one card per message, as the cards' claim in the broker does live)."""
        if any(c.job is None and job.queue in c.queues and not self._long_blocked(c, now) for c in self.cards):
            return
        best: tuple[float, _Card, int] | None = None
        for card in self.cards:
            running = card.job
            if running is None or card.cut or job.queue not in card.queues:
                continue
            done = max(1, math.ceil((now - card.steps_from) / card.step_wall - 1e-9))  # the step under way ends
            if done >= card.chunk_steps:
                continue  # its chunk ends at that step anyway
            left = (running.steps - running.steps_done - done) * running.step_seconds
            continuation = priority_for(running.duration_class, left, True, self.cfg.thresholds)
            if continuation <= job.priority:
                continue  # only strictly better work cuts a chunk
            at = card.steps_from + done * card.step_wall
            if best is None or at < best[0]:
                best = (at, card, done)
        if best is None:
            return
        at, card, done = best
        end = at + self.save_seconds
        card.busy_seconds -= card.busy_until - end
        card.busy_until, card.chunk_steps, card.cut = end, done, True
        heapq.heappush(self.events, (end, 0, self.seq, card.index))
        self.seq += 1
        self.cuts += 1

    # -- the fair window -----------------------------------------------------------------

    def _publish_new(self, job: _Job) -> None:
        """A new job's first message, or a hold when its user's window for its queue is full."""
        key = job.fair_key
        others = [
            self.in_window.get(k, 0) + len(self.held.get(k, ()))
            for k in set(self.in_window) | set(self.held)
            if k[1] == job.queue and k != key
        ]
        waiting = self.in_window.get(key, 0) + len(self.held.get(key, ()))
        others = [n for n in others if n > 0]
        if self.window.holds(self.in_window.get(key, 0), waiting, others):
            self.held.setdefault(key, []).append(job)
            self.held_count += 1
            self.max_held = max(self.max_held, self.held_count)
            return
        if self.window.goes_ahead(waiting, others):
            job.priority = ahead_priority(job.priority, job.duration_class)
            job.ahead = True
        self.in_window[key] = self.in_window.get(key, 0) + 1
        job.windowed = self.window.enabled
        self.broker.publish(job)
        if job.ahead and self.cfg.cut_chunks:
            heapq.heappush(self.events, (self.now + self.cfg.cut_after, 2, self.seq, job.id))
            self.seq += 1

    def _release(self, key: tuple[str, str]) -> None:
        """Publish the user's best held jobs of the queue while its window has room."""
        held = self.held.get(key)
        while held and self.window.room(self.in_window.get(key, 0)) > 0:
            job = next_held(held, key=lambda j: release_key(j.priority, j.request.arrival))
            assert job is not None
            held.remove(job)
            self.held_count -= 1
            self.in_window[key] = self.in_window.get(key, 0) + 1
            job.windowed = True
            self.broker.publish(job)

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
            res.ends.append(now)
            for part in (
                self.lane_result.setdefault(job.request.lane, ClassResult()),
                self.user_result.setdefault(job.request.user, ClassResult()),
            ):
                part.waits.append(res.waits[-1])
                part.delays.append(res.delays[-1])
                part.latencies.append(res.latencies[-1])
                part.ends.append(now)
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

    def _headwind(self, cls: str, queue: str, layout: PoolLayout, now: float) -> Headwind:
        """What admission stretches the work ahead by (SimConfig.headwind_window): the better classes'
        arrivals over the window, and the boundary cost per second of work as this config pays it."""
        window = self.cfg.headwind_window
        if window is None:
            return CALM
        while self.recent and self.recent[0][0] < now - window:
            self.recent.popleft()
        recent: dict[str, float] = {}
        for _, c, seconds in self.recent:
            recent[c] = recent.get(c, 0.0) + seconds
        # A boundary pays its save; a re-published one (not yield-on-demand) its restore too.
        boundary = self.save_seconds + (0.0 if self.cfg.yield_on_demand else self.restore_seconds)
        span = min(window, max(now, 1.0))  # the first arrivals: the rate over the time seen so far
        return headwind(recent, cls, span, layout.card_equivalents(queue), boundary / self.cfg.chunk_seconds)

    def _arrival(self, index: int, now: float) -> None:
        cfg = self.cfg
        r = self.requests[index]
        cls = cfg.thresholds.classify(r.seconds)
        priority = priority_for(cls, r.seconds, False, cfg.thresholds)
        queue = cfg.layout.queue_for(cls, cfg.models[r.kind], r.lane)
        if cfg.limits is not None:
            layout = self._admission_layout(now)
            wind = self._headwind(cls, queue, layout, now)
            decision = decide(queue, priority, self.work_items(now), layout, cfg.limits, wind)
            if not decision.accepted:
                self.result[r.kind].refused += 1
                return
        self.result[r.kind].accepted += 1
        self.recent.append((now, cls, r.seconds))
        steps = cfg.steps_for(r.seconds)
        job = _Job(
            id=index,
            request=r,
            duration_class=cls,
            queue=queue,
            model=cfg.models[r.kind],
            steps=steps,
            step_seconds=r.seconds / steps,
            priority=priority,
        )
        self.jobs[job.id] = job
        self._publish_new(job)

    def run(self) -> SimResult:
        for index, r in enumerate(self.requests):
            heapq.heappush(self.events, (r.arrival, 1, index, index))  # chunk ends (0) go first
        self.seq = len(self.requests)
        now = 0.0
        while self.events:
            now, order, _, payload = heapq.heappop(self.events)
            self.now = now
            self._engaged_cache = None  # every event changes the state
            if order == 0:
                card = self.cards[payload]
                if now != card.busy_until:
                    continue  # the end of a chunk that was cut short: its new end is queued
                self._chunk_end(card, now)
            elif order == 2:
                job = self.jobs.get(payload)
                if job is not None and job.first_step is None:
                    self._cut_for(job, now)  # still waiting: it cuts a card's chunk
            else:
                self._arrival(payload, now)
            self._engaged_cache = None
            self._dispatch(now)
            if self.cfg.long_cap is not None:
                self._engaged_checks += 1
                self._engaged_hits += self._cap_engaged(now)
        busy = sum(c.busy_seconds for c in self.cards)
        return SimResult(
            classes=self.result,
            makespan=now,
            utilization=busy / (len(self.cards) * now) if now > 0 else 0.0,
            switches=self.switches,
            republished=self.republished,
            in_process=self.in_process,
            max_long_cards=self.max_long,
            cap_engaged_share=self._engaged_hits / self._engaged_checks if self._engaged_checks else 0.0,
            lanes=self.lane_result,
            users=self.user_result,
            max_held=self.max_held,
            cuts=self.cuts,
        )


def simulate(requests: Sequence[Request], config: SimConfig | None = None) -> SimResult:
    """Run the service's scheduling policy on `requests` (sorted by arrival)."""
    if any(b.arrival < a.arrival for a, b in zip(requests, requests[1:])):
        raise ValueError("requests must be sorted by arrival")
    return _Simulation(requests, config or SimConfig()).run()


def simulate_rate(rate: float, config: SimConfig | None = None, arrivals: int = 400, seed: int = 0) -> SimResult:
    """`simulate` on the seed's workload at `rate`."""
    return simulate(seed_workload(arrivals, rate, seed), config)
