"""Submit latency with and without open event streams, on the real stack (`make up`'s ASGI API).

    python -m bench.streams [--streams 200] [--submits 150] [--clients 4] [--rounds 3]

Starts the stack as `make up` does (gunicorn with uvicorn workers, GENSERVER_API_WORKERS
processes), then:
1. starts the jobs the streams will watch (long simulated videos: progress events all along);
2. measures submit latency with no stream open (`--submits` POSTs of a 4-step 512² image from
   `--clients` threads);
3. opens `--streams` event streams on those jobs (each in its own thread, read as a client does, in
   a child process: its threads must not share this process's GIL with the timed submit threads)
   and waits until every one got its first event;
4. measures the same submits again while the streams stay open and receive events, then closes them;
5. repeats 2-4 `--rounds` times (on a shared machine the load of other work drifts from one minute
   to the next: alternating spreads it over both conditions), and prints each run and the pooled
   rounds as a table (P50, P99, throughput, the codes answered, the API processes' CPU time per
   submit) and the pooled ratio, which the target holds within 1.5×.

The watched jobs' own events depend on the scheduler: a long video shares its card with the
submitted images and may wait through the whole second run, sending nothing (runs measured 0 and
1,914 events). So during both runs this process also publishes a progress event of each watched
job `--event-rate` times a second, through the job service's publisher (`events.publish`, as a
worker's heartbeat does): the streams then carry a known load, and both runs the same publishing.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from urllib.parse import urlsplit

from bench.livestack import LiveStack, live_stack
from genserver.scheduling.simulator import pct

SCALE = 0.05  # the cost model's seconds × this: a 480p Wan video runs for minutes, a turbo image instantly
WATCHED = {
    "model": "wan-sim",
    "prompt": "a stream of progress",
    "width": 832,
    "height": 480,
    "num_frames": 81,
    "steps": 50,
}
EVENT_RATE = 2.0  # progress events per second per watched job, published by the bench in both runs
SUBMIT = {"model": "sdxl-turbo-sim", "prompt": "a lighthouse at dusk", "width": 512, "height": 512, "steps": 4}


class Streams:
    """`count` SSE readers over `job_ids`, each a thread holding one HTTP connection open."""

    def __init__(self, url: str, token: str, job_ids: list[str], count: int) -> None:
        self.url, self.token, self.stop = url, token, threading.Event()
        self.opened, self.events, self.ended, self.errors = 0, 0, 0, []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._read, args=(job_ids[i % len(job_ids)],), daemon=True) for i in range(count)
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, job_id: str) -> None:
        parts = urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        try:
            conn.request(
                "GET",
                f"/api/v1/jobs/{job_id}/events/",
                headers={"Authorization": f"Token {self.token}", "Accept": "text/event-stream"},
            )
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"stream answered {response.status}")
            first = True
            while not self.stop.is_set():
                line = response.readline()
                if not line:
                    break
                if line.startswith(b"data:"):
                    with self.lock:
                        self.events += 1
                        if first:
                            self.opened, first = self.opened + 1, False
            with self.lock:
                self.ended += 1
                if first:  # closed before its first event (the API worker went away): never open
                    self.errors.append("the stream ended before its first event")
        except Exception as exc:  # noqa: BLE001 - counted and reported: a benchmark must say what broke
            with self.lock:
                self.errors.append(repr(exc))
        finally:
            conn.close()

    def wait_open(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.opened + len(self.errors) >= len(self.threads):
                    break
            time.sleep(0.2)
        if self.errors or self.opened < len(self.threads):
            raise RuntimeError(f"{self.opened}/{len(self.threads)} streams open; errors: {self.errors[:3]}")

    def close(self) -> None:
        self.stop.set()


class Ticker:
    """Publish a progress event of each of `job_ids` `rate` times a second (the job service's publisher)."""

    def __init__(self, job_ids: list[str], rate: float) -> None:
        self.job_ids, self.rate, self.published, self.stop = job_ids, rate, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        if rate > 0:
            self.thread.start()

    def _run(self) -> None:
        from genserver.jobs import events

        tick = time.monotonic()
        while not self.stop.is_set():
            for job_id in self.job_ids:
                if events.publish(job_id, "progress") is None:
                    raise RuntimeError(f"could not publish an event of job {job_id} (see the log)")
                self.published += 1
            tick += 1 / self.rate
            self.stop.wait(max(0.0, tick - time.monotonic()))

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)


def _reader_process(url: str, token: str, job_ids: list[str], count: int, pipe: Connection) -> None:
    """The streams' client, in a process of its own: its 200 reader threads must not share the GIL with the
    submit threads whose latency is measured (real stream clients are other processes, other machines)."""
    streams = Streams(url, token, job_ids, count)
    try:
        streams.wait_open()
    except RuntimeError as failed:
        pipe.send(("failed", str(failed)))
        return
    pipe.send(("open", streams.events))
    while pipe.recv() != "stop":
        with streams.lock:
            pipe.send(("counts", streams.events, streams.ended, len(streams.errors)))
    with streams.lock:
        pipe.send(("counts", streams.events, streams.ended, len(streams.errors)))
    streams.close()


class StreamClients:
    """`Streams` in a child process (spawned), driven over a pipe."""

    def __init__(self, stack: LiveStack, job_ids: list[str], count: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipe, child = context.Pipe()
        self.process = context.Process(
            target=_reader_process, args=(stack.url, stack.token, job_ids, count, child), daemon=True
        )
        self.process.start()
        answer = self.pipe.recv() if self.pipe.poll(900) else ("failed", "no answer within 900 s")
        if answer[0] != "open":
            raise RuntimeError(f"the streams did not open: {answer[1]}")

    def counts(self) -> tuple[int, int, int]:
        """(events received, streams ended, stream errors) so far."""
        self.pipe.send("count")
        _, events_seen, ended, errors = self.pipe.recv()
        return events_seen, ended, errors

    def close(self) -> tuple[int, int, int]:
        self.pipe.send("stop")
        _, events_seen, ended, errors = self.pipe.recv()
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
        return events_seen, ended, errors


def _stat(proc: Path) -> list[str]:
    return (proc / "stat").read_text().rpartition(")")[2].split()  # after the command name: state, ppid, ...


def _ticks_to_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_seconds(root: int, needle: str = "") -> float:
    """CPU seconds used so far by the live descendants of process `root` (itself included) whose command line
    holds `needle` (Linux /proc; 0 elsewhere). The stack's API processes are gunicorn's."""
    stats: dict[int, list[str]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stats[int(proc.name)] = _stat(proc)
        except (OSError, ValueError):
            continue
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            if pid in stats and needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                total += _ticks_to_s(stats[pid])
        except (OSError, ValueError, IndexError):
            continue
    return total


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by process `pid` (0 when /proc cannot say)."""
    try:
        return _ticks_to_s(_stat(Path(f"/proc/{pid}")))
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class Run:
    """One timed run of submits: latencies, answers, throughput, and the API processes' CPU seconds."""

    latencies: list[float]
    codes: dict[int, int]
    elapsed: float
    api_cpu: float

    def p(self, q: float) -> float:
        return pct(self.latencies, q)

    def api_cpu_per_submit(self) -> float:
        return self.api_cpu / max(1, len(self.latencies))

    def row(self, name: str) -> str:
        answers = ", ".join(f"{c}×{n}" for c, n in sorted(self.codes.items()))
        return (
            f"| {name} | {self.p(0.5) * 1000:.1f} ms | {self.p(0.99) * 1000:.1f} ms | "
            f"{len(self.latencies) / self.elapsed:.1f} | {answers} | {self.api_cpu_per_submit() * 1000:.1f} |"
        )

    @staticmethod
    def pooled(runs: list[Run]) -> Run:
        codes: dict[int, int] = {}
        for run in runs:
            for code, n in run.codes.items():
                codes[code] = codes.get(code, 0) + n
        return Run(
            [x for run in runs for x in run.latencies],
            codes,
            sum(run.elapsed for run in runs),
            sum(run.api_cpu for run in runs),
        )


def timed_run(stack: LiveStack, root: int, args: argparse.Namespace) -> Run:
    api_before = cpu_seconds(root, "gunicorn")
    latencies, codes, elapsed = submit_load(stack, args.clients, args.submits)
    return Run(latencies, codes, elapsed, cpu_seconds(root, "gunicorn") - api_before)


def submit_load(stack: LiveStack, clients: int, count: int) -> tuple[list[float], dict[int, int], float]:
    """`count` submits from `clients` threads: (latencies, answers by status, seconds elapsed)."""

    def one(_: int) -> tuple[float, int]:
        started = time.perf_counter()
        code, _, _ = stack.request("POST", "/api/v1/jobs/", SUBMIT)
        return time.perf_counter() - started, code

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(count)))
    elapsed = time.perf_counter() - started
    codes: dict[int, int] = {}
    for _, code in results:
        codes[code] = codes.get(code, 0) + 1
    return [r[0] for r in results], codes, elapsed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--submits", type=int, default=150, help="timed submits per run")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of a run without and one with streams")
    parser.add_argument("--watched-jobs", type=int, default=2, help="long jobs the streams follow")
    parser.add_argument(
        "--event-rate", type=float, default=EVENT_RATE, help="progress events/s the bench publishes per watched job"
    )
    args = parser.parse_args(argv)
    env = {"GENSERVER_TIME_SCALE": str(SCALE)}
    runs: dict[bool, list[Run]] = {False: [], True: []}
    delivered, clients_cpu, still_open = 0, 0.0, []
    with live_stack(env, boot_timeout=600) as stack:  # a first boot makes the tiny models (minutes)
        # 1. the watched jobs (a refused one is skipped: admission may keep only one long video)
        watched = []
        for _ in range(args.watched_jobs):
            code, body, _ = stack.request("POST", "/api/v1/jobs/", WATCHED)
            if code == 201:
                watched.append(body["id"])
        if not watched:
            raise SystemExit("no watched job was accepted")
        submit_load(stack, args.clients, 10)  # warm-up: connections, imports, caches
        ticker = Ticker(watched, args.event_rate)
        root = stack.process.pid
        for round_no in range(1, args.rounds + 1):
            # 2. no streams
            runs[False].append(timed_run(stack, root, args))
            # 3. the streams, all open (each got its first event)
            streams = StreamClients(stack, watched, args.streams)
            print(f"round {round_no}: {args.streams} streams open", file=sys.stderr, flush=True)
            events_before, cpu_before = streams.counts()[0], process_cpu_seconds(streams.process.pid)
            # 4. the same submits while they stay open and receive events
            runs[True].append(timed_run(stack, root, args))
            events_after, ended, errors = streams.counts()
            delivered += events_after - events_before
            clients_cpu += process_cpu_seconds(streams.process.pid) - cpu_before
            still_open.append(args.streams - ended - errors)
            streams.close()
        ticker.close()
        for job_id in watched:
            stack.request("POST", f"/api/v1/jobs/{job_id}/cancel/")
    print(
        f"\n{args.rounds} rounds of {args.submits} submits from {args.clients} clients without, then with, "
        f"{args.streams} open streams; {len(watched)} watched job(s); {ticker.published} progress events published "
        f"by the bench ({args.event_rate:g}/s per watched job); {delivered} events delivered to the streams during "
        f"the runs with streams; streams still open at each run's end: {still_open}; the stream clients' process "
        f"used {clients_cpu:.1f} CPU s; load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n"
    )
    print("| run | submit P50 | submit P99 | submits/s | answers | API CPU ms per submit |")
    print("| --- | --- | --- | --- | --- | --- |")
    for with_streams in (False, True):
        name = f"{args.streams} open streams" if with_streams else "no streams"
        for number, run in enumerate(runs[with_streams], 1):
            print(run.row(f"{name}, round {number}"))
        print(Run.pooled(runs[with_streams]).row(f"**{name}, all rounds**"))
    base, loaded = Run.pooled(runs[False]), Run.pooled(runs[True])
    p50, p99 = loaded.p(0.5) / base.p(0.5), loaded.p(0.99) / base.p(0.99)
    print(
        f"\nratio with streams (all rounds): P50 {p50:.2f}×, P99 {p99:.2f}× (target: both ≤ 1.5×); "
        f"API CPU per submit {loaded.api_cpu_per_submit() / base.api_cpu_per_submit():.2f}×"
    )
    return 0 if p50 <= 1.5 and p99 <= 1.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
