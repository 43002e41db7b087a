"""Submit latency with and without open event streams, on the real stack (`make up`'s ASGI API).

    python -m bench.streams [--streams 200] [--submits 150] [--clients 4]

Starts the stack as `make up` does (gunicorn with uvicorn workers, GENSERVER_API_WORKERS
processes), then:
1. starts the jobs the streams will watch (long simulated videos: progress events all along);
2. measures submit latency with no stream open (`--submits` POSTs of a 4-step 512² image from
   `--clients` threads);
3. opens `--streams` event streams on those jobs (each in its own thread, read as a client does)
   and waits until every one got its first event;
4. measures the same submits again while the streams stay open and receive events;
5. prints both as a table (P50, P99, throughput, the codes answered) and the ratio, which the
   target holds within 1.5×.
"""

from __future__ import annotations

import argparse
import http.client
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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
SUBMIT = {"model": "sdxl-turbo-sim", "prompt": "a lighthouse at dusk", "width": 512, "height": 512, "steps": 4}


class Streams:
    """`count` SSE readers over `job_ids`, each a thread holding one HTTP connection open."""

    def __init__(self, stack: LiveStack, job_ids: list[str], count: int) -> None:
        self.stack, self.stop = stack, threading.Event()
        self.opened, self.events, self.ended, self.errors = 0, 0, 0, []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._read, args=(job_ids[i % len(job_ids)],), daemon=True) for i in range(count)
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, job_id: str) -> None:
        parts = urlsplit(self.stack.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        try:
            conn.request(
                "GET",
                f"/api/v1/jobs/{job_id}/events/",
                headers={"Authorization": f"Token {self.stack.token}", "Accept": "text/event-stream"},
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


def submit_load(stack: LiveStack, clients: int, count: int) -> tuple[list[float], dict[int, int], float]:
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
    return [r[0] for r in results], codes, count / elapsed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--submits", type=int, default=150)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--watched-jobs", type=int, default=2, help="long jobs the streams follow")
    args = parser.parse_args(argv)
    env = {"GENSERVER_TIME_SCALE": str(SCALE)}
    rows = []
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
        # 2. no streams
        rows.append(("no streams", *submit_load(stack, args.clients, args.submits)))
        # 3. the streams
        streams = Streams(stack, watched, args.streams)
        streams.wait_open()
        events_before = streams.events
        # 4. the same submits with the streams open
        rows.append((f"{args.streams} open streams", *submit_load(stack, args.clients, args.submits)))
        events_during = streams.events - events_before
        still_open = args.streams - streams.ended - len(streams.errors)
        streams.close()
        for job_id in watched:
            stack.request("POST", f"/api/v1/jobs/{job_id}/cancel/")
    print(
        f"\n{args.submits} submits from {args.clients} clients; {len(watched)} watched job(s); "
        f"{events_during} events delivered to the streams during the second run; "
        f"{still_open}/{args.streams} streams still open at its end\n"
    )
    print("| run | submit P50 | submit P99 | submits/s | answers |")
    print("| --- | --- | --- | --- | --- |")
    for name, latencies, codes, throughput in rows:
        print(
            f"| {name} | {pct(latencies, 0.5) * 1000:.1f} ms | {pct(latencies, 0.99) * 1000:.1f} ms | "
            f"{throughput:.1f} | {', '.join(f'{c}×{n}' for c, n in sorted(codes.items()))} |"
        )
    base, loaded = rows[0][1], rows[1][1]
    p50, p99 = pct(loaded, 0.5) / pct(base, 0.5), pct(loaded, 0.99) / pct(base, 0.99)
    print(f"\nratio with streams: P50 {p50:.2f}×, P99 {p99:.2f}× (target: both ≤ 1.5×)")
    return 0 if p50 <= 1.5 and p99 <= 1.5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
