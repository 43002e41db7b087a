"""Django's SQLite backend, with write transactions queued in Python and in the kernel, one writer at a time.

SQLite has one writer. Every transaction here begins IMMEDIATE (genserver/settings.py), and a connection that
finds the write lock taken waits in SQLite's busy handler, which sleeps 1, 2, 5, ... up to 100 ms between
tries and serves nobody in order: under 8 concurrent submits on the API's kept threads an unlucky one lost
the race for up to 2 s while the median took 40 ms (docs/BENCHMARKS.md, "Submit throughput, stop 39"). So a
writer takes two turns before it asks SQLite: its process's (a lock in Python, so one thread per process asks)
and then the database's (an flock on `<database>-writer`, waited for in the kernel, which wakes the next
process as the holder lets go). Without the second, the processes met in the busy handler: while one API
process wrote back to back, the other slept there, and the machine idled at 60-70 % under a submit load
(docs/BENCHMARKS.md, "Submit throughput, stop 43").
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import OperationalError
from django.db.backends.sqlite3 import base

_WRITER = threading.Lock()  # the process's turn at SQLite's write lock


class DatabaseTurn:
    """The database's turn across processes: an exclusive flock on a file beside the database.

    Only the holder of the process's turn (_WRITER) asks, so a process waits with at most one thread. A wait
    happens in a thread of its own (the kernel's flock has no timeout): the asking thread waits for it at most
    `timeout` seconds, and a wait given up on lets the lock go as soon as it gets it.
    """

    def __init__(self, database: str) -> None:
        self.path = f"{database}-writer"
        self._held: int | None = None  # the descriptor whose open file holds the lock

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def acquire(self, timeout: float) -> bool:
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return self._wait(fd, timeout)
        except BaseException:
            os.close(fd)
            raise
        self._held = fd
        return True

    def _wait(self, fd: int, timeout: float) -> bool:
        decided = threading.Lock()  # the waiter's answer and the locker's outcome meet under it
        got = threading.Event()
        gave_up = False

        def lock() -> None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                os.close(fd)
                return
            with decided:
                if not gave_up:
                    got.set()
                    return
            os.close(fd)  # closing the last descriptor of the open file lets the lock go

        threading.Thread(target=lock, name="sqlite-writer-turn", daemon=True).start()
        if got.wait(timeout):
            self._held = fd
            return True
        with decided:
            if got.is_set():  # it came in as the wait ran out
                self._held = fd
                return True
            gave_up = True
        return False

    def release(self) -> None:
        fd, self._held = self._held, None
        if fd is not None:
            os.close(fd)  # the lock goes with the last descriptor of its open file


class DatabaseWrapper(base.DatabaseWrapper):
    """Takes the process's turn, then the database's, before BEGIN and gives both back at the commit, the
    rollback or the close. An in-memory database is this process's alone: it takes the process's turn only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._has_turn = False
        self._holding: DatabaseTurn | None = None  # the database's turn this connection holds, if any
        # As long as SQLite's own busy timeout would wait (Django's default for it is 5 s).
        self._turn_timeout = float(self.settings_dict.get("OPTIONS", {}).get("timeout", 5))
        self._turns: dict[str, DatabaseTurn] = {}

    @property
    def _database_turn(self) -> DatabaseTurn | None:
        """The turn of the file this connection writes to, read at each use: a test run renames the database."""
        if self.is_in_memory_db():
            return None
        name = str(self.settings_dict["NAME"])
        if name not in self._turns:
            self._turns[name] = DatabaseTurn(name)
        return self._turns[name]

    def _start_transaction_under_autocommit(self) -> None:
        deadline = time.monotonic() + self._turn_timeout
        if not _WRITER.acquire(timeout=self._turn_timeout):
            raise OperationalError(f"database is locked: no turn to write within {self._turn_timeout:g} s")
        self._has_turn = True
        try:
            turn = self._database_turn
            if turn is not None:
                if not turn.acquire(max(0.0, deadline - time.monotonic())):
                    raise OperationalError(
                        f"database is locked: another process held the turn to write for {self._turn_timeout:g} s"
                    )
                self._holding = turn
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
        """Commit, roll back or close, and give the turns back (if this connection holds them) whatever happens."""
        try:
            end()
        finally:
            self._give_turn_back()

    def _give_turn_back(self) -> None:
        if self._has_turn:
            self._has_turn = False
            if self._holding is not None:
                self._holding.release()
                self._holding = None
            _WRITER.release()
