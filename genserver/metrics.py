"""Prometheus metrics: what the API and the workers count, what is read at scrape time, and the /metrics body.

Two kinds of metric (docs/METRICS.md lists every name):

* Counted where it happens (submits, the wait/delay/step/decode/checkpoint
  histograms, reaper actions, HTTP requests), in prometheus-client's
  multiprocess mode: every process (each gunicorn worker, each Celery pool
  process) writes its values to a file in PROMETHEUS_MULTIPROC_DIR (default
  GENSERVER_DATA_DIR/prometheus, set before prometheus-client is imported),
  and /metrics sums the files. `make up` (workers/stack.py) empties the
  directory before anything starts. One directory per host: on a node that
  runs only workers, `python -m genserver.metrics serve --port 9464` is that
  node's scrape target (its files, summed the same way).
* Read at scrape time (jobs by status, queue depth, backlog and admission's
  expected wait per class, live workers and cards per node, the embedding
  cache and merge counters kept in Redis): they describe the whole cluster,
  so only the API's /metrics exports them, and every node's scrape agrees.

The Redis counters below predate /metrics and stay: GET /api/v1/workers/
reads them too, and they are shared by every node without a scrape.

Over 400 lines because every metric is declared here once (docs/METRICS.md mirrors this module), with the
scrape-time collector and the node exporter that read them.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from genserver import config
from genserver.redis_client import client

log = logging.getLogger(__name__)


def _multiprocess_dir() -> Path:
    """PROMETHEUS_MULTIPROC_DIR (created), defaulting to GENSERVER_DATA_DIR/prometheus.

    Set in this process's environment before prometheus-client is imported:
    the library chooses file-backed values at import time.
    """
    path = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or config.data_dir() / "prometheus")
    path.mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    return path


MULTIPROCESS_DIR = _multiprocess_dir()

from prometheus_client import (  # noqa: E402
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    values as _values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from prometheus_client.registry import Collector  # noqa: E402

from genserver.scheduling.classes import CLASSES  # noqa: E402
from genserver.scheduling.pools import class_of  # noqa: E402

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Something imported prometheus-client before this module set the directory: the values live in this
# process's memory, and /metrics shows this process's counts only.
IN_MEMORY = _values.ValueClass.__name__ != "MmapedValue"
if IN_MEMORY:
    log.warning(
        "prometheus-client was imported before genserver.metrics set PROMETHEUS_MULTIPROC_DIR: "
        "/metrics shows this process's counts only; import genserver.metrics first"
    )

# --- Counted where it happens (one file per process) --------------------------------------------------------
_PROCESS = CollectorRegistry()  # only read when IN_MEMORY; the files are the truth otherwise
SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, math.inf)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, math.inf)
# 3 ms: the in-process boundary's target (issue 16, item 2), so a scrape tells whether its P50 is under it.
BOUNDARY_BUCKETS = (0.001, 0.0025, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, math.inf)
BYTES_BUCKETS = (1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, math.inf)

SUBMITS = Counter(
    "genserver_submits",
    "Submits by duration class and outcome (accepted, or refused and why)",
    ["class", "outcome", "reason"],
    registry=_PROCESS,
)
JOB_WAIT = Histogram(
    "genserver_job_wait_seconds",
    "Arrival to the job's first denoising step, per class",
    ["class"],
    buckets=SECONDS_BUCKETS,
    registry=_PROCESS,
)
JOB_DELAY = Histogram(
    "genserver_job_delay_seconds",
    "Completion − arrival − expected service seconds of each succeeded job, per class",
    ["class"],
    buckets=SECONDS_BUCKETS,
    registry=_PROCESS,
)
STEP_SECONDS = Histogram(
    "genserver_step_seconds",
    "Mean seconds per denoising step of each chunk run alone, per model",
    ["model"],
    buckets=STEP_BUCKETS,
    registry=_PROCESS,
)
CHUNK_BOUNDARY = Histogram(
    "genserver_chunk_boundary_seconds",
    "Seconds at a chunk's end: checkpoint writes, recording, the yield test, per model",
    ["model"],
    buckets=BOUNDARY_BUCKETS,
    registry=_PROCESS,
)
DECODE_SECONDS = Histogram(
    "genserver_decode_seconds",
    "Seconds of each VAE decode (a job's, or one segment's of a long video), per model",
    ["model"],
    buckets=SECONDS_BUCKETS,
    registry=_PROCESS,
)
CHECKPOINT_BYTES = Histogram(
    "genserver_checkpoint_bytes",
    "Size of each chunk checkpoint written, per model",
    ["model"],
    buckets=BYTES_BUCKETS,
    registry=_PROCESS,
)
REAPER_ACTIONS = Counter(
    "genserver_reaper_actions",
    "What the reaper did: republished a lost message, or failed an attempt whose lease expired",
    ["action"],
    registry=_PROCESS,
)
HTTP_REQUESTS = Counter(
    "genserver_http_requests",
    "Django requests by method, URL name and status code",
    ["method", "view", "status"],
    registry=_PROCESS,
)
HTTP_SECONDS = Histogram(
    "genserver_http_request_seconds",
    "Django request latency by method and URL name",
    ["method", "view"],
    registry=_PROCESS,
)


def count_submit(duration_class: str, refused_reason: str = "") -> None:
    """One submit that reached admission: accepted (no reason) or refused ("wait_limit", "in_flight", ...)."""
    SUBMITS.labels(duration_class, "refused" if refused_reason else "accepted", refused_reason).inc()


def observe(histogram: Histogram, label: str, value: float | None) -> None:
    """Observe `value` (skipped when None) without ever failing the caller: metrics never stop a job."""
    if value is None:
        return
    try:
        histogram.labels(label).observe(value)
    except Exception:
        log.debug("could not observe %s", histogram, exc_info=True)


# --- Counters kept in Redis (shared by every process and node) ----------------------------------------------
EMBEDDING_CACHE_KEY = "genserver:embedding-cache"
MERGE_KEY = "genserver:merged-denoise"


def _count(key: str, **increments: int) -> None:
    try:
        with client().pipeline() as pipe:
            for field, amount in increments.items():
                pipe.hincrby(key, field, amount)
            pipe.execute()
    except Exception:
        log.debug("could not count %s", key, exc_info=True)


def count_embedding_cache(hits: int, misses: int) -> None:
    _count(EMBEDDING_CACHE_KEY, hits=hits, misses=misses)


def embedding_cache_counts() -> dict[str, int]:
    raw = client().hgetall(EMBEDDING_CACHE_KEY)
    return {"hits": int(raw.get(b"hits", 0)), "misses": int(raw.get(b"misses", 0))}


def count_merged_batch(jobs: int) -> None:
    """A denoise task took `jobs` (≥ 2) same-shape jobs as one batch."""
    _count(MERGE_KEY, batches=1, jobs=jobs)


def merged_counts() -> dict[str, int]:
    """Merged denoise batches started so far, and the jobs they held."""
    raw = client().hgetall(MERGE_KEY)
    return {"batches": int(raw.get(b"batches", 0)), "jobs": int(raw.get(b"jobs", 0))}


# --- Read at scrape time --------------------------------------------------------------------------------------
def _jobs_by_status() -> Iterator[Metric]:
    from django.db.models import Count

    from genserver.jobs.models import Job, JobStatus

    counts = dict(Job.objects.values_list("status").annotate(n=Count("pk")).values_list("status", "n"))
    family = GaugeMetricFamily("genserver_jobs", "Jobs by status (every row in the database)", labels=["status"])
    for status in JobStatus.values:
        family.add_metric([status], counts.get(status, 0))
    yield family


def _queues() -> Iterator[Metric]:
    from genserver.jobs.selectors import queue_overview

    depth = GaugeMetricFamily(
        "genserver_queue_depth", "Active jobs of the class not running on a card", labels=["class"]
    )
    running = GaugeMetricFamily(
        "genserver_queue_running", "Jobs of the class denoising on a card now", labels=["class"]
    )
    backlog = GaugeMetricFamily(
        "genserver_queue_backlog_seconds", "Seconds of work left in the class's active jobs", labels=["class"]
    )
    wait = GaugeMetricFamily(
        "genserver_admission_expected_wait_seconds",
        "Admission's expected wait for a typical new job of the class (+Inf: no worker serves it)",
        labels=["class"],
    )
    accepting = GaugeMetricFamily(
        "genserver_admission_accepting", "1 when a typical new job of the class would be accepted now", labels=["class"]
    )
    for entry in queue_overview():
        name = entry["name"]
        depth.add_metric([name], entry["depth"])
        running.add_metric([name], entry["running"])
        backlog.add_metric([name], entry["backlog_seconds"])
        expected = entry["expected_wait_seconds"]
        wait.add_metric([name], math.inf if expected is None else expected)
        accepting.add_metric([name], 1 if entry["accepting"] else 0)
    yield from (depth, running, backlog, wait, accepting)


def _cards(worker: dict[str, Any]) -> int:
    """A live worker's cards: its CUDA devices; a CPU worker that denoises counts as one card."""
    devices = [d for d in str(worker.get("devices", "")).split(",") if d.strip()]
    if devices:
        return len(devices)
    return 1 if any(class_of(q) in CLASSES for q in worker.get("queues", [])) else 0


def _workers() -> Iterator[Metric]:
    from genserver.jobs.selectors import live_workers

    live: dict[str, list[int]] = {}
    for worker in live_workers():
        node = worker.get("node") or "local"
        live.setdefault(node, []).append(_cards(worker))
    workers = GaugeMetricFamily("genserver_live_workers", "Workers with a recent heartbeat, per node", labels=["node"])
    cards = GaugeMetricFamily("genserver_live_cards", "Cards of the live denoising workers, per node", labels=["node"])
    for node, worker_cards in sorted(live.items()):
        workers.add_metric([node], len(worker_cards))
        cards.add_metric([node], sum(worker_cards))
    yield from (workers, cards)


def _redis_counters() -> Iterator[Metric]:
    cache = embedding_cache_counts()
    lookups = CounterMetricFamily(
        "genserver_embedding_cache", "Prompt-embedding cache lookups by result", labels=["result"]
    )
    lookups.add_metric(["hit"], cache["hits"])
    lookups.add_metric(["miss"], cache["misses"])
    merged = merged_counts()
    batches = CounterMetricFamily("genserver_merged_batches", "Denoise batches that ran several same-shape jobs")
    batches.add_metric([], merged["batches"])
    jobs = CounterMetricFamily("genserver_merged_jobs", "Jobs that ran in a merged denoise batch")
    jobs.add_metric([], merged["jobs"])
    yield from (lookups, batches, jobs)


class ClusterCollector(Collector):
    """The cluster-wide picture, read from the database and Redis when Prometheus scrapes.

    A part that cannot be read (Redis down) is left out of that scrape; the rest still answers.
    """

    parts: tuple[Callable[[], Iterable[Metric]], ...] = (_jobs_by_status, _queues, _workers, _redis_counters)

    def collect(self) -> Iterator[Metric]:
        for part in self.parts:
            try:
                yield from list(part())
            except Exception:
                log.warning("metrics: %s could not be read", part.__name__, exc_info=True)


def scrape(cluster: bool = True) -> bytes:
    """The Prometheus text body: every process's counts on this host, and (`cluster`) the scrape-time picture."""
    registry = CollectorRegistry()
    if IN_MEMORY:
        registry.register(_ProcessCollector())
    else:
        MultiProcessCollector(registry, path=str(MULTIPROCESS_DIR))
    if cluster:
        registry.register(ClusterCollector())
    return generate_latest(registry)


class _ProcessCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        return iter(_PROCESS.collect())


# --- GET /metrics -----------------------------------------------------------------------------------------------
def _may_scrape(request: Any) -> bool:
    """`Authorization: Bearer <GENSERVER_METRICS_TOKEN>` when the token is set, a staff user's API token
    (`Token` or `Bearer`), or a staff session."""
    from django.conf import settings

    from genserver.jobs.services import tokens

    header = request.headers.get("Authorization", "")
    if _bearer_matches(header, settings.METRICS_TOKEN):
        return True
    key = tokens.key_in_header(header)
    user = getattr(request, "user", None)
    if key is not None:
        try:
            user = tokens.authenticate(key).user
        except tokens.TokenRefused:
            return False  # an unknown, expired or revoked API token
    return bool(user is not None and user.is_authenticated and user.is_active and user.is_staff)


def _bearer_matches(header: str, token: str) -> bool:
    """`header` is `Bearer <token>` (compared in constant time); never when `token` is empty."""
    import hmac

    scheme, _, given = header.partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def metrics_view(request: Any) -> Any:
    """The Prometheus text format: this host's processes (API and workers) and the cluster picture."""
    from django.http import HttpResponse

    if request.method != "GET":
        return HttpResponse("GET /metrics only.\n", status=405, content_type="text/plain", headers={"Allow": "GET"})
    if not _may_scrape(request):
        return HttpResponse(
            "GET /metrics needs a staff session, a staff user's API token (`Authorization: Token <key>`), "
            "or `Authorization: Bearer <token>` with the token set in GENSERVER_METRICS_TOKEN.\n",
            status=403,
            content_type="text/plain",
        )
    return HttpResponse(scrape(), content_type=CONTENT_TYPE)


# --- Django request metrics -----------------------------------------------------------------------------------
class RequestMetricsMiddleware:
    """Counts every request by method, URL name and status, and times it (the django-prometheus equivalent,
    in multiprocess mode). The URL name, not the path, keeps the label set small."""

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        started = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        view = (match.view_name or "unnamed") if match is not None else "unresolved"
        try:
            HTTP_REQUESTS.labels(request.method, view, str(response.status_code)).inc()
            HTTP_SECONDS.labels(request.method, view).observe(time.perf_counter() - started)
        except Exception:
            log.debug("could not count the request", exc_info=True)
        return response


# --- A worker node's scrape target ----------------------------------------------------------------------------
def clean_multiprocess_dir(path: Path = MULTIPROCESS_DIR) -> int:
    """Delete the value files a previous run left (before any process of this run writes one)."""
    removed = 0
    for stale in path.glob("*.db"):
        stale.unlink(missing_ok=True)
        removed += 1
    return removed


def serve(port: int, address: str = "127.0.0.1", token: str | None = None) -> None:
    """Serve this host's process files (no cluster picture: the API exports that) until interrupted.

    With a token (default GENSERVER_METRICS_TOKEN) every scrape must send `Authorization: Bearer <token>`;
    without one it serves only a loopback address (ValueError otherwise: anyone could read it).
    """
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    token = config.metrics_token() if token is None else token
    if not token and not config.is_loopback(address):
        raise ValueError(
            f"refusing to serve /metrics on {address} without GENSERVER_METRICS_TOKEN: set it (Prometheus then "
            "sends `Authorization: Bearer <token>`), or serve on --address 127.0.0.1"
        )

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if token and not _bearer_matches(self.headers.get("Authorization", ""), token):
                self.send_response(401)
                self.send_header("WWW-Authenticate", "Bearer")
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"Send Authorization: Bearer <GENSERVER_METRICS_TOKEN>.\n")
                return
            # A node whose workers have written nothing yet has an empty scrape: still a 200 (Prometheus reads it
            # as up, with no series), only another path is a 404.
            found = self.path.split("?")[0] == "/metrics"
            body = scrape(cluster=False) if found else b""
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    log.info("serving %s on http://%s:%d/metrics", MULTIPROCESS_DIR, address, port)
    ThreadingHTTPServer((address, port), Handler).serve_forever()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="A worker node's Prometheus scrape target, or clean its files.")
    parser.add_argument("command", choices=("serve", "clean"))
    parser.add_argument("--port", type=int, default=9464)
    parser.add_argument(
        "--address", default="0.0.0.0", help="where to listen; beyond loopback it needs GENSERVER_METRICS_TOKEN"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if args.command == "clean":
        print(f"removed {clean_multiprocess_dir()} files from {MULTIPROCESS_DIR}")
    else:
        try:
            serve(args.port, args.address)
        except ValueError as refused:
            raise SystemExit(f"genserver.metrics: {refused}") from None
