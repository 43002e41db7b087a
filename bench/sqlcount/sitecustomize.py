"""Counts every SQL statement a process runs, for bench/cluster_load.py (on PYTHONPATH only there).

Python imports `sitecustomize` at start-up, so with this directory first on
PYTHONPATH every process of the stack (gunicorn's workers, each Celery worker,
beat, manage.py) connects a `connection_created` receiver that adds an
execute wrapper to each new database connection. The wrapper appends one line,
the statement's first word (SELECT, INSERT, UPDATE, SAVEPOINT, ...), to
`$BENCH_SQLCOUNT_DIR/<role>-<pid>.sql`, where the role names the process
(`api`, the Celery worker's name such as `gpu0`, `beat`, `flower`, or the
script). Transaction control that psycopg sends itself (BEGIN, COMMIT) does not
pass through Django's cursors and is not counted; an executemany is one line.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _role() -> str:
    argv = sys.argv
    joined = " ".join(argv)
    if "gunicorn" in joined or "uvicorn" in joined:
        return "api"
    if "celery" in joined:
        if "--hostname" in argv:
            return argv[argv.index("--hostname") + 1].split("@")[0]
        for name in ("beat", "flower", "worker"):
            if name in argv:
                return name
        return "celery"
    return os.path.basename(argv[0]).removesuffix(".py") or "python"


class _Counter:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.pid = -1
        self.file: Any = None

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if self.pid != os.getpid():  # first statement, or a forked child (gunicorn's workers)
            self.pid = os.getpid()
            self.file = open(os.path.join(self.directory, f"{_role()}-{self.pid}.sql"), "a", buffering=1)
        verb = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else "?"
        self.file.write(verb + "\n")
        return execute(sql, params, many, context)


def _install(directory: str) -> None:
    try:
        from django.db.backends.signals import connection_created
    except ImportError:  # a Python without Django (nothing to count)
        return

    counter = _Counter(directory)

    def add_wrapper(sender: Any, connection: Any, **kwargs: Any) -> None:
        if counter not in connection.execute_wrappers:
            connection.execute_wrappers.append(counter)

    connection_created.connect(add_wrapper, weak=False)


if os.environ.get("BENCH_SQLCOUNT_DIR"):
    _install(os.environ["BENCH_SQLCOUNT_DIR"])
