"""Dispatch overhead of the live stack against a bare Celery round trip on the same Redis.

    python -m bench.overhead [--samples 30] [--clients 8] [--requests 200]
    DATABASE_URL=postgres://…/bench python -m bench.overhead     # on PostgreSQL: a new, empty database each run
                                                                 # (jobs left in it are re-published by the reaper)

Starts the real stack (simulated backend, 4 CPU "cards") and measures, in one run:
1. the bare Celery round trip: publish a no-op task to an idle card's queue,
   the task pushes its start time back, the sender BLPOPs it;
2. dispatch: submit → first denoising step of a 2-step job on an idle stack,
   on an embedding miss (a new prompt: API, admission, encode task, chunk task:
   two Celery hops and the DB writes) and on a hit (a prompt whose embeddings
   are stored: the submit publishes the first chunk itself, one hop);
3. the gap between consecutive chunks of one job (one step per chunk; the
   gap is wall time minus the simulated step time, spread over the chunk boundaries),
   and the workers' own timing of those boundaries (`genserver_chunk_boundary_seconds`,
   scraped from /metrics: the share at or under each bucket, so the P50's bracket);
4. the API's submit throughput and latency under concurrent clients: with the workers running the jobs
   beside it on the same cores, and again with every worker paused (the API alone), with the CPU time its
   gunicorn workers spent per submit in that second run (what bounds the throughput on these cores); then,
   still paused, with each client's submits over one kept connection (as an SDK's HTTP client sends them)
   instead of a new connection per submit.

    python -m bench.overhead --tiny-boundaries     # instead: the workers' chunk boundaries on the tiny models

boots the stack with GENSERVER_CHUNK_SECONDS=0.001 (one step per chunk), runs a 50-step tiny-sd image and a
50-step tiny-wan video on the CPU cards, and reads their boundaries from /metrics as in 3.

    python -m bench.overhead --hand-over --samples 15   # instead: images preempting a video on one card

boots a stack of one card, runs a 50-step seed-video on it three times, and submits `samples` 2-step seed-image
jobs (a stored prompt) one after another while each runs: each waits for the video's step under way to end,
then for the hand-over (the video's boundary: its yield test, checkpoint and record; Celery's ack and delivery
of the image's message; its claim) before its own first step. Prints the images' wait (submit → first step) and
that wait beyond half a video step, the mean a step under way still has to run when an image arrives.

    python -m bench.overhead --step-cost --samples 10   # instead: the service's own work per denoising step

boots the stack three times in turn (the cancel flags read from Redis before every step, GENSERVER_FLAG_RECHECK=0;
the default's announcements; the first again) and prints what a step takes beyond its modelled time.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from bench.livestack import LiveStack, live_stack
from genserver.scheduling.simulator import pct

SCALE = 0.02


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def bare_round_trip(samples: int) -> list[float]:
    from genserver.celery import app
    from genserver.jobs.broker import PING_TASK
    from genserver.redis_client import client

    times = []
    for _ in range(samples):
        key = f"genserver:probe:{uuid.uuid4()}"
        sent = time.time()
        app.send_task(PING_TASK.name, args=[key, sent], queue="short", priority=0)
        client().blpop([key], timeout=10)
        times.append(time.time() - sent)
    return times


def wait_terminal(stack: LiveStack, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, job, _ = stack.request("GET", f"/api/v1/jobs/{job_id}/")
        if job["status"] in ("succeeded", "failed", "cancelled", "expired"):
            return job
        time.sleep(0.05)
    raise RuntimeError(f"job {job_id} did not finish")


def dispatch_latency(stack: LiveStack, samples: int, hit: bool) -> list[float]:
    """Submit → first step, one job at a time on an idle stack (a 2-step, 0.2 s job): `hit`, the same prompt
    each time (its embeddings stored by a first job, not counted), else a new prompt each time."""
    run = uuid.uuid4().hex[:8]
    out = []
    for i in range(-1 if hit else 0, samples):
        prompt = f"probe hit {run}" if hit else f"probe {run} {i}"
        status, job, _ = stack.request("POST", "/api/v1/jobs/", {"model": "seed-image", "prompt": prompt, "steps": 2})
        assert status == 201, job
        job = wait_terminal(stack, job["id"])
        if i >= 0:
            out.append(_ts(job["started_at"]) - _ts(job["created_at"]))
    return out


def chunk_gap(stack: LiveStack) -> tuple[float, int]:
    """(mean seconds between consecutive chunks of one job, chunk boundaries measured)."""
    status, job, _ = stack.request("POST", "/api/v1/jobs/", {"model": "seed-video", "prompt": "gap probe", "steps": 50})
    assert status == 201, job
    job = wait_terminal(stack, job["id"], timeout=300)
    from genserver.jobs.models import Job

    row = Job.objects.get(pk=job["id"])
    chunks = -(-row.steps // row.chunk_steps)
    stepping = row.estimated_seconds * row.clock_scale * (row.steps - 1) / row.steps  # first step → last step
    # started_at is the first step's end; finished_at follows the last step, the decode hop and decode.
    span = _ts(job["finished_at"]) - _ts(job["started_at"])
    return (span - stepping) / max(1, chunks - 1), chunks - 1


def boundary_shares(stack: LiveStack, model: str) -> dict[float, float]:
    """{bucket bound in seconds: share of the model's chunk boundaries at or under it} from GET /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(
        stack.url + "/metrics", headers={"Authorization": f"Bearer {stack.env['GENSERVER_METRICS_TOKEN']}"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    buckets = {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "genserver_chunk_boundary_seconds_bucket" and sample.labels.get("model") == model
    }
    total = buckets.get(float("inf"), 0.0)
    return {bound: n / total for bound, n in sorted(buckets.items()) if total and bound != float("inf")}


def submit_load(
    stack: LiveStack, clients: int, requests: int, keep_connections: bool = False
) -> tuple[list[float], dict[int, int], float]:
    """`requests` submits from `clients` threads: each on a new connection (urllib), or with `keep_connections`
    each client's over one kept HTTP/1.1 connection, as an SDK's client (httpx, requests' sessions) sends them."""
    kept = threading.local()
    opened: list[http.client.HTTPConnection] = []  # closed once the load is done

    def one(i: int) -> tuple[float, int]:
        body = {"model": "seed-image", "prompt": f"load {i}", "steps": 2}
        t = time.perf_counter()
        if keep_connections:
            if getattr(kept, "connection", None) is None:
                kept.connection = http.client.HTTPConnection(urllib.parse.urlsplit(stack.url).netloc, timeout=30)
                opened.append(kept.connection)
            headers = {"Authorization": f"Token {stack.token}", "Content-Type": "application/json"}
            kept.connection.request("POST", "/api/v1/jobs/", json.dumps(body), headers)
            response = kept.connection.getresponse()
            response.read()
            status = response.status
        else:
            status, _, _ = stack.request("POST", "/api/v1/jobs/", body)
        return time.perf_counter() - t, status

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, range(requests)))
    elapsed = time.perf_counter() - started
    for connection in opened:
        connection.close()
    codes: dict[int, int] = {}
    for _, code in results:
        codes[code] = codes.get(code, 0) + 1
    return [r[0] for r in results], codes, requests / elapsed


@contextlib.contextmanager
def workers_paused() -> Iterator[None]:
    """Every worker of the stack stops taking messages inside the block (Celery's cancel_consumer, then
    add_consumer): the submits of the load then cost the API alone, not the API and the 2 cores' workers
    running each job's encode, chunk and decode beside it. Their messages wait, and run once let go."""
    from genserver.celery import app

    active = app.control.inspect(timeout=2.0).active_queues() or {}
    for hostname, queues in active.items():
        for queue in queues:
            app.control.cancel_consumer(queue["name"], destination=[hostname], reply=True, timeout=2.0)
    try:
        yield
    finally:
        for hostname, queues in active.items():
            for queue in queues:
                app.control.add_consumer(queue["name"], destination=[hostname], reply=True, timeout=2.0)


def stack_env() -> dict[str, str]:
    """The stack this benchmark (and bench.submit_profile) boots: simulated cards on the fast clock, on
    PostgreSQL when DATABASE_URL is given (a database of its own: it is written to), else a private SQLite."""
    env = {
        "GENSERVER_TIME_SCALE": str(SCALE),
        "GENSERVER_CPU_WORKERS": "4",
        "GENSERVER_REGISTRY": "genserver/registry.toml:bench/seed-registry.toml",
        "GENSERVER_METRICS_TOKEN": uuid.uuid4().hex,  # this run's scrape of the workers' boundary timings
    }
    if os.environ.get("DATABASE_URL"):
        env["DATABASE_URL"] = os.environ["DATABASE_URL"]
    return env


def ms(xs: Sequence[float], q: float) -> str:
    return f"{pct(xs, q) * 1000:7.1f} ms"


def boundary_line(label: str, shares: dict[float, float]) -> str:
    """The share of boundaries at or under each bucket up to 25 ms, and the bucket that holds the P50."""
    median = next((bound for bound, share in shares.items() if share >= 0.5), None)
    return (
        f"{label:27}"
        + "  ".join(f"≤{bound * 1000:g} ms {share:.0%}" for bound, share in shares.items() if bound <= 0.025)
        + (f"  → P50 ≤ {median * 1000:g} ms" if median is not None else "")
    )


# The tiny models' jobs of --tiny-boundaries: 50 steps each, one step per chunk (49 boundaries a job).
TINY_JOBS = (
    {"model": "tiny-sd", "prompt": "boundary probe", "steps": 50},
    {"model": "tiny-wan", "prompt": "boundary probe", "steps": 50},
)


def tiny_boundaries() -> int:
    with live_stack(stack_env() | {"GENSERVER_CHUNK_SECONDS": "0.001"}) as stack:
        for body in TINY_JOBS:
            status, job, _ = stack.request("POST", "/api/v1/jobs/", body)
            assert status == 201, job
            job = wait_terminal(stack, job["id"], timeout=300)
            assert job["status"] == "succeeded", job
            print(boundary_line(f"chunk boundary, {body['model']}", boundary_shares(stack, body["model"])))
    return 0


def hand_over(samples: int, videos: int = 3) -> int:
    video_step = 2.4 * SCALE  # seed-video 832×480: 2.4 s a step, modelled
    waits: list[float] = []
    with live_stack(stack_env() | {"GENSERVER_CPU_WORKERS": "1"}) as stack:
        probe = {"model": "seed-image", "prompt": "hand-over probe", "steps": 2}
        status, job, _ = stack.request("POST", "/api/v1/jobs/", probe)  # stores the prompt's embeddings
        assert status == 201, job
        wait_terminal(stack, job["id"])
        for _ in range(videos):
            status, video, _ = stack.request("POST", "/api/v1/jobs/", {"model": "seed-video", "prompt": "hand-over"})
            assert status == 201, video
            while not stack.request("GET", f"/api/v1/jobs/{video['id']}/")[1].get("started_at"):
                time.sleep(0.01)
            for _ in range(samples):
                time.sleep(0.09)  # a phase of the video's step of its own
                status, job, _ = stack.request("POST", "/api/v1/jobs/", probe)
                assert status == 201, job
                job = wait_terminal(stack, job["id"])
                if stack.request("GET", f"/api/v1/jobs/{video['id']}/")[1]["status"] != "denoising":
                    break  # the video ended: this image may have found the card idle
                waits.append(_ts(job["started_at"]) - _ts(job["created_at"]))
            wait_terminal(stack, video["id"], timeout=300)
    print(f"images behind a video on one card: submit → first step  P50 {ms(waits, 0.5)}  P90 {ms(waits, 0.9)}")
    beyond = statistics.mean(waits) - video_step / 2
    print(
        f"  mean {statistics.mean(waits) * 1000:.1f} ms, beyond half a video step ({video_step * 500:.0f} ms)"
        f" {beyond * 1000:.1f} ms: the submit's own path and the hand-over (n={len(waits)})"
    )
    return 0


# --step-cost: seed-image jobs of these many steps (512², 0.1 s a step modelled), each one chunk, run one at a time.
STEP_COST_STEPS = (20, 100)
# The settings compared, side by side: the flags read from Redis before every step, and the default's announcements.
FLAG_RECHECKS = (("read before every step", "0"), ("announced (the default)", ""))


def step_cost(pairs: int) -> int:
    """What the service adds to each denoising step, with the cancel flags read before every step and with the
    default's announcements: the wall time of a 100-step job less a 20-step one's (submitted in turn, `pairs` of
    each), over the 80 steps between them, less the modelled step. Stacks booted in turn, A B A, each measured in
    a process of its own (this one's Django and Celery stay bound to the first stack's broker)."""
    modelled = 0.1 * SCALE
    print(f"the service's own work per step, {STEP_COST_STEPS[1]}- less {STEP_COST_STEPS[0]}-step seed-image jobs:")
    for label, recheck in (*FLAG_RECHECKS, FLAG_RECHECKS[0]):
        argv = [sys.executable, "-m", "bench.overhead", "--samples", str(pairs), "--step-cost-stack", recheck]
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        per_step = [seconds - modelled for seconds in json.loads(done.stdout.strip().splitlines()[-1])]
        us = [f"{pct(per_step, q) * 1e6:4.0f} µs" for q in (0.5, 0.25, 0.75)]
        print(
            f"  {label:24} P50 {us[0]}  (quartiles {us[1]} / {us[2]}, n={len(per_step)};"
            f" a modelled step: {modelled * 1e6:.0f} µs)",
            flush=True,
        )
    return 0


def step_cost_stack(pairs: int, recheck: str) -> int:
    """One stack of `step_cost` (GENSERVER_FLAG_RECHECK=`recheck`, the default when empty): prints the wall
    seconds per step of each pair, as JSON."""
    env = stack_env() | {"GENSERVER_CHUNK_SECONDS": "1000"}  # one chunk: no boundary in the difference
    if recheck:
        env["GENSERVER_FLAG_RECHECK"] = recheck
    per_step = []
    with live_stack(env) as stack:
        for i in range(-1, pairs):  # the first pair warms the cards' caches and is not counted
            took = []
            for steps in STEP_COST_STEPS:
                body = {"model": "seed-image", "prompt": "step cost", "steps": steps, "seed": i + 1}
                status, job, _ = stack.request("POST", "/api/v1/jobs/", body)
                assert status == 201, job
                job = wait_terminal(stack, job["id"])
                assert job["status"] == "succeeded", job
                took.append(_ts(job["finished_at"]) - _ts(job["started_at"]))
            if i >= 0:
                per_step.append((took[1] - took[0]) / (STEP_COST_STEPS[1] - STEP_COST_STEPS[0]))
    print(json.dumps(per_step))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tiny-boundaries", action="store_true", help="only the tiny models' chunk boundaries")
    parser.add_argument("--step-cost", action="store_true", help="only the service's own work per step")
    parser.add_argument("--hand-over", action="store_true", help="only images preempting a video on one card")
    parser.add_argument("--step-cost-stack", metavar="RECHECK", help=argparse.SUPPRESS)  # one stack of --step-cost
    args = parser.parse_args(argv)
    if args.tiny_boundaries:
        return tiny_boundaries()
    if args.step_cost_stack is not None:
        return step_cost_stack(args.samples, args.step_cost_stack)
    if args.step_cost:
        return step_cost(args.samples)
    if args.hand_over:
        return hand_over(args.samples)
    with live_stack(stack_env()) as stack:
        bare = bare_round_trip(args.samples)
        miss = dispatch_latency(stack, args.samples, hit=False)
        hit = dispatch_latency(stack, args.samples, hit=True)
        gap, boundaries = chunk_gap(stack)
        shares = boundary_shares(stack, "seed-video")
        latencies, codes, throughput = submit_load(stack, args.clients, args.requests)
        with workers_paused():
            cpu = stack.api_cpu_seconds()
            alone, alone_codes, alone_throughput = submit_load(stack, args.clients, args.requests)
            api_cpu = (stack.api_cpu_seconds() - cpu) / args.requests
            kept, kept_codes, kept_throughput = submit_load(stack, args.clients, args.requests, keep_connections=True)
    print(f"bare Celery round trip     P50 {ms(bare, 0.5)}  P99 {ms(bare, 0.99)}  (n={len(bare)})")
    for name, dispatch in (("miss", miss), ("hit", hit)):
        print(
            f"submit → first step, {name:4} P50 {ms(dispatch, 0.5)}  P99 {ms(dispatch, 0.99)}  (n={len(dispatch)})"
            f"  = {pct(dispatch, 0.5) / pct(bare, 0.5):.2f} × bare at P50"
        )
    print(f"gap between chunks         mean {gap * 1000:7.1f} ms over {boundaries} boundaries")
    print(boundary_line("chunk boundary (workers)", shares))
    print(
        f"submit under {args.clients} clients     P50 {ms(latencies, 0.5)}  P99 {ms(latencies, 0.99)}  "
        f"{throughput:.0f} req/s  codes {codes}"
    )
    print(
        f"  the same, workers paused P50 {ms(alone, 0.5)}  P99 {ms(alone, 0.99)}  "
        f"{alone_throughput:.0f} req/s  codes {alone_codes}  (the API alone: no job runs beside the submits)"
    )
    print(
        f"  the same, kept connections P50 {ms(kept, 0.5)}  P99 {ms(kept, 0.99)}  "
        f"{kept_throughput:.0f} req/s  codes {kept_codes}  (each client's submits over one HTTP/1.1 connection)"
    )
    cores = os.cpu_count() or 1
    print(
        f"  the API's CPU per submit {api_cpu * 1000:6.1f} ms  (its workers, paused run: {cores} cores would serve"
        f" at most {cores / api_cpu:.0f} req/s with nothing else running)"
    )
    print(
        f"(mean bare {statistics.mean(bare) * 1000:.1f} ms, mean dispatch on a miss"
        f" {statistics.mean(miss) * 1000:.1f} ms, on a hit {statistics.mean(hit) * 1000:.1f} ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
