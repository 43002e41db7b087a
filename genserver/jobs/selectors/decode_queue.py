"""The decode workers' queue as an ETA sees it: a job's decode waits behind the decodes that reach it first.

A stack has one decode worker per node (pools.default_layout), and it decodes the
videos too: an 81-frame clip holds it for seconds, so an image that ends its
denoising behind one waits that long, far more than its model's learned tail
(a median, which a rare long wait does not move). So a job's tail is its model's
decode hop (publish → decode start, without a queue), the wait for a decode
worker, then its own decode, with the waiting modelled first come first served
on the decode workers: the decodes published now (in service: what is left of
them; queued: whole), then those of the jobs that end their denoising before it.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import BooleanField, Case, Count, F, Min, Q, Value, When

from genserver.jobs.models import Job, JobStage, JobStatus

from .compiled import CompiledRead
from .kept import KeptRead

_FIELDS = ("id", "model", "stage", "lease_owner", "chunk_started_at", "published_at")


# The jobs published to a decode worker, first published first (a decoding job's GET reads those before it).
_DECODING = CompiledRead(
    Job,
    lambda: (
        Job.objects.filter(status=JobStatus.DECODING)
        .order_by(F("published_at").asc(nulls_last=True), "id")
        .values_list(*_FIELDS)
    ),
)
_SERVING = Q(stage=JobStage.DECODING) & ~Q(lease_owner="")  # a decode worker took it (start_decoding)


def _line_read(since: datetime) -> Any:
    """The decodes in service, or published from `since` on (still in their hop, perhaps), one row each, and the
    queued ones published before, one row per model: (model, in service, taken at, published at (the first's, for
    a model's row), how many, the job's id (None for a model's row)), first published first. One statement
    grouped by the row's own id where it stands alone, by its model where it does not."""
    alone = _SERVING | Q(published_at=None) | Q(published_at__gte=since)
    return (
        Job.objects.filter(status=JobStatus.DECODING)
        .annotate(
            alone=Case(When(alone, then=F("id")), default=None),
            serving=Case(When(_SERVING, then=Value(True)), default=Value(False), output_field=BooleanField()),
            taken_at=Case(When(alone, then=F("chunk_started_at")), default=None),
        )
        .values("model", "serving", "taken_at", "alone")
        .annotate(first=Min("published_at"), count=Count("pk"))
        .order_by(F("first").asc(nulls_last=True), "alone")
        .values_list("model", "serving", "taken_at", "first", "count", "alone")
    )


_LINE = CompiledRead(Job, _line_read, moments=("since",))

LineRow = tuple[str, bool, datetime | None, datetime | None]  # model, in service, taken at, published at


def decoding_rows() -> list[dict[str, Any]]:
    """The jobs published to a decode worker (in service or queued), first published first."""
    return [dict(zip(_FIELDS, row, strict=True)) for row in _DECODING.tuples()]


def in_service(row: dict[str, Any]) -> bool:
    """A decode worker took it (start_decoding), rather than its decode message waiting in the queue."""
    return row["stage"] == JobStage.DECODING and bool(row["lease_owner"])


@dataclass(frozen=True)
class Line:
    """The decode queue as DecodeQueue.of reads it: `rows` one per decode in service or published from `since`
    on (as line rows, first published first), and `settled` (model, count) for the queued decodes published
    before `since` (first published first), all of which have reached the queue when `since` is at least every
    model's decode hop ago."""

    rows: list[LineRow]
    settled: list[tuple[str, int]]


def line(since: datetime, clock: Callable[[], float] = time.monotonic) -> Line:
    """The decode queue in one bounded read: the decodes in service or published from `since` on, and a count per
    model of the queued ones published before (a burst's hundred queued decodes cost every submit's ETA 1.4 ms
    as one row each on PostgreSQL).

    Every submit's answer and every job's ETA reads it, so a process's requests reuse a read for
    `config.cluster_read_seconds()`, as they reuse the cluster's picture (capacity.cluster_reads): an ETA then
    counts a decode published or finished up to that much later. A read made for an earlier `since` serves a
    later one: it has a row of its own for each decode from its `since` on, where the later read would have
    counted some of them per model."""
    now = clock()
    kept = _LINE_READ.get(now, covers=lambda kept_since: kept_since <= since)
    if kept is not None:
        return kept
    rows: list[LineRow] = []
    settled: list[tuple[str, int]] = []
    for model, serving, taken_at, published, count, alone in _LINE.tuples(since=since):
        if alone is None:
            settled.append((model, count))
        else:
            rows.append((model, serving, taken_at, published))
    read = Line(rows, settled)
    _LINE_READ.keep(now, read, key=since)
    return read


_LINE_READ: KeptRead[Line] = KeptRead()  # the process's last read of the line, kept with its `since`


def as_line_row(row: dict[str, Any]) -> LineRow:
    return row["model"], in_service(row), row["chunk_started_at"], row["published_at"]


@dataclass(frozen=True)
class DecodeQueue:
    """When each decode worker is free of the decodes published now, in seconds from the snapshot's clock."""

    free_in: tuple[float, ...]

    @classmethod
    def of(
        cls,
        rows: Iterable[LineRow],
        servers: int,
        decode_seconds: Callable[[str], float],
        now: datetime,
        hop: Callable[[str], float],
        settled: Iterable[tuple[str, int]] = (),
    ) -> DecodeQueue:
        """`rows` as `line` gives them, or every decode published (as_line_row of decoding_rows), and `settled`
        (model, count) the queued decodes published before the first queued row, each past its hop;
        `decode_seconds(model)` its learned decode (0: unknown), and `hop(model)` its decode hop: a queued
        decode reaches a worker once what is left of its hop has passed. With one decode worker the settled
        decodes are its work in a row, exactly as one row each; with several, their work fills the workers
        to one level (greedy first come first served differs by less than one decode)."""
        free = [0.0] * max(1, servers)
        queued: list[tuple[float, float]] = []
        per_model: dict[str, tuple[float, float]] = {}  # (decode, hop): a few models among many rows
        for model, serving, started, published in rows:
            if model not in per_model:
                per_model[model] = (decode_seconds(model) or 0.0, hop(model))
            seconds, model_hop = per_model[model]
            if serving and started is not None:
                elapsed = (now - started).total_seconds()
                free.sort()
                free[0] += max(0.0, seconds - elapsed)
            else:
                since = (now - published).total_seconds() if published is not None else 0.0
                queued.append((max(0.0, model_hop - since), seconds))
        free.sort()
        _fill(free, sum(count * (decode_seconds(model) or 0.0) for model, count in settled))
        heapq.heapify(free)
        for reaches, seconds in queued:
            heapq.heappush(free, max(heapq.heappop(free), reaches) + seconds)
        return cls(tuple(sorted(free)))

    def wait(self, arrive_in: float, earlier: Sequence[tuple[float, float]] = ()) -> float:
        """Seconds a decode reaching the queue in `arrive_in` waits for a worker, behind the published decodes
        and `earlier`'s (arrive in, decode seconds): the decodes of jobs still denoising, counted when they
        reach the queue before it."""
        free = list(self.free_in)
        heapq.heapify(free)
        for at, seconds in sorted(earlier):
            if at >= arrive_in:
                break
            heapq.heappush(free, max(heapq.heappop(free), at) + seconds)
        return max(0.0, free[0] - arrive_in)


def _fill(free: list[float], work: float) -> None:
    """Raise the lowest of the sorted `free` to one level so that they take `work` seconds more in all."""
    if work <= 0:
        return
    for raised in range(1, len(free) + 1):
        level = (sum(free[:raised]) + work) / raised
        if raised == len(free) or level <= free[raised]:
            free[:raised] = [level] * raised
            return
