"""A process's last read of what every request needs, reused by its requests for `config.cluster_read_seconds()`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from genserver import config

Read = TypeVar("Read")


class KeptRead(Generic[Read]):
    """The last read kept with the moment it was made (a monotonic clock's) and what it was read for (`key`).

    A read is reused while it is younger than the window and `covers(key)` says its key serves the caller's
    (a read for an earlier cutoff covers a later one); the window is read at each call, so 0 reads every time."""

    def __init__(self) -> None:
        self._kept: tuple[float, Any, Read] | None = None

    def get(self, now: float, covers: Callable[[Any], bool] = lambda key: True) -> Read | None:
        kept = self._kept  # one read of the attribute: another thread may replace it meanwhile
        if kept is not None and 0 <= now - kept[0] < config.cluster_read_seconds() and covers(kept[1]):
            return kept[2]
        return None

    def keep(self, now: float, read: Read, key: Any = None) -> None:
        self._kept = (now, key, read)

    def forget(self) -> None:
        self._kept = None
