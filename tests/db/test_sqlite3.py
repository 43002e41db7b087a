"""The SQLite backend's write turns (genserver/db/sqlite3/base.py): held from BEGIN to its end, given back on every
path. Each test opens its own SQLite file through the backend, whatever database the session runs on."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import OperationalError
from django.db.utils import ConnectionHandler

from genserver.db.sqlite3 import base


@pytest.fixture(autouse=True)
def _own_database(django_db_blocker) -> Iterator[None]:
    with django_db_blocker.unblock():  # these connections are to the test's own file, not the session's database
        yield


@pytest.fixture
def database(tmp_path: Path) -> Path:
    path = tmp_path / "turns.sqlite3"
    with sqlite3.connect(path) as setup:
        setup.execute("CREATE TABLE t (x INTEGER)")
    return path


def _wrapper(path: Path, timeout: float = 5) -> base.DatabaseWrapper:
    handler = ConnectionHandler(
        {
            "default": {
                "ENGINE": "genserver.db.sqlite3",
                "NAME": str(path),
                "OPTIONS": {"timeout": timeout, "transaction_mode": "IMMEDIATE"},
            }
        }
    )
    return handler["default"]


@pytest.fixture
def wrapper(database: Path) -> Iterator[base.DatabaseWrapper]:
    conn = _wrapper(database)
    yield conn
    conn.close()


def _begin(conn: base.DatabaseWrapper) -> None:
    """What transaction.atomic() does first on SQLite: BEGIN while in autocommit."""
    conn.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)


def _write(conn: base.DatabaseWrapper) -> None:
    with conn.cursor() as cursor:
        cursor.execute("INSERT INTO t VALUES (1)")


@pytest.mark.parametrize("end", ["commit", "rollback", "close"])
def test_a_transaction_holds_the_processs_turn_until_it_ends(wrapper, end):
    assert not base._WRITER.locked()
    _begin(wrapper)
    _write(wrapper)
    assert base._WRITER.locked()
    getattr(wrapper, end)()
    assert not base._WRITER.locked()


def test_a_begin_that_sqlite_refuses_gives_the_turn_back(database):
    other_process = sqlite3.connect(database, isolation_level=None)  # its own lock, as another process's
    other_process.execute("BEGIN IMMEDIATE")
    conn = _wrapper(database, timeout=0.05)
    try:
        with pytest.raises(OperationalError, match="locked"):
            _begin(conn)
        assert not base._WRITER.locked()
    finally:
        other_process.execute("ROLLBACK")
        other_process.close()
        conn.close()


class _WatchedLock:
    """The process's turn, telling when a thread other than the first asks for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asked_by_another = threading.Event()
        self.first = threading.get_ident()

    def acquire(self, timeout: float = -1) -> bool:
        if threading.get_ident() != self.first:
            self.asked_by_another.set()
        return self.lock.acquire(timeout=timeout)

    def release(self) -> None:
        self.lock.release()

    def locked(self) -> bool:
        return self.lock.locked()


def test_a_thread_waits_for_the_turn_and_takes_it_when_the_holder_commits(wrapper, database, monkeypatch):
    turn = _WatchedLock()
    monkeypatch.setattr(base, "_WRITER", turn)
    _begin(wrapper)
    _write(wrapper)
    wrote = threading.Event()

    def second_thread() -> None:
        conn = _wrapper(database)
        _begin(conn)  # waits on the turn, before it asks SQLite
        _write(conn)
        conn.commit()
        conn.close()
        wrote.set()

    thread = threading.Thread(target=second_thread)
    thread.start()
    assert turn.asked_by_another.wait(10)  # it queued on the process's turn (SQLite's busy handler would not)
    assert not wrote.is_set()
    wrapper.commit()
    thread.join(10)
    assert wrote.is_set()
    with wrapper.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM t")
        assert cursor.fetchone()[0] == 2


def test_no_turn_within_the_timeout_fails_with_a_message_that_says_so(wrapper, database):
    _begin(wrapper)
    errors: list[Exception] = []

    def impatient() -> None:
        conn = _wrapper(database, timeout=0.05)
        try:
            _begin(conn)
        except OperationalError as error:
            errors.append(error)
        finally:
            conn.close()

    thread = threading.Thread(target=impatient)
    thread.start()
    thread.join(10)
    wrapper.rollback()
    assert [str(e) for e in errors] == ["database is locked: no turn to write within 0.05 s"]
    assert not base._WRITER.locked()
