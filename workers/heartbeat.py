"""Worker liveness: each worker's main process writes a short-lived Redis key (genserver/liveness.py) that
admission, ETAs and GET /queues/ read.

The key and the payload's `name` are the worker's Celery hostname, `gpu0@NODE`
(GENSERVER_NODE qualifies it, workers/launcher.py), so two nodes' `gpu0` are two
workers. The payload says what capacity the worker is: its node, pool entry,
queues and cards (genserver/jobs/selectors/capacity.py: live_capacity counts them).
"""

from __future__ import annotations

import logging
import os
import threading

from celery.signals import worker_init, worker_ready, worker_shutdown

log = logging.getLogger(__name__)
INTERVAL_SECONDS = 5.0
_stop = threading.Event()
_beating: list[tuple[threading.Thread, str]] = []  # the heartbeat thread and the key it writes


def timing() -> tuple[float, float]:
    """(seconds between heartbeats, the key's time to live): three beats, and never longer than a job
    lease (GENSERVER_LEASE_SECONDS), so a dead node's cards stop counting within the lease."""
    from django.conf import settings

    lease = float(settings.LEASE_SECONDS)
    interval = min(INTERVAL_SECONDS, lease / 3)
    return interval, min(interval * 3, lease)


def _beat(name: str, queues: list[str], app=None) -> None:
    from genserver import liveness
    from workers import long_cap
    from workers.runtime.cache import loaded_models

    worker, _, node = name.partition("@")
    interval, ttl = timing()
    while not _stop.is_set():
        payload = {
            "name": name,
            "node": node,
            "worker": worker,
            "queues": queues,
            "pid": os.getpid(),
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "models": loaded_models(),
        }
        try:
            liveness.write(name, payload, ttl)
        except Exception:
            log.debug("worker heartbeat failed", exc_info=True)
        if app is not None:
            try:
                long_cap.resume_if_allowed(app, name, f"{name}:{os.getpid()}")  # the lease owner's name
            except Exception:
                log.warning("could not take long work up again after the overload cap", exc_info=True)
        _stop.wait(interval)


@worker_init.connect
def check_checkpoints(**kwargs) -> None:
    """Refuse to start when a registry model's weights are missing: say so now, not at its first job."""
    from django.conf import settings

    from genserver import deployment

    missing = deployment.registry().missing_checkpoints(settings.DATA_DIR)
    if missing:
        raise SystemExit("genserver worker cannot start:\n  " + "\n  ".join(missing))


@worker_ready.connect
def start_heartbeat(sender=None, **kwargs) -> None:
    from genserver import config

    hostname = getattr(sender, "hostname", None) or "worker"
    if "@" not in hostname:  # a worker started by hand without --hostname: qualify it with this node
        hostname = f"{hostname}@{config.node()}"
    queues = sorted(sender.app.amqp.queues.consume_from) if sender is not None else []
    app = sender.app if sender is not None else None
    thread = threading.Thread(target=_beat, args=(hostname, queues, app), daemon=True, name="genserver-heartbeat")
    thread.start()
    _beating.append((thread, hostname))


@worker_shutdown.connect
def stop_heartbeat(**kwargs) -> None:
    """Stop beating and take the liveness key away at once: a worker that shuts down cleanly stops counting
    now, not when its key expires (a restarted stack is not mistaken for live by its predecessor's keys)."""
    from genserver import liveness

    _stop.set()
    for thread, name in _beating:
        thread.join(timeout=2.0)  # a beat in flight would write the key again after the delete
        try:
            liveness.forget(name)
        except Exception:
            log.debug("could not delete the liveness key of %s", name, exc_info=True)
