"""A worker's side of the overload cap: stop consuming long queues at the cap, take them up again after.

A worker that meets the cap (selectors.must_leave_long: the cap holds and
enough other cards run long work) hands the long chunk back to the broker and
asks its own consumer to stop reading its long queues; its heartbeat thread
takes them up again once the cap lets it (released, or a long card freed).
The requests go through Celery's remote control addressed to this worker
only, so its main loop applies them between tasks. State is per process:
the launcher runs each worker with the solo pool (tasks in the worker process).
"""

from __future__ import annotations

import logging
import threading

from genserver.scheduling.classes import LONG
from genserver.scheduling.pools import class_of

log = logging.getLogger(__name__)
_lock = threading.Lock()
_paused: set[str] = set()  # the long queues this worker stopped consuming


def long_queues(queues: list[str]) -> list[str]:
    return [q for q in queues if class_of(q) == LONG]


def pause(app, hostname: str, queues: list[str]) -> None:
    """Stop consuming this worker's long queues (applied by its main loop once the task returns)."""
    wanted = [q for q in long_queues(queues) if q not in _paused]
    if not wanted:
        return
    with _lock:
        _paused.update(wanted)
    for queue in wanted:
        app.control.cancel_consumer(queue, destination=[hostname])
    log.info("overload cap: %s stops taking long work (%s)", hostname, ", ".join(wanted))


def resume_if_allowed(app, hostname: str, worker: str) -> None:
    """Take the paused long queues up again when the cap no longer holds this worker back (heartbeat)."""
    if not _paused:
        return
    from django.db import close_old_connections

    from genserver.jobs import selectors

    close_old_connections()  # a thread of its own: its connection may have gone stale between beats
    if selectors.must_leave_long(worker):
        return
    with _lock:
        queues = sorted(_paused)
        _paused.clear()
    for queue in queues:
        app.control.add_consumer(queue, destination=[hostname])
    log.info("overload cap: %s takes long work again (%s)", hostname, ", ".join(queues))


def paused() -> set[str]:
    return set(_paused)
