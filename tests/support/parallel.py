"""One database, one Redis database and one data directory per pytest-xdist worker (`make test` runs two).

Each xdist worker is a whole test session of its own: its tests, and the stack
its stack tests boot, must share nothing with another worker's. So before the
settings are read, a worker's process points its environment (which the stack's
processes inherit) at its own:
- PostgreSQL database: `<name>_<worker>` on the same server, created when missing
  (the session's `flush` empties it, as it does the configured one without xdist);
- Redis database: the configured number plus 1 plus the worker's index, on the same
  server (Celery's broadcasts are prefixed by the database number, so they stay apart);
  without REDIS_URL each worker starts its own bundled server anyway;
- data directory (SQLite file, models, outputs): a sub-directory named for the worker;
- Prometheus's multiprocess directory, when the controller already set it (its Django
  setup imports genserver.metrics, which sets it under the shared data directory): a
  sub-directory named for the worker, else one worker's submits move the other's counters.

Outside xdist (`pytest` alone, `make test PYTEST_WORKERS=0`) nothing changes.
"""

from __future__ import annotations

import os
import re
import urllib.parse

ISOLATED_FOR = "PYTEST_ISOLATED_FOR_WORKER"  # set once done: the stack's processes import these settings too
REDIS_DATABASES = 16  # Redis's default `databases`; the highest a worker may take is 15


def worker_id() -> str | None:
    """The xdist worker this process is (`gw0`, `gw1`, …), or None outside xdist (or in its controller)."""
    return os.environ.get("PYTEST_XDIST_WORKER") or None


def isolate_worker_environment() -> None:
    """Point this worker's DATABASE_URL, REDIS_URL, data and metrics directories at their own."""
    worker = worker_id()
    if worker is None or os.environ.get(ISOLATED_FOR) == worker:
        return  # outside xdist, or a process the worker started (a stack's), which inherits the result
    index = int(re.sub(r"\D", "", worker) or 0)
    if os.environ.get("DATABASE_URL"):
        os.environ["DATABASE_URL"] = _own_postgres_database(os.environ["DATABASE_URL"], worker)
    if os.environ.get("REDIS_URL"):
        os.environ["REDIS_URL"] = _own_redis_database(os.environ["REDIS_URL"], index)
    if os.environ.get("GENSERVER_DATA_DIR"):  # set by hand: the workers share its parent, not the directory
        own = os.path.join(os.environ["GENSERVER_DATA_DIR"], worker)
        os.makedirs(own, exist_ok=True)
        os.environ["GENSERVER_DATA_DIR"] = own
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # inherited from the controller: every worker's files together
        own = os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], worker)
        os.makedirs(own, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = own
    os.environ[ISOLATED_FOR] = worker


def _own_postgres_database(url: str, worker: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme.startswith("postgres"):
        return url  # SQLite lives in the (per-worker) data directory
    base = parts.path.lstrip("/")
    name = f"{base}_{worker}"
    import psycopg
    from psycopg import errors, sql

    # CREATE DATABASE cannot run in a transaction; two workers create different names, so no race between them.
    with psycopg.connect(url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            try:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            except errors.DuplicateDatabase:
                pass  # an earlier, interrupted run of the same worker got there first
    return parts._replace(path=f"/{name}").geturl()


def _own_redis_database(url: str, index: int) -> str:
    parts = urllib.parse.urlsplit(url)
    base = int(parts.path.lstrip("/") or 0)
    number = base + 1 + index
    if number >= REDIS_DATABASES:
        raise RuntimeError(
            f"REDIS_URL's database {base} leaves no Redis database for xdist worker {index} "
            f"(it would take {number}; Redis has {REDIS_DATABASES}): use a lower database or fewer PYTEST_WORKERS"
        )
    return parts._replace(path=f"/{number}").geturl()
