"""The SQLite backend's write turns (genserver/db/sqlite3/base.py): held from BEGIN to its end, given back on every
path. Each test opens its own SQLite file through the backend, whatever database the session runs on."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import OperationalError
from django.db.utils import ConnectionHandler

from genserver.db.sqlite3 import base
from tests.support.waits import wait_for


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


# --- the database's turn across processes: an flock on `<database>-writer` --------------------------------


class _OtherProcess:
    """A real second process holding the database's turn until told to let go."""

    def __init__(self, database: Path) -> None:
        code = (
            "import fcntl, os, sys\n"
            f"fd = os.open({str(database) + '-writer'!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "sys.stdin.readline()\n"
        )
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdout is not None and self.process.stdout.readline() == b"held\n"

    def let_go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"\n")
        self.process.stdin.flush()
        self.process.wait(10)


def _turn_is_free(database: Path) -> bool:
    fd = os.open(f"{database}-writer", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@pytest.mark.parametrize("end", ["commit", "rollback", "close"])
def test_a_transaction_holds_the_databases_turn_until_it_ends(wrapper, database, end):
    assert _turn_is_free(database)
    _begin(wrapper)
    _write(wrapper)
    assert not _turn_is_free(database)  # another process's writer would wait
    getattr(wrapper, end)()
    assert _turn_is_free(database)


def test_a_writer_waits_for_another_processs_turn_and_writes_once_it_lets_go(database):
    other = _OtherProcess(database)
    wrote = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        conn = _wrapper(database)
        try:
            _begin(conn)  # waits on the other process's turn, before it asks SQLite
            _write(conn)
            conn.commit()
            wrote.set()
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)
        finally:
            conn.close()

    def waiting_in_the_kernel() -> bool:
        return any(t.name == "sqlite-writer-turn" for t in threading.enumerate())

    thread = threading.Thread(target=write)
    thread.start()
    try:
        wait_for(lambda: waiting_in_the_kernel() or errors, timeout=10, what="the writer waiting in the kernel")
        assert errors == []
        assert base._WRITER.locked() and not wrote.is_set()  # this process's turn taken by the waiting writer
    finally:
        other.let_go()
    thread.join(10)
    assert errors == [] and wrote.is_set()
    assert _turn_is_free(database) and not base._WRITER.locked()


def test_no_turn_from_another_process_within_the_timeout_fails_and_the_given_up_wait_lets_go(database):
    other = _OtherProcess(database)
    conn = _wrapper(database, timeout=0.05)
    try:
        with pytest.raises(OperationalError, match="another process held the turn to write for 0.05 s"):
            _begin(conn)
        assert not base._WRITER.locked()
    finally:
        other.let_go()
        conn.close()
    # The wait given up on takes the lock when the other process lets go, and lets it go at once.
    wait_for(lambda: _turn_is_free(database), timeout=10, what="the given-up wait to let the database's turn go")
    with _wrapper(database).cursor():
        pass


def test_an_in_memory_database_takes_no_file_turn():
    conn = _wrapper(Path(":memory:"))
    try:
        _begin(conn)
        assert conn._holding is None and base._WRITER.locked()
        conn.rollback()
        assert not base._WRITER.locked()
    finally:
        conn.close()
