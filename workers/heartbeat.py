"""Worker liveness: each worker's main process writes a short-lived Redis key that GET /queues/ reads."""
from __future__ import annotations

import json
import logging
import os
import threading

from celery.signals import worker_init, worker_ready, worker_shutdown

log = logging.getLogger(__name__)
INTERVAL_SECONDS = 5.0
_stop = threading.Event()


def _beat(name: str, queues: list[str]) -> None:
    from genserver.redis_client import WORKER_KEY, client

    from workers.runtime.cache import loaded_models

    while not _stop.is_set():
        payload = json.dumps({"name": name, "queues": queues, "pid": os.getpid(),
                              "devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "models": loaded_models()})
        try:
            client().set(WORKER_KEY.format(name=name), payload, ex=int(INTERVAL_SECONDS * 3))
        except Exception:  # noqa: BLE001 - liveness is best effort; the broker connection has its own retries
            log.debug("worker heartbeat failed", exc_info=True)
        _stop.wait(INTERVAL_SECONDS)


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
    hostname = getattr(sender, "hostname", None) or "worker"
    queues = sorted(sender.app.amqp.queues.consume_from) if sender is not None else []
    threading.Thread(target=_beat, args=(hostname.split("@")[0], queues), daemon=True,
                     name="genserver-heartbeat").start()


@worker_shutdown.connect
def stop_heartbeat(**kwargs) -> None:
    _stop.set()
