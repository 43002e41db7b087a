"""Django's SQLite backend, with each process's write transactions queued in Python, one at a time.

SQLite has one writer. Every transaction here begins IMMEDIATE (genserver/settings.py), and a connection that
finds the write lock taken waits in SQLite's busy handler, which sleeps 1, 2, 5, ... up to 100 ms between
tries and serves nobody in order: under 8 concurrent submits on the API's kept threads an unlucky one lost
the race for up to 2 s while the median took 40 ms (docs/BENCHMARKS.md, "Submit throughput, stop 39"). Here
the threads of one process queue on a lock before they ask SQLite, so a process sends one writer at a time
and the next one starts as soon as the last commits; only the processes (two API processes, the workers)
still meet in the busy handler.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.db import OperationalError
from django.db.backends.sqlite3 import base

_WRITER = threading.Lock()  # the process's turn at SQLite's write lock


class DatabaseWrapper(base.DatabaseWrapper):
    """Takes the process's turn before BEGIN and gives it back at the commit, the rollback or the close."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._has_turn = False
        # As long as SQLite's own busy timeout would wait (Django's default for it is 5 s).
        self._turn_timeout = float(self.settings_dict.get("OPTIONS", {}).get("timeout", 5))

    def _start_transaction_under_autocommit(self) -> None:
        if not _WRITER.acquire(timeout=self._turn_timeout):
            raise OperationalError(f"database is locked: no turn to write within {self._turn_timeout:g} s")
        self._has_turn = True
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            self._give_turn_back()
            raise

    def _commit(self) -> None:
        self._then_give_turn_back(super()._commit)

    def _rollback(self) -> None:
        self._then_give_turn_back(super()._rollback)

    def _close(self) -> None:
        self._then_give_turn_back(super()._close)

    def _then_give_turn_back(self, end: Callable[[], Any]) -> None:
        """Commit, roll back or close, and give the turn back (if this connection holds it) whatever happens."""
        try:
            end()
        finally:
            self._give_turn_back()

    def _give_turn_back(self) -> None:
        if self._has_turn:
            self._has_turn = False
            _WRITER.release()
