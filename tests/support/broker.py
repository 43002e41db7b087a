"""What the job service publishes, seen from the tests: one module to patch, named once.

Publishing lives in BROKER_MODULE (the `send_*` functions of `genserver/jobs/broker.py`);
patching it there is what every caller sees, since callers look the functions up on the module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

BROKER_MODULE = "genserver.jobs.broker"


def broker() -> ModuleType:
    """The publishing module itself (for a test that sends real messages, e.g. a duplicate)."""
    return importlib.import_module(BROKER_MODULE)


def capture_sends(
    monkeypatch, *names: str, into: list | None = None, **recorded_as: Callable[..., tuple]
) -> list[tuple]:
    """Replace the broker's `send_*` functions with recorders; the list of calls is returned.

    A name in `names` records `(name without "send_", *args)`; a keyword gives
    the tuple to record instead, e.g. `send_decode=lambda job_id, priority, model="": ("decode",)`.
    Nothing reaches Redis.
    """
    calls: list[tuple] = [] if into is None else into
    module = broker()

    def recorder(name: str, shape: Callable[..., tuple] | None) -> Callable[..., None]:
        short = name.removeprefix("send_")
        return lambda *args, **kwargs: calls.append(shape(*args, **kwargs) if shape else (short, *args))

    for name in names:
        monkeypatch.setattr(module, name, recorder(name, None))
    for name, shape in recorded_as.items():
        monkeypatch.setattr(module, name, recorder(name, shape))
    return calls


BROKER_QUEUES = ("encode", "short", "medium", "long", "decode", "webhooks")


def clear_broker() -> None:
    """Empty the job queues' Redis lists (every priority) and the first chunks announced on them: a test that
    reads what was published starts from nothing another test left there."""
    from genserver.redis_client import ARRIVING_KEY, client

    for queue in BROKER_QUEUES:
        client().delete(*broker().queue_keys(queue), ARRIVING_KEY.format(queue=queue))
