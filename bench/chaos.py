"""Chaos run: a mixed workload on the real stack while GPU, encode and decode workers are SIGKILLed.

    .venv/bin/python -m bench.chaos --jobs 200 --seconds 90

It starts its own stack, on loopback only: a private data directory and SQLite
file (or `--database-url`), a bundled Redis on a free port (or a private
database number, 12, on REDIS_URL's server when that is set), the API under
gunicorn on a free port, the launcher's workers (`--cards` GPU workers plus
encode and decode, all with the chaos probe) and Celery beat (the reaper), all
with the simulated backend at `--clock` wall seconds per second of work.

For `--seconds` it offers `--jobs` requests (the seed's mix: 80 % images of a
few sizes, 20 % videos) from `--users` users, cancels about 10 % of the accepted
ones at a random moment, and every `--kill-every` seconds (jittered) SIGKILLs a
random live worker, preferring one that holds a job; the launcher's supervisor
restarts it. A kill never targets a worker whose job already used all but one
of its attempts: the drill tests recovery, not the poison-job limit. Then it
stops killing and waits (at most `--drain` seconds) for every accepted job to end.

It prints the totals and exits 1 if any accepted job was lost, stuck or
failed, had a chunk or its decode recorded twice, came out with the wrong set
of outputs, or redid more than the interrupted chunk. It also counts
"superseded" runs: a chunk a live worker finished after its lease had expired
and another worker had taken the job (computed twice, recorded once). The
measurements are the database (what each job became) and the probe
(`bench/chaos_probe.py`: what the workers ran to completion). Results and
their reading: docs/RELIABILITY.md. A short version runs in the tests
(tests/reliability/test_chaos.py).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from workers.bundled_redis import free_port, start_throwaway_redis
from workers.supervise import Supervisor, python

# (weight, request): the seed's mix, 80 % images of a few sizes and 20 % videos.
MIX: list[tuple[float, dict[str, Any]]] = [
    (0.30, {"model": "sdxl-sim", "width": 512, "height": 512, "steps": 20}),
    (0.25, {"model": "sdxl-sim"}),
    (0.15, {"model": "flux-sim", "preview_every": 7}),
    (0.10, {"model": "sdxl-sim", "width": 768, "height": 768, "num_outputs": 4}),
    (0.15, {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 81, "preview_every": 10}),
    (0.05, {"model": "wan-sim", "width": 832, "height": 480, "num_frames": 33, "steps": 30}),
]
CANCEL_SHARE = 0.1

Api = Callable[[str, str, Any], tuple[int, Any, dict]]  # (method, path, json body) → (status, json, headers)


@dataclass(frozen=True)
class Offer:
    at: float  # seconds after the start
    user: int
    body: dict[str, Any]
    cancel_after: float | None  # seconds after acceptance, or None


def workload(jobs: int, seconds: float, users: int, rng: random.Random) -> list[Offer]:
    weights = [w for w, _ in MIX]
    offers = []
    for i in range(jobs):
        body = dict(rng.choices([b for _, b in MIX], weights)[0])
        body |= {
            "prompt": f"chaos {i}: {rng.choice(['a lighthouse', 'a fox', 'a city', 'the sea'])}",
            "seed": rng.randrange(2**31),
        }
        cancel = rng.uniform(0.0, 3.0) if rng.random() < CANCEL_SHARE else None
        offers.append(Offer(at=seconds * i / max(1, jobs), user=i % users, body=body, cancel_after=cancel))
    return offers


@dataclass
class Target:
    """What the drill acts on: the supervisor running the workers, the layout, one API client per user."""

    supervisor: Any  # workers.supervise.Supervisor
    layout: Any  # genserver.scheduling.pools.PoolLayout
    apis: list[Api]


@dataclass
class Report:
    seconds: float = 0.0
    wall_seconds: float = 0.0
    offered: int = 0
    accepted: int = 0
    refused: int = 0
    refused_by_reason: Counter = field(default_factory=Counter)
    other_responses: Counter = field(default_factory=Counter)
    cancel_requests: int = 0
    succeeded: int = 0
    cancelled: int = 0
    failed: int = 0
    lost: int = 0
    stuck: int = 0
    chunk_duplicates: int = 0
    decode_duplicates: int = 0
    superseded_runs: int = 0
    output_mismatches: int = 0
    kills: Counter = field(default_factory=Counter)
    kills_holding_a_job: int = 0
    resumed_jobs: int = 0
    interrupted_chunk_runs: int = 0
    retried_attempts: int = 0
    redone_steps: int = 0
    max_redone_per_job: int = 0
    redo_violations: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def finished(self) -> int:
        return self.succeeded + self.cancelled + self.failed

    @property
    def duplicated(self) -> int:
        return self.chunk_duplicates + self.decode_duplicates + self.output_mismatches

    @property
    def ok(self) -> bool:
        return not (self.lost or self.stuck or self.failed or self.duplicated or self.redo_violations)

    def lines(self) -> list[str]:
        kills = ", ".join(f"{name} {n}" for name, n in sorted(self.kills.items()))
        refused = ", ".join(f"{reason} {n}" for reason, n in sorted(self.refused_by_reason.items()))
        return [
            f"jobs      offered {self.offered}, accepted {self.accepted}, refused {self.refused} ({refused or '-'}),"
            f" cancel requests {self.cancel_requests}",
            f"finished  {self.finished} of {self.accepted}: succeeded {self.succeeded}, cancelled {self.cancelled},"
            f" failed {self.failed}",
            f"lost {self.lost}   stuck {self.stuck}   duplicated {self.duplicated} (chunks recorded twice"
            f" {self.chunk_duplicates}, decodes recorded twice {self.decode_duplicates}, wrong output sets"
            f" {self.output_mismatches})",
            f"superseded {self.superseded_runs} runs finished by a worker whose lease had expired (taken for dead"
            f" while alive): computed twice, recorded once",
            f"kills     {sum(self.kills.values())} ({kills or '-'}); {self.kills_holding_a_job} while holding a job",
            f"resumes   {self.resumed_jobs} jobs resumed after a kill: {self.interrupted_chunk_runs} interrupted chunk"
            f" runs, {self.retried_attempts} retried stage attempts",
            f"redone    {self.redone_steps} steps over {self.interrupted_chunk_runs} interrupted runs (largest per"
            f" job: {self.max_redone_per_job}); jobs that redid more than the interrupted chunk:"
            f" {self.redo_violations}",
            f"time      {self.seconds:.0f} s of faults, {self.wall_seconds:.0f} s in all",
        ] + [f"PROBLEM   {p}" for p in self.problems[:20]]


# --- acting on the stack ------------------------------------------------------------------


def _child(supervisor, worker: str):
    return next(c for c in supervisor.children if c.name == f"worker {worker}")


def kill(supervisor, worker: str) -> None:
    """SIGKILL the worker's process group (main process and pool child): no cleanup runs."""
    from genserver.redis_client import WORKER_KEY, client

    child = _child(supervisor, worker)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.process.pid, signal.SIGKILL)
    child.process.wait()
    with contextlib.suppress(Exception):
        from workers.launcher import worker_hostname

        client().delete(WORKER_KEY.format(name=worker_hostname(worker)))  # `card0@NODE`, this node's


def revive(supervisor) -> None:
    """Let the supervisor restart what exited, without its crash-loop back-off (these kills are ours)."""
    for child in supervisor.children:
        if (
            child.name.startswith("worker ")
            and child.process is not None
            and child.process.poll() is not None
            and child.next_start == 0.0
        ):
            child.restarts = 0
    supervisor.poll()


def live_names() -> set[str]:
    from genserver.jobs.selectors import live_workers

    try:
        return {w.get("worker") or w["name"] for w in live_workers()}  # pool entries: one node here
    except Exception:  # noqa: BLE001 - Redis down during a drill means no live worker is visible
        return set()


def held_jobs() -> dict[str, list[tuple[str, int]]]:
    """Worker name → [(job id, attempts)] of the jobs it holds now (a lease not yet expired: the lease of a
    worker killed earlier names its restarted successor until the reaper takes the job back)."""
    from django.utils import timezone

    from genserver.jobs.models import ACTIVE, Job

    held: dict[str, list[tuple[str, int]]] = {}
    leased = Job.objects.filter(status__in=ACTIVE, lease_expires_at__gt=timezone.now()).exclude(lease_owner="")
    for pk, owner, attempts in leased.values_list("pk", "lease_owner", "attempts"):
        held.setdefault(owner.split("@")[0], []).append((str(pk), attempts))
    return held


def choose_victim(
    target: Target, rng: random.Random, max_attempts: int, prefer_busy: float = 0.7
) -> tuple[str, bool] | None:
    live, held = live_names(), held_jobs()
    # Up: its heartbeat is current, or it holds a lease it renews (on a loaded machine a card's heartbeat can
    # lapse while it runs a job: such a card is still the victim that tests recovery).
    names = [
        w.name
        for w in target.layout.workers
        if (w.name in live or w.name in held) and _child(target.supervisor, w.name).process.poll() is None
    ]
    eligible = [n for n in names if all(a < max_attempts - 1 for _, a in held.get(n, []))]
    if not eligible:
        return None
    busy = [n for n in eligible if held.get(n)]
    victim = rng.choice(busy) if busy and rng.random() < prefer_busy else rng.choice(eligible)
    return victim, bool(held.get(victim))


# --- the drill ------------------------------------------------------------------------------


def drill(
    target: Target,
    offers: list[Offer],
    seconds: float,
    kill_every: float,
    rng: random.Random,
    drain: float = 120.0,
    say: Callable[[str], None] = lambda line: None,
    prefer_busy: float = 0.7,
) -> Report:
    """Offer the workload while killing workers for `seconds`, wait for the jobs, measure.

    Each kill picks a live worker, one holding a job with probability `prefer_busy` when there is one.
    """
    from django.conf import settings
    from django.db import close_old_connections

    from genserver.jobs.models import ACTIVE, Job

    report = Report(seconds=seconds, offered=len(offers))
    accepted: dict[str, Offer] = {}
    cancels: list[tuple[float, str, int]] = []
    start = time.monotonic()
    next_kill = start + kill_every * rng.uniform(0.5, 1.5)
    pending = list(offers)
    pending.reverse()
    while True:
        now = time.monotonic()
        while pending and pending[-1].at <= now - start:
            offer = pending.pop()
            status, body, _ = target.apis[offer.user]("POST", "/api/v1/jobs/", offer.body)
            if status == 201:
                accepted[body["id"]] = offer
                if offer.cancel_after is not None:
                    heapq.heappush(cancels, (now + offer.cancel_after, body["id"], offer.user))
            elif status == 429:
                report.refused += 1
                report.refused_by_reason[(body or {}).get("reason", "429")] += 1
            else:
                report.other_responses[status] += 1
                report.problems.append(f"submit answered {status}: {str(body)[:200]}")
        while cancels and cancels[0][0] <= now:
            _, job_id, user = heapq.heappop(cancels)
            status, _, _ = target.apis[user]("POST", f"/api/v1/jobs/{job_id}/cancel/", None)
            report.cancel_requests += 1
            if status != 202:
                report.problems.append(f"cancel of {job_id} answered {status}")
        if now - start < seconds and now >= next_kill:
            next_kill = now + kill_every * rng.uniform(0.5, 1.5)
            choice = choose_victim(target, rng, settings.MAX_ATTEMPTS, prefer_busy)
            if choice:
                victim, busy = choice
                kill(target.supervisor, victim)
                report.kills[victim] += 1
                report.kills_holding_a_job += busy
                say(f"{now - start:6.1f} s  killed {victim}{' (holding a job)' if busy else ''}")
        revive(target.supervisor)
        if now - start >= seconds and not pending and not cancels:
            break
        time.sleep(0.02)
    say(f"{time.monotonic() - start:6.1f} s  faults over; waiting for {len(accepted)} accepted jobs")
    deadline = time.monotonic() + drain
    ids = list(accepted)
    while time.monotonic() < deadline:
        revive(target.supervisor)
        close_old_connections()
        if not Job.objects.filter(pk__in=ids, status__in=ACTIVE).exists():
            break
        time.sleep(0.25)
    report.wall_seconds = time.monotonic() - start
    measure(report, ids)
    return report


def measure(report: Report, ids: list[str]) -> None:
    """What became of each accepted job (the database) and what ran to completion (the probe)."""
    from bench import chaos_probe
    from genserver.jobs.models import Job, JobStatus
    from genserver.storage import default_storage

    storage = default_storage()
    report.accepted = len(ids)
    rows = {str(j.pk): j for j in Job.objects.filter(pk__in=ids)}
    for job_id in ids:
        job = rows.get(job_id)
        if job is None:
            report.lost += 1
            report.problems.append(f"job {job_id} was accepted but has no row")
            continue
        if not job.is_terminal:
            report.stuck += 1
            report.problems.append(f"job {job_id} still {job.status}/{job.stage} (attempts {job.attempts})")
            continue
        report.succeeded += job.status == JobStatus.SUCCEEDED
        report.cancelled += job.status == JobStatus.CANCELLED
        if job.status == JobStatus.FAILED:
            report.failed += 1
            report.problems.append(f"job {job_id} failed: {job.error.splitlines()[0] if job.error else ''}")
        chunks = chaos_probe.chunk_completions(job_id)
        superseded = chaos_probe.chunks_superseded(job_id)
        twice = sum(n - 1 for n in chunks.values() if n > 1)
        decodes = chaos_probe.decode_completions(job_id)
        report.chunk_duplicates += twice
        report.decode_duplicates += max(0, decodes - 1)
        report.superseded_runs += sum(superseded.values()) + chaos_probe.decodes_superseded(job_id)
        if twice or decodes > 1:
            report.problems.append(f"job {job_id}: chunks recorded {chunks}, decodes recorded {decodes}")
        if job.status == JobStatus.SUCCEEDED:
            stored = sorted(p.name for p in storage.path(f"outputs/{job_id}").glob("*.png"))
            if len(job.outputs) != job.num_outputs or len(stored) != job.num_outputs:
                report.output_mismatches += 1
                report.problems.append(
                    f"job {job_id}: {len(job.outputs)} outputs listed, {stored} stored, {job.num_outputs} asked"
                )
        steps = chaos_probe.step_runs(job_id)
        redone = sum(n - 1 for n in steps.values() if n > 1)
        interrupted = max(0, job.chunks_run - sum(chunks.values()) - sum(superseded.values()))
        report.redone_steps += redone
        report.interrupted_chunk_runs += interrupted
        report.retried_attempts += job.attempts
        report.max_redone_per_job = max(report.max_redone_per_job, redone)
        if redone > interrupted * job.chunk_steps:
            report.redo_violations += 1
            report.problems.append(
                f"job {job_id} redid {redone} steps over {interrupted} interrupted runs of"
                f" {job.chunk_steps}-step chunks"
            )
        if job.status == JobStatus.SUCCEEDED and (interrupted or job.attempts):
            report.resumed_jobs += 1


# --- its own stack (the command) ----------------------------------------------------------------


def http_api(base: str, token: str) -> Api:
    def call(method: str, path: str, body: Any = None) -> tuple[int, Any, dict]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            base + path,
            data=data,
            method=method,
            headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null"), dict(resp.headers)
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                return err.code, json.loads(raw or b"null"), dict(err.headers)
            except ValueError:
                return err.code, {"raw": raw[:200].decode(errors="replace")}, dict(err.headers)
        except OSError as exc:
            return 0, {"error": str(exc)}, {}

    return call


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.3)


@contextlib.contextmanager
def own_stack(cards: int, clock: float, users: int, database_url: str | None, keep: bool = False) -> Iterator[Target]:
    data_dir = tempfile.mkdtemp(prefix="genserver-chaos-")
    workers = [{"name": f"card{i}", "queues": ["short", "medium", "long"]} for i in range(cards)]
    workers += [{"name": "encode", "queues": ["encode", "control"]}, {"name": "decode", "queues": ["decode"]}]
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "genserver.settings",
            "GENSERVER_DATA_DIR": data_dir,
            "GENSERVER_TIME_SCALE": str(clock),
            "GENSERVER_LEASE_SECONDS": "3",
            "GENSERVER_REAPER_INTERVAL": "1",
            "GENSERVER_LOG_LEVEL": "ERROR",
            "GENSERVER_POOLS": json.dumps({"workers": workers}),
            "PYTHONUNBUFFERED": "1",
        }
    )
    redis_proc = None
    if os.environ.get("REDIS_URL"):
        import redis

        url = os.environ["REDIS_URL"].rstrip("/").rsplit("/", 1)[0] + "/12"
        redis.Redis.from_url(url).flushdb()
    else:
        redis_proc, url = start_throwaway_redis()
    os.environ["REDIS_URL"] = url
    if database_url:
        os.environ["DATABASE_URL"] = database_url
    else:
        os.environ.pop("DATABASE_URL", None)
    supervisor = None
    try:
        import django

        django.setup()
        from django.contrib.auth import get_user_model
        from django.core.management import call_command

        from genserver.jobs.services.tokens import issue as issue_token
        from workers.local_workers import LocalWorkers

        _wait(lambda: _redis_up(url), 20, "Redis answering")
        call_command("migrate", "--noinput", verbosity=0)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            call_command("make_tiny_models", verbosity=0)  # workers check every registry model at start
        tokens = [
            issue_token(get_user_model().objects.get_or_create(username=f"chaos{i}")[0], "chaos")[1]
            for i in range(users)
        ]
        supervisor = QuietSupervisor(os.path.join(data_dir, "stack.log"), stop_timeout=10)
        # The suite's stack boot (workers and beat, every worker live), with the probe tasks loaded.
        workers = LocalWorkers(
            supervisor=supervisor,
            loglevel="ERROR",
            worker_args=["--include", "bench.chaos_probe"],
            beat_schedule=os.path.join(data_dir, "celerybeat-schedule"),
            boot_timeout=120,
        )
        api_port = free_port()
        supervisor.add(
            "api",
            [
                python(),
                "-m",
                "gunicorn",
                "genserver.wsgi:application",
                "--bind",
                f"127.0.0.1:{api_port}",
                "--workers",
                "2",
                "--threads",
                "4",
                "--log-level",
                "error",
            ],
        )
        base = f"http://127.0.0.1:{api_port}"
        _wait(lambda: http_api(base, "")("GET", "/healthz", None)[0] == 200, 60, "the API answering")
        yield Target(supervisor, workers.layout, [http_api(base, t) for t in tokens])
    finally:
        if supervisor is not None:
            supervisor.stop()
        if redis_proc is not None:
            redis_proc.terminate()
        if keep:
            print(f"data kept in {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)


class QuietSupervisor(Supervisor):
    """The launcher's supervisor, with the children writing to a log file instead of over the report."""

    def __init__(self, log_path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log = open(log_path, "ab")

    def _start(self, child) -> None:
        env = os.environ.copy()
        env.update(child.env)
        child.process = subprocess.Popen(
            child.argv, env=env, start_new_session=True, stdout=self.log, stderr=subprocess.STDOUT
        )


def _redis_up(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200, help="requests offered (default 200)")
    parser.add_argument("--seconds", type=float, default=90.0, help="how long faults are injected (default 90)")
    parser.add_argument("--kill-every", type=float, default=3.0, help="mean seconds between kills (default 3)")
    parser.add_argument("--drain", type=float, default=240.0, help="longest wait for the jobs afterwards")
    parser.add_argument("--cards", type=int, default=2, help="GPU workers (default 2)")
    parser.add_argument(
        "--clock",
        type=float,
        default=0.005,
        help="wall seconds per second of simulated work (default 0.005: a 480p video takes 3.3 s)",
    )
    parser.add_argument("--users", type=int, default=8, help="users the jobs are spread over (default 8)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--database-url", help="a private PostgreSQL database (default: a private SQLite file)")
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    offers = workload(args.jobs, args.seconds, args.users, rng)
    print(
        f"chaos: {args.jobs} jobs over {args.seconds:g} s from {args.users} users; {args.cards} cards + encode +"
        f" decode; a kill every ~{args.kill_every:g} s; clock ×{args.clock:g}; seed {args.seed}",
        flush=True,
    )
    with own_stack(args.cards, args.clock, args.users, args.database_url, args.keep) as target:
        report = drill(
            target, offers, args.seconds, args.kill_every, rng, args.drain, say=lambda line: print(line, flush=True)
        )
    print("\n".join(report.lines()))
    print("OK: no accepted job lost, stuck, failed or recorded twice" if report.ok else "FAILED")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
