"""What one job costs Redis and the database, end to end, on the real stack (for docs/DEPLOY.md).

    python -m bench.cluster_load [--idle 20]

Starts the real service (`python -m workers.stack`, bench/livestack.py: API,
encode/decode workers, 2 CPU "cards", beat) with DJANGO_DEBUG=1 and DEBUG logs,
so every process (API, workers, beat) logs each SQL statement it runs; Redis
counts every command it serves (INFO commandstats). Then:

1. an idle window: what the cluster costs with nothing to do (heartbeats, the
   workers' broker polls, beat's reaper), per second;
2. one job at a time (an image of 30 steps, a 480p video of 50 steps, simulated
   backend): submit, poll GET /api/v1/jobs/{id}/ once a second as a client does,
   until it ends; the counts in its window minus the idle rate over that window.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from bench.livestack import LiveStack, live_stack

SQL_LINE = re.compile(r"^\(\d+\.\d+\) ")  # django.db.backends' DEBUG line: "(0.001) SELECT ...; args=..."
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


class Counters:
    """Redis commands (INFO commandstats) and SQL statements (the stack's log) since the last reset."""

    def __init__(self, log: Path) -> None:
        from genserver.redis_client import client

        self.redis = client()
        self.log = log
        self.reset()

    def reset(self) -> None:
        self.redis.config_resetstat()
        self.offset = self.log.stat().st_size
        self.started = time.monotonic()

    def read(self) -> tuple[float, dict[str, int], int]:
        """(seconds since reset, Redis calls per command, SQL statements)."""
        seconds = time.monotonic() - self.started
        stats = self.redis.info("commandstats")
        calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
        calls.pop("config", None)
        calls.pop("info", None)  # ours
        with self.log.open("rb") as f:
            f.seek(self.offset)
            sql = sum(1 for line in f.read().decode(errors="replace").splitlines() if SQL_LINE.match(line))
        return seconds, calls, sql


def run_job(stack: LiveStack, body: dict) -> dict:
    _, job, _ = stack.request("POST", "/api/v1/jobs/", body)
    while job["status"] not in ("succeeded", "failed", "cancelled", "expired"):
        time.sleep(1.0)  # a client polling once a second
        _, job, _ = stack.request("GET", f"/api/v1/jobs/{job['id']}/")
    return job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of the idle window")
    args = parser.parse_args()
    env = {
        "DJANGO_DEBUG": "1",
        "GENSERVER_LOG_LEVEL": "DEBUG",
        "GENSERVER_WORKER_LOGLEVEL": "DEBUG",
        "GENSERVER_TIME_SCALE": "0.02",
        "GENSERVER_CPU_WORKERS": "2",
        "GENSERVER_REAPER_INTERVAL": "5",
    }
    with live_stack(env, boot_timeout=600) as stack:
        log = Path(stack.env["GENSERVER_DATA_DIR"]) / "stack.log"
        counters = Counters(log)
        time.sleep(args.idle)
        idle_s, idle_calls, idle_sql = counters.read()
        idle_redis = sum(idle_calls.values()) / idle_s
        print(
            f"idle cluster (API, encode, decode, 2 cards, beat): {idle_redis:.1f} Redis commands/s, "
            f"{idle_sql / idle_s:.2f} SQL statements/s"
        )
        print(f"  idle Redis by command: {dict(sorted(idle_calls.items(), key=lambda kv: -kv[1]))}")
        print("\n| job | wall s | Redis commands (net of idle) | SQL statements (net of idle) | top Redis commands |")
        print("| --- | ---: | ---: | ---: | --- |")
        for name, body in JOBS.items():
            counters.reset()
            job = run_job(stack, body)
            seconds, calls, sql = counters.read()
            assert job["status"] == "succeeded", job
            net_redis = sum(calls.values()) - idle_redis * seconds
            net_sql = sql - idle_sql / idle_s * seconds
            top = ", ".join(f"{k} {v}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:6])
            print(f"| {name} | {seconds:.1f} | {net_redis:.0f} | {net_sql:.0f} | {top} |", flush=True)


if __name__ == "__main__":
    main()
