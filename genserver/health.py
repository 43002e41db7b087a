"""Health probes, answered without a token (they reveal no job, user or secret).

    GET /healthz   200 while the process serves requests; touches neither the database nor Redis.
    GET /readyz    200 when the database and Redis answer and every queue of the pool layout
                   (and encode, decode, control) has a live worker consuming it; 503
                   otherwise, naming each problem. Per queue it reports the
                   live workers, the messages waiting in the broker, and the jobs waiting for
                   that queue with the age of the oldest one's message (from the database,
                   which knows when each job's next task was published).

Worker liveness is the heartbeat key each worker's main process renews every
5 s (workers/heartbeat.py); the launcher restarts a worker that exits. Under
`make up`, the supervisor (workers/supervise.py) writes its children's state to
<data dir>/run/supervisor.json: a process restarted again and again (a crash
loop: Redis that cannot bind, a worker that dies at import) makes /readyz 503.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Count, Min, Q
from django.http import HttpRequest, JsonResponse
from django.utils import timezone

from genserver import deployment
from genserver.scheduling.pools import ALL_QUEUES, CONTROL, DECODE, ENCODE, WEBHOOKS, class_of

log = logging.getLogger(__name__)


SUPERVISOR_STATE_STALE_SECONDS = 30.0  # the supervisor rewrites it every 5 s; an older file is a dead supervisor's


def supervisor_state_path() -> Path:
    return settings.DATA_DIR / "run" / "supervisor.json"


def supervised_processes() -> dict[str, Any] | None:
    """The supervisor's state file, or None when no live supervisor wrote one (tests, a stack not
    started by `make up`)."""
    try:
        state = json.loads(supervisor_state_path().read_text())
    except (OSError, ValueError):
        return None
    if time.time() - float(state.get("updated_at", 0)) > SUPERVISOR_STATE_STALE_SECONDS:
        return None
    return state


def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _brief(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}"


def _waiting_by_queue() -> dict[str, dict[str, Any]]:
    """Active jobs no worker holds, by the queue their next message went to, with the oldest publish time."""
    from genserver.jobs.models import Job, JobStatus

    now = timezone.now()
    unheld = Job.objects.filter(Q(lease_owner="") | Q(lease_expires_at__lt=now))
    waiting: dict[str, dict[str, Any]] = {}

    def put(queue: str, n: int, oldest) -> None:
        entry = waiting.setdefault(queue, {"waiting_jobs": 0, "oldest": None})
        entry["waiting_jobs"] += n
        if oldest is not None and (entry["oldest"] is None or oldest < entry["oldest"]):
            entry["oldest"] = oldest

    agg = unheld.filter(status__in=(JobStatus.QUEUED, JobStatus.ENCODING)).aggregate(
        n=Count("pk"), oldest=Min("published_at")
    )
    put(ENCODE, agg["n"], agg["oldest"])
    agg = unheld.filter(status=JobStatus.DECODING).aggregate(n=Count("pk"), oldest=Min("published_at"))
    put(DECODE, agg["n"], agg["oldest"])
    for row in (
        unheld.filter(status=JobStatus.DENOISING)
        .values("queue", "duration_class")
        .annotate(n=Count("pk"), oldest=Min("published_at"))
    ):
        put(row["queue"] or row["duration_class"], row["n"], row["oldest"])
    for entry in waiting.values():
        oldest = entry.pop("oldest")
        entry["oldest_message_age_seconds"] = (
            round(max(0.0, (now - oldest).total_seconds()), 3) if oldest is not None else None
        )
    return waiting


def _queue_order(queue: str) -> tuple[int, str]:
    stage = class_of(queue)
    return (ALL_QUEUES.index(stage) if stage in ALL_QUEUES else len(ALL_QUEUES), queue)


def readyz(request: HttpRequest) -> JsonResponse:
    from genserver.jobs.broker import broker_depth
    from genserver.jobs.selectors import live_workers
    from genserver.redis_client import client as redis_client

    problems: list[str] = []
    checks: dict[str, Any] = {}
    waiting: dict[str, dict[str, Any]] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
        waiting = _waiting_by_queue()
        checks["database"] = {"ok": True}
    except Exception as exc:  # noqa: BLE001 - a probe reports, it never raises
        checks["database"] = {"ok": False, "error": _brief(exc)}
        problems.append("the database is unreachable")
    live: list[dict[str, Any]] = []
    redis_ok = False
    try:
        redis_client().ping()
        live = live_workers()
        redis_ok = True
        checks["redis"] = {"ok": True}
    except Exception as exc:  # noqa: BLE001 - a probe reports the failure, it never raises
        checks["redis"] = {"ok": False, "error": _brief(exc)}
        problems.append("Redis (the broker) is unreachable")
    # The queues some worker of the layout reads (a worker dedicated to a model reads its own class
    # queues, "short.sdxl"), plus encode, decode and control (the reaper runs there).
    expected = set(deployment.layout().all_queues()) | {ENCODE, DECODE, CONTROL}
    queues: dict[str, dict[str, Any]] = {}
    for queue in sorted(expected | set(waiting), key=_queue_order):
        names = sorted(w.get("name", "?") for w in live if queue in w.get("queues", []))
        depth = None
        if redis_ok:
            try:
                depth = broker_depth(queue)
            except Exception:  # noqa: BLE001 - a probe reports an unknown depth, it never raises
                depth = None
        entry = {
            "live_workers": names,
            "broker_messages": depth,
            "waiting_jobs": 0,
            "oldest_message_age_seconds": None,
        } | waiting.get(queue, {})
        if queue in (CONTROL, WEBHOOKS):  # no job waits there
            entry.pop("waiting_jobs")
            entry.pop("oldest_message_age_seconds")
        queues[queue] = entry
        if redis_ok and not names and queue in expected:
            problems.append(f"no live worker consumes queue {queue!r}")
    processes = supervised_processes()
    if processes is not None:
        looping = sorted(name for name, child in processes.get("children", {}).items() if child.get("crash_looping"))
        for name in looping:
            child = processes["children"][name]
            problems.append(
                f"process {name!r} is crash-looping: restarted {child['restarts']} times in a row "
                f"(last exit status {child['last_exit']}); see the `make up` log"
            )
        checks["processes"] = {"ok": not looping, "children": processes.get("children", {})}
    checks["workers"] = {
        "ok": redis_ok and all(q["live_workers"] for q in queues.values()),
        "live": sorted(w.get("name", "?") for w in live),
    }
    body = {"status": "unavailable" if problems else "ready", "problems": problems, "checks": checks, "queues": queues}
    if problems:
        log.warning("not ready: %s", "; ".join(problems))
    return JsonResponse(body, status=503 if problems else 200, headers={"Cache-Control": "no-store"})
