"""Per-process copies of what every request reads about its caller (the token's row and its user, the quota
rows), each used only while Redis's access generation is the one it was read under.

Every API request looked its token up (0.4 ms of ORM on SQLite, 1 ms on PostgreSQL) and every submit read the
caller's quota rows (0.5 / 1.5 ms), rows that change a few times a day. A copy is checked with one GET of
ACCESS_GENERATION_KEY (0.03-0.2 ms). Whatever changes those rows moves the generation at once and again when
its transaction commits (`forget`: the token service's revokes, and, for the admin's edits, the signals
wired in apps.py), so a revoked token, a deactivated user or a changed quota is refused or applied by every
process from the commit on, as without copies:

* the generation is read before the rows, so a copy made from rows read before a commit carries a generation
  the commit's move has replaced;
* a generation that cannot be read (Redis down) means no copies: the rows are read every time;
* a missing key (a new or flushed Redis) is set to a fresh random value, never to one used before;
* a move that fails (Redis down at that moment) is the one case the generation cannot cover: a copy is then
  used at most GENSERVER_ACCESS_CACHE_SECONDS after it was read, and not at all with 0.

Copies hold row values, never model instances: each request gets instances of its own to change. Within one
request (`per_request`, the API's middleware) the generation is read once, at its first copy: a submit used
one GET for its token and another for its quota rows, 6 % of the API's time under load. That keeps the first
point (the generation is read before any row the request copies), and `forget` reads it again.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

from django.conf import settings
from django.db import transaction

from genserver.redis_client import ACCESS_GENERATION_KEY, client as redis_client

MAX_COPIES = 20_000  # in all kinds; the least recently used copy goes first (a copy is a few hundred bytes)

Value = TypeVar("Value")


class _Copies:
    """A bounded map of (kind, key) → (generation, read at, value), shared by a process's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, Hashable], tuple[bytes, float, Any]] = OrderedDict()

    def get(self, name: tuple[str, Hashable], generation: bytes, oldest: float) -> tuple[bool, Any]:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry[0] != generation or entry[1] < oldest:
                return False, None
            self._entries.move_to_end(name)
            return True, entry[2]

    def put(self, name: tuple[str, Hashable], generation: bytes, read_at: float, value: Any) -> None:
        with self._lock:
            self._entries[name] = (generation, read_at, value)
            self._entries.move_to_end(name)
            while len(self._entries) > MAX_COPIES:
                self._entries.popitem(last=False)

    def update(self, name: tuple[str, Hashable], change: Callable[[Any], Any]) -> None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                self._entries[name] = (entry[0], entry[1], change(entry[2]))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_copies = _Copies()

_UNREAD = object()  # in a request's scope, before its first copy read the generation
# The generation as this request read it: _UNREAD at the start of a request's scope, None outside any.
_request_generation: ContextVar[Any] = ContextVar("access_generation", default=None)


@contextlib.contextmanager
def per_request() -> Iterator[None]:
    """A request's scope: its copies check the generation once (at the first), not once each."""
    scope = _request_generation.set(_UNREAD)
    try:
        yield
    finally:
        _request_generation.reset(scope)


def _generation() -> bytes | None:
    """The access generation now (in a request's scope, as its first copy read it); None when Redis cannot
    say (then nothing is copied or used)."""
    found = _request_generation.get()
    if found is None:
        return _read_generation()
    if found is _UNREAD:
        found = _read_generation()
        _request_generation.set(found if found is not None else _UNREAD)
    return found


def _read_generation() -> bytes | None:
    try:
        found = redis_client().get(ACCESS_GENERATION_KEY)
        if found is None:  # a new or flushed Redis: a value never used before, whoever sets it first
            redis_client().set(ACCESS_GENERATION_KEY, secrets.token_hex(8), nx=True)
            found = redis_client().get(ACCESS_GENERATION_KEY)
        return found
    except Exception:  # noqa: BLE001 - Redis down: read the rows every time, as without copies
        return None


def read_through(kind: str, key: Hashable, load: Callable[[], Value]) -> Value:
    """`load()`'s result for (kind, key): a copy made under the current generation within
    GENSERVER_ACCESS_CACHE_SECONDS, else a fresh `load()` kept for the next caller. `load` returns plain
    values (tuples, frozen dataclasses), which every caller shares; an exception it raises keeps nothing."""
    max_age = settings.ACCESS_CACHE_SECONDS
    if max_age <= 0:
        return load()
    generation = _generation()  # before the rows: see the module's first point
    if generation is None:
        return load()
    now = time.monotonic()
    found, value = _copies.get((kind, key), generation, now - max_age)
    if found:
        return value
    value = load()
    _copies.put((kind, key), generation, now, value)
    return value


def update_copy(kind: str, key: Hashable, change: Callable[[Value], Value]) -> None:
    """Apply `change` to this process's copy of (kind, key), if any, keeping its generation and age (a field
    the generation does not guard, such as a token's last use)."""
    _copies.update((kind, key), change)


def _move() -> None:
    try:
        redis_client().set(ACCESS_GENERATION_KEY, secrets.token_hex(8))
    except Exception:  # noqa: BLE001 - Redis down: copies elsewhere age out (GENSERVER_ACCESS_CACHE_SECONDS)
        pass


def forget(**_signal_arguments: Any) -> None:
    """Invalidate every process's copies: now (this process's, and the generation) and again when the current
    transaction commits (a copy made between the two read the rows before the commit). Also a signal receiver."""
    _copies.clear()
    _move()
    transaction.on_commit(_move)
    if _request_generation.get() is not None:
        _request_generation.set(_UNREAD)  # the rest of the request reads the moved one


def forget_this_process() -> None:
    """Drop this process's copies without moving the generation (tests: a rolled-back row leaves no signal)."""
    _copies.clear()
