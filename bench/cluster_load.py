"""What one job costs Redis and the database, end to end, on the real stack (for docs/DEPLOY.md).

    python -m bench.cluster_load [--idle 20] [--polls 20] [--database-url postgres://...] [--time-scale 0.02]

Starts the real service (`python -m workers.stack`, bench/livestack.py: API,
encode/decode workers, 2 CPU "cards", beat; simulated backend at
GENSERVER_TIME_SCALE=0.02 unless `--time-scale` says) on a private bundled Redis, which counts every
command it serves (INFO commandstats), and on the database `--database-url`
(PostgreSQL, as in production; without it a private SQLite file). Every process
of the stack counts the SQL statements it runs (bench/sqlcount/sitecustomize.py,
on their PYTHONPATH: an execute wrapper on each database connection, one line
per statement in a file per process), so the figures say which process sent
them. On PostgreSQL the database's own count of transactions
(pg_stat_database) is printed next to them. Then:

1. an idle window: what the cluster costs with nothing to do (heartbeats, the
   workers' broker polls, beat's reaper), per second;
2. one job at a time (an image of 30 steps, a 480p video of 50 steps): submit,
   poll GET /api/v1/jobs/{id}/ once a second as a client does, until it ends;
   the counts in its window minus the idle rate over that window, by process:
   the submit (the API during the POST), the polls, encode, the card workers
   (every chunk), decode, beat;
3. `--polls` GETs of the finished job: the statements one poll costs.

What a job costs per chunk and stage does not depend on the clock, but the
lease renewals do: a card renews (and records progress) at most once a second,
between steps, and decode renews every second. At the default ×0.02 clock a
video's 6 s steps last 0.12 s and renew only at their chunk's start;
`--time-scale 1` runs the jobs at the cost model's real speed (about 6 minutes
for the video) and counts what production sends.

The database must be one the benchmark may write to (it migrates it and adds
jobs, users and tokens); it is not emptied.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.livestack import LiveStack, live_stack

ROOT = Path(__file__).resolve().parent.parent
JOBS = {
    "image 1024² 30 steps": {"model": "sdxl-sim", "prompt": "a lighthouse", "width": 1024, "height": 1024, "steps": 30},
    "video 480p 81 frames 50 steps": {
        "model": "wan-sim",
        "prompt": "a wave",
        "width": 832,
        "height": 480,
        "num_frames": 81,
        "steps": 50,
    },
}
PG_STATS_DELAY = 11.0
ROLES = ("api", "encode", "cards", "decode", "beat", "other")


def role_group(role: str) -> str:
    """A process's role (the file name's prefix) as one of ROLES: every denoising worker is a card."""
    if role in ("api", "encode", "decode", "beat"):
        return role
    if role.startswith(("gpu", "card", "cpu", "group")):
        return "cards"
    return "other"  # manage.py (the benchmark's staff token), flower


class SqlCounter:
    """SQL statements per process role, from the per-process files bench/sqlcount writes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: dict[Path, int] = {}
        self.reset()

    def reset(self) -> None:
        self.offsets = {path: path.stat().st_size for path in self.directory.glob("*.sql")}

    def read(self) -> tuple[Counter[str], Counter[str]]:
        """(statements per role group, statements per verb) since the last reset."""
        roles: Counter[str] = Counter()
        verbs: Counter[str] = Counter()
        for path in self.directory.glob("*.sql"):
            with path.open() as f:
                f.seek(self.offsets.get(path, 0))
                lines = f.read().splitlines()
            roles[role_group(path.name.rsplit("-", 1)[0])] += len(lines)
            verbs.update(lines)
        return roles, verbs


class Counters:
    """Redis commands (INFO commandstats), SQL statements per process, and on PostgreSQL the
    database's transactions, since the last reset."""

    def __init__(self, sql_dir: Path) -> None:
        from django.db import connection

        from genserver.redis_client import client

        self.redis = client()
        self.sql = SqlCounter(sql_dir)
        self.pg = connection if connection.vendor == "postgresql" else None
        self.reset()

    def transactions(self) -> int:
        if self.pg is None:
            return 0
        with self.pg.cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
            )
            return int(cursor.fetchone()[0])

    def reset(self) -> None:
        self.redis.config_resetstat()
        self.sql.reset()
        self.xacts = self.transactions()
        self.started = time.monotonic()

    def read(self) -> tuple[float, dict[str, int], Counter[str], Counter[str], int]:
        """(seconds since reset, Redis calls per command, SQL per role, SQL per verb, transactions)."""
        seconds = time.monotonic() - self.started
        stats = self.redis.info("commandstats")
        calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
        calls.pop("config", None)
        calls.pop("info", None)  # ours
        roles, verbs = self.sql.read()
        if self.pg is not None:
            time.sleep(PG_STATS_DELAY)  # an idle backend publishes its pending statistics within 10 s
        return seconds, calls, roles, verbs, self.transactions() - self.xacts


def run_job(stack: LiveStack, body: dict, counters: Counters) -> tuple[dict, int, int]:
    """(the finished job, the API's statements during the submit, the polls made)."""
    _, job, _ = stack.request("POST", "/api/v1/jobs/", body)
    submit_sql = counters.sql.read()[0]["api"]
    polls = 0
    while job["status"] not in ("succeeded", "failed", "cancelled", "expired"):
        time.sleep(1.0)  # a client polling once a second
        _, job, _ = stack.request("GET", f"/api/v1/jobs/{job['id']}/")
        polls += 1
    return job, submit_sql, polls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of the idle window")
    parser.add_argument("--polls", type=int, default=20, help="GETs of a finished job, for one poll's cost")
    parser.add_argument("--database-url", help="the stack's database (PostgreSQL); default: a private SQLite file")
    parser.add_argument("--time-scale", default="0.02", help="GENSERVER_TIME_SCALE of the simulated work")
    args = parser.parse_args()
    sql_dir = Path(tempfile.mkdtemp(prefix="genserver-sqlcount-"))
    env = {
        "GENSERVER_TIME_SCALE": args.time_scale,
        "GENSERVER_CPU_WORKERS": "2",
        "GENSERVER_REAPER_INTERVAL": "5",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "bench" / "sqlcount"), os.environ.get("PYTHONPATH")])),
        "BENCH_SQLCOUNT_DIR": str(sql_dir),
    }
    if args.database_url:
        env["DATABASE_URL"] = args.database_url
    with live_stack(env, boot_timeout=600) as stack:
        counters = Counters(sql_dir)
        print(
            f"database: {counters.pg.vendor if counters.pg else 'sqlite'}; clock ×{args.time_scale}; "
            f"SQL counted per process in {sql_dir}"
        )
        time.sleep(args.idle)
        idle_s, idle_calls, idle_roles, _, idle_xacts = counters.read()
        idle_xact_rate = idle_xacts / (idle_s + PG_STATS_DELAY)  # the transactions' window ends after the delay
        idle_redis = sum(idle_calls.values()) / idle_s
        print(
            f"idle cluster (API, encode, decode, 2 cards, beat): {idle_redis:.1f} Redis commands/s, "
            f"{sum(idle_roles.values()) / idle_s:.2f} SQL statements/s {dict(idle_roles)}, "
            f"{idle_xact_rate:.2f} transactions/s (server)"
        )
        print(f"  idle Redis by command: {dict(sorted(idle_calls.items(), key=lambda kv: -kv[1]))}")
        print(
            "\n| job | wall s | polls | Redis commands (net of idle) | SQL statements, polls excluded (net of idle) "
            "| submit | encode | cards (chunks) | decode | beat | polls' SQL "
            "| transactions (server, polls incl., net of idle) | top Redis commands |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        finished = []
        for name, body in JOBS.items():
            counters.reset()
            job, submit_sql, polls = run_job(stack, body, counters)
            seconds, calls, roles, verbs, xacts = counters.read()
            net_xacts = xacts - idle_xact_rate * (seconds + (PG_STATS_DELAY if counters.pg else 0))
            assert job["status"] == "succeeded", job
            net_redis = sum(calls.values()) - idle_redis * seconds
            net = {role: roles[role] - idle_roles[role] / idle_s * seconds for role in ROLES}
            polls_sql = roles["api"] - submit_sql
            total = sum(v for role, v in net.items() if role not in ("api", "other")) + submit_sql
            from genserver.jobs.models import Job

            chunks = Job.objects.get(id=job["id"]).chunks_run
            top = ", ".join(f"{k} {v}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:6])
            print(
                f"| {name} | {seconds:.1f} | {polls} | {net_redis:.0f} | {total:.0f} | {submit_sql} "
                f"| {net['encode']:.0f} | {net['cards']:.0f} ({chunks}) | {net['decode']:.0f} | {net['beat']:.0f} "
                f"| {polls_sql} | {net_xacts:.0f} | {top} |",
                flush=True,
            )
            print(f"  <!-- SQL by verb, polls included: {dict(verbs.most_common())} -->")
            finished.append(job["id"])
        counters.reset()
        for _ in range(args.polls):
            stack.request("GET", f"/api/v1/jobs/{finished[-1]}/")
        seconds, calls, roles, _, _ = counters.read()
        per_poll = roles["api"] / args.polls
        redis_per_poll = (sum(calls.values()) - idle_redis * seconds) / args.polls
        print(
            f"\none poll (GET /api/v1/jobs/{{id}}/ of a finished job): {per_poll:.1f} SQL statements, "
            f"{redis_per_poll:.1f} Redis commands (net of idle)"
        )


if __name__ == "__main__":
    main()
