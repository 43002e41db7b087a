"""What a request costs as the queue grows: submit, GET of a queued job and one page of the job list.

    python -m bench.depth [--sizes 0,250,1000,2500,5000,10000] [--samples 25] [--rounds 3]

Through the API (Django's test client, in process: what is measured is the view, its queries and its
serialisation, not the network), on the configured database (DATABASE_URL: PostgreSQL for the figures)
and broker (REDIS_URL; unset: a private bundled Redis for the run, as `make up` would have; the messages
the submits publish are never consumed). The per-user limits and the admission limits are lifted; the
queue is filled with queued jobs and no worker runs, so nothing leaves it. The fill records jobs the way
the job service does: each size's new jobs are copies of jobs the service admitted through the API (one
per simulated model, so the classes, queues and priorities mix as in a real burst), each with its own id
and submit time, owned by another user (the queue is everyone's; the measured user lists their own jobs),
and each with its event log in Redis, as a submit leaves one (a read that walked Redis's keys grew with them:
genserver/liveness.py). That keeps a 10,000-job fill at seconds, where submitting them one by one would take as
long as the cost being measured grows. At each size it prints the P50 of each request, its ratio to the empty
queue's and the database queries it made; the sweep runs --rounds times (the machine is shared: a burst of other work
lands on one round) and each figure is the median over the rounds. It deletes what it recorded (the jobs
of its users, `bench-depth`, `bench-depth-others` and `bench-depth-submitter`) at the start and at the end.
The submits measured are `bench-depth-submitter`'s, each cancelled once timed (`Bench.__init__` says why).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

SIZES = (0, 250, 1000, 2500, 5000, 10000)
PAGE = 20  # jobs per list page (GET /api/v1/jobs/?limit=20)
MODELS = ("sdxl-sim", "flux-sim", "sdxl-turbo-sim", "wan-sim")  # images and a video: several classes
LIFTED = {
    "GENSERVER_MAX_JOBS_IN_FLIGHT": "0",
    "GENSERVER_SUBMIT_RATE_LIMIT": "0",
    "GENSERVER_ADMIT_SHORT_SECONDS": "1e12",
    "GENSERVER_ADMIT_MEDIUM_SECONDS": "1e12",
    "GENSERVER_ADMIT_LONG_SECONDS": "1e12",
    "GENSERVER_LOG_LEVEL": "WARNING",
}


def _setup() -> None:
    for name, value in LIFTED.items():
        os.environ[name] = value  # before Django reads its settings
    if not os.environ.get("REDIS_URL"):
        # A submit publishes its first message: without a broker each one would time out on a refused
        # connection and take the broker-unavailable path, and that is what the figures would measure.
        import atexit

        from workers.bundled_redis import start_throwaway_redis

        redis_server, os.environ["REDIS_URL"] = start_throwaway_redis()
        atexit.register(redis_server.terminate)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "genserver.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", "--noinput", verbosity=0)


def _p50_ms(call: Callable[[], Any], samples: int, after: Callable[[Any], Any] | None = None) -> float:
    """The P50 of `call`'s time over `samples` calls; `after` (untimed) takes each call's result."""
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        result = call()
        times.append((time.perf_counter() - start) * 1000)
        if after is not None:
            after(result)
    return statistics.median(times)


def _queries(call: Callable[[], Any], after: Callable[[Any], Any] | None = None) -> float:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        result = call()
    if after is not None:
        after(result)
    return float(len(captured.captured_queries))


class Bench:
    """One user, an empty queue at start, and the templates the fill copies."""

    def __init__(self) -> None:
        from django.contrib.auth import get_user_model
        from rest_framework.test import APIClient

        user_model = get_user_model()
        self.user, _ = user_model.objects.get_or_create(username="bench-depth")
        # The queue is everyone's: the fill is another user's jobs, so the measured user's list page
        # is a page of their own jobs (its pagination count is theirs, not the queue's).
        self.others, _ = user_model.objects.get_or_create(username="bench-depth-others")
        # The measured submits are a third user's, each cancelled once timed: at every depth the submit is
        # then that of a user with nothing else waiting, whom the fair window publishes (the same work at 0 as
        # at 10,000). The measured user's own would be held at 0 (alone, their window full) and published at
        # depth (lighter than the fill's user), and the ratio would be a broker publish, not the queue's growth.
        self.submitter, _ = user_model.objects.get_or_create(username="bench-depth-submitter")
        self.clear()  # a previous run's jobs, had it been interrupted
        self.client = APIClient()
        self.client.force_authenticate(self.user)
        self.submitting = APIClient()
        self.submitting.force_authenticate(self.submitter)
        self.templates = [self._submit(model) for model in MODELS]
        for i in range(PAGE):  # a full page of history at every depth, so each page serialises PAGE jobs
            self._submit(MODELS[i % len(MODELS)], "depth history")
        self.filled = 0
        self._cancel_all()  # the templates and the history are not the queue

    def clear(self) -> None:
        """Delete the bench's own jobs (its three users'): the queue it filled and the probes, and their event logs."""
        from genserver.jobs.events import log_key
        from genserver.jobs.models import Job
        from genserver.redis_client import client

        jobs = Job.objects.filter(owner__in=(self.user, self.others, self.submitter))
        ids = list(jobs.values_list("pk", flat=True))
        for start in range(0, len(ids), 1000):
            client().delete(*[log_key(pk) for pk in ids[start : start + 1000]])
        jobs.delete()

    def _submit(self, model: str, prompt: str = "depth probe", client: Any = None) -> Any:
        from genserver.jobs.models import Job

        client = client or self.client
        response = client.post("/api/v1/jobs/", {"model": model, "prompt": prompt, "steps": 4}, format="json")
        if response.status_code != 201:
            raise RuntimeError(f"submit of {model} answered {response.status_code}: {response.content[:300]!r}")
        return Job.objects.get(pk=response.json()["id"])

    def _cancel_all(self) -> None:
        from genserver.jobs import services
        from genserver.jobs.models import ACTIVE, Job

        for job in Job.objects.filter(owner=self.user, status__in=ACTIVE):
            services.cancel_job(job)

    def fill_to(self, queued: int) -> None:
        """Add queued jobs until `queued` were filled in (the probes' own submits come on top)."""
        from django.db.models import F
        from django.utils import timezone

        from genserver.jobs.models import Job, JobStage, JobStatus

        now = timezone.now()
        rows = []
        for i in range(self.filled, queued):
            template = self.templates[i % len(self.templates)]
            copy = Job(**{f.attname: getattr(template, f.attname) for f in Job._meta.concrete_fields})
            copy.id, copy.owner_id = uuid.uuid4(), self.others.pk
            copy.status, copy.stage = JobStatus.QUEUED, JobStage.QUEUED
            copy.lease_owner, copy.lease_expires_at, copy.finished_at = "", None, None
            copy.published_at = now + timedelta(microseconds=i - queued)
            rows.append(copy)
        Job.objects.bulk_create(rows, batch_size=1000)
        # auto_now_add stamped them all now: give the copies distinct, ordered submit times.
        Job.objects.filter(owner=self.others, status=JobStatus.QUEUED).update(created_at=F("published_at"))
        self._log_queued(rows)
        self.filled = max(self.filled, queued)

    @staticmethod
    def _log_queued(rows: list[Any]) -> None:
        """Each copy's event log, as its submit would have written it (one `queued` entry, the same lifetime)."""
        from django.conf import settings

        from genserver.jobs.events import log_key
        from genserver.redis_client import client

        with client().pipeline(transaction=False) as pipe:
            for i, job in enumerate(rows, 1):
                pipe.xadd(log_key(job.pk), {"event": "queued", "job": "{}", "terminal": "0"})
                pipe.expire(log_key(job.pk), int(settings.EVENTS_TTL_SECONDS))
                if i % 1000 == 0:
                    pipe.execute()
            pipe.execute()

    def measure(self, samples: int) -> dict[str, float]:
        """P50 ms of each request, and the database queries it made (the same at every depth, or not)."""
        from genserver.jobs import services

        probe = self._submit(MODELS[0], "depth probe, the newest queued job")
        calls: dict[str, tuple[Callable[[], Any], Callable[[Any], Any] | None]] = {
            "submit": (lambda: self._submit(MODELS[0], client=self.submitting), services.cancel_job),
            "get": (lambda: self._expect_ok(self.client.get(f"/api/v1/jobs/{probe.pk}/")), None),
            "list": (lambda: self._expect_ok(self.client.get(f"/api/v1/jobs/?limit={PAGE}")), None),
        }
        figures = {}
        for name, (call, after) in calls.items():
            if name == "get":  # the measured user's recent submits, which their list page shows with the probe
                for _ in range(samples):
                    self._submit(MODELS[0])
            figures[name] = _p50_ms(call, samples, after)
            figures[f"{name}_queries"] = _queries(call, after)
        return figures

    @staticmethod
    def _expect_ok(response: Any) -> None:
        if response.status_code != 200:
            raise RuntimeError(f"GET answered {response.status_code}: {response.content[:300]!r}")


def run(
    sizes: Sequence[int], samples: int, out: Any = sys.stdout, rounds: int = 1
) -> list[tuple[int, dict[str, float]]]:
    """Measure at each size (ascending), `rounds` times over (each from an empty queue), and print the
    table of each figure's median over the rounds; returns its rows. Django must be set up, with the
    limits lifted (main() does both)."""
    from django.db import connection

    measured: dict[int, list[dict[str, float]]] = {size: [] for size in sorted(sizes)}
    for _ in range(rounds):
        bench = Bench()
        try:
            for size in measured:
                bench.fill_to(size)
                measured[size].append(measure_settled(bench, samples))
        finally:
            bench.clear()
    rows = [
        (size, {k: statistics.median(f[k] for f in figures) for k in figures[0]}) for size, figures in measured.items()
    ]
    print(
        f"# bench.depth on {connection.vendor}: P50 ms of {samples} requests (median of {rounds} rounds), "
        "×0: against the empty queue, q: database queries of one request",
        file=out,
    )
    print(
        f"{'queued':>7} | {'submit':>8} {'×0':>5} {'q':>3} | {'GET':>8} {'×0':>5} {'q':>3} | "
        f"{'list':>8} {'×0':>5} {'q':>3}",
        file=out,
    )
    base = rows[0][1]
    for size, figures in rows:
        print(
            f"{size:>7} | "
            + " | ".join(
                f"{figures[k]:>8.1f} {figures[k] / base[k]:>5.2f} {figures[k + '_queries']:>3.0f}"
                for k in ("submit", "get", "list")
            ),
            file=out,
        )
    return rows


def measure_settled(bench: Bench, samples: int) -> dict[str, float]:
    """The figures after the fill's rows are analysed, as autovacuum would soon after a burst, and with the
    tallies as a burst leaves them. The fill writes its rows in one transaction (and the clearing between
    rounds deletes them in one), which rewrites each tally row thousands of times before any version of it is
    dead: the tables grow to hundreds of pages for a handful of rows, which no vacuum gives back while their
    last versions sit on the last pages, and every request's tally read scans them whole (1-2 ms). A real
    burst's submits, one transaction each, let PostgreSQL prune each row's old versions in place: 2,100 such
    updates of a three-row table leave it at one page. VACUUM FULL gives the tallies that size."""
    from django.db import connection

    from genserver.jobs.models import HeldTally, Job, QueueTally

    if connection.vendor == "postgresql" and not connection.in_atomic_block:  # VACUUM runs outside one
        with connection.cursor() as cursor:
            cursor.execute(f"VACUUM ANALYZE {Job._meta.db_table}")
            for tally in (QueueTally, HeldTally):
                cursor.execute(f"VACUUM FULL ANALYZE {tally._meta.db_table}")
    return bench.measure(samples)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="queued jobs, comma-separated")
    parser.add_argument("--samples", type=int, default=25, help="requests per figure (the P50 is printed)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="sweeps, each from an empty queue (each figure: their median)"
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or 0 not in sizes:
        parser.error("--sizes must include 0 (the ratios are against the empty queue)")
    _setup()
    run(sizes, args.samples, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
