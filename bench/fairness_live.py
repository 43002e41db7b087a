"""bench.fairness --live: user A's burst and user B's images through the real stack (two users, two tokens).

The stack runs the simulated backend on 4 CPU "cards" (`bench.replay`'s set-up: the seed's registry,
the clock compressed by `scale`). One boot with the fair window on runs B alone, A alone, then A and B
together; a second boot with GENSERVER_FAIR_WINDOW=0 runs A and B first-come. Times come from the job
records (created → first step → finished, wall seconds ÷ scale = seconds of the modelled card); A's burst
is sent by 4 threads so that "at once" costs a few wall seconds of HTTP, not 300 round trips.
"""

from __future__ import annotations

import http.client
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

from bench import fairness
from bench.livestack import LiveStack, as_user, live_stack
from bench.replay import SHAPES
from genserver.scheduling.chunking import DEFAULT_CHUNK_SECONDS
from genserver.scheduling.simulator import Request

TERMINAL = ("succeeded", "failed", "cancelled", "expired")


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _submit(client: LiveStack, req: Request, tag: str) -> str | None:
    """POST one job; a dropped connection (the API restarting a worker on this loaded machine) is retried
    a few times (a job recorded by the dropped attempt would be a rare duplicate of A's, counted in A's drain)."""
    for attempt in range(5):
        try:
            status, body, _ = client.request("POST", "/api/v1/jobs/", SHAPES[req.seconds] | {"prompt": tag})
            return body["id"] if status == 201 else None
        except (OSError, http.client.HTTPException):
            time.sleep(0.2 * (attempt + 1))
    return None


def _run(a: LiveStack | None, b: LiveStack | None, scale: float, label: str) -> dict[str, list[dict]]:
    """Send B's images at their arrival times (× scale) and A's burst at BURST_AT, wait until all end;
    each user's finished job records."""
    ids: dict[str, list[str]] = {"A": [], "B": []}
    start = time.time()
    burst = fairness.user_a() if a is not None else []
    singles = fairness.user_b() if b is not None else []

    def send_b() -> None:
        assert b is not None
        for i, req in enumerate(singles):
            delay = start + req.arrival * scale - time.time()
            if delay > 0:
                time.sleep(delay)
            ids["B"].append(_submit(b, req, f"{label} B {i}") or "")

    sender = threading.Thread(target=send_b) if b is not None else None
    if sender is not None:
        sender.start()
    if a is not None:
        delay = start + fairness.BURST_AT * scale - time.time()
        if delay > 0:
            time.sleep(delay)
        with ThreadPoolExecutor(4) as pool:
            ids["A"] = [x or "" for x in pool.map(lambda p: _submit(a, p[1], f"{label} A {p[0]}"), enumerate(burst))]
    if sender is not None:
        sender.join()
    out: dict[str, list[dict]] = {}
    for user, client in (("A", a), ("B", b)):
        if client is None:
            continue
        wanted = {i for i in ids[user] if i}
        deadline = time.time() + 3600 * scale + 300
        while True:
            jobs = [j for j in client.all_jobs() if j["id"] in wanted]
            if all(j["status"] in TERMINAL for j in jobs) or time.time() > deadline:
                break
            time.sleep(1)
        refused = sum(1 for i in ids[user] if not i)
        if refused:
            print(f"{label}: {refused} of {user}'s submits refused", file=sys.stderr)
        out[user] = jobs
    return out


def _figures(jobs: Sequence[dict], scale: float) -> tuple[list[float], list[float], list[float], list[float]]:
    """(waits, latencies, created, finished) of the succeeded jobs, in modelled seconds."""
    done = [j for j in jobs if j["status"] == "succeeded" and j["started_at"]]
    created = [_ts(j["created_at"]) / scale for j in done]
    started = [_ts(j["started_at"]) / scale for j in done]
    finished = [_ts(j["finished_at"]) / scale for j in done]
    return (
        [s - c for s, c in zip(started, created, strict=True)],
        [f - c for f, c in zip(finished, created, strict=True)],
        created,
        finished,
    )


def _row(name: str, result: dict[str, list[dict]], scale: float) -> fairness.Row:
    b_wait = b_lat = None
    drain = bound = None
    if "B" in result:
        waits, lats, _, _ = _figures(result["B"], scale)
        b_wait, b_lat = fairness.b_figures(waits, lats)
    if "A" in result:
        _, _, created, finished = _figures(result["A"], scale)
        first = min(created)
        drain = max(finished) - first
        a_work = sum(r.seconds for r in fairness.user_a())
        b_work = 0.0
        if "B" in result:
            _, _, b_created, _ = _figures(result["B"], scale)
            b_work = fairness.B_SECONDS * sum(1 for c in b_created if first <= c < first + drain)
        bound = (a_work + b_work) / fairness.CARDS
    return fairness.Row(name, b_wait, b_lat, drain, bound)


def run_live(window: int, scale: float, boots: Sequence[str] = ("fair", "fcfs")) -> dict[str, fairness.Row]:
    """B alone, A alone and A + B under `window` (boot "fair"), then A + B first-come (boot "fcfs")."""
    base = {
        "GENSERVER_TIME_SCALE": str(scale),
        "GENSERVER_CPU_WORKERS": str(fairness.CARDS),
        "GENSERVER_CHUNK_SECONDS": str(DEFAULT_CHUNK_SECONDS),
        "GENSERVER_REGISTRY": "genserver/registry.toml:bench/seed-registry.toml",
        # The short class's 60-s limit would refuse most of A's 1,100 card-seconds: not what is measured.
        "GENSERVER_ADMIT_SHORT_SECONDS": "100000",
        "GENSERVER_ADMIT_MEDIUM_SECONDS": "100000",
        "GENSERVER_ADMIT_LONG_SECONDS": "100000",
    }
    rows: dict[str, fairness.Row] = {}
    redis_url = os.environ.get("REDIS_URL")  # live_stack points this process at its broker: undone per boot
    fair_name, fcfs_name = f"A + B, fair (window {window})", "A + B, first-come (window 0)"
    if "fair" in boots:
        with live_stack(base | {"GENSERVER_FAIR_WINDOW": str(window)}) as stack:
            a, b = as_user(stack, "bench-a"), as_user(stack, "bench-b")
            rows["B alone"] = _row("B alone", _run(None, b, scale, "alone"), scale)
            rows["A alone"] = _row("A alone", _run(a, None, scale, "alone"), scale)
            rows[fair_name] = _row(fair_name, _run(a, b, scale, "fair"), scale)
        print(fairness.table(rows, "Live, the fair boot"), flush=True)
        _restore("REDIS_URL", redis_url)
    if "fcfs" in boots:
        with live_stack(base | {"GENSERVER_FAIR_WINDOW": "0"}) as stack:
            a, b = as_user(stack, "bench-a"), as_user(stack, "bench-b")
            fcfs = _row(fcfs_name, _run(a, b, scale, "fcfs"), scale)
        _restore("REDIS_URL", redis_url)
        fair_row = rows.pop(fair_name, None)
        rows[fcfs_name] = fcfs
        if fair_row is not None:
            rows[fair_name] = fair_row
    return rows


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
