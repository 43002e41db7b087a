"""Django's PostgreSQL backend, whose health check pings a connection only after it sat idle for a while.

Django checks a kept connection before its first query of every request or task (`CONN_HEALTH_CHECKS`: Celery's
task_prerun in tasks/common.py, a request's start), and psycopg_pool checks a pooled one at every borrow: an
empty round trip to the server each time, 3 % of the API's CPU under a submit load and a round trip on every
card's dispatch (docs/BENCHMARKS.md, "Submit throughput, stop 46"). What the check is for is a connection the
server dropped while nobody used it (a restart, an idle timeout); one used a moment ago is as sound as its last
query found it, and one that broke during a query is closed (Django's `errors_occurred`) or not put back (the
pool discards it). So this backend pings a connection only when it was last used, or handed back to the pool,
more than `DATABASE_CHECK_AFTER_IDLE` seconds ago (PgBouncer's `server_check_delay` does the same), and a pooled
one that fails is replaced by another.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.db.backends.postgresql import base

_RETURNED_AT = "_genserver_returned_at"  # set on the psycopg connection when it goes back to the pool
_BORROWS = 8  # pooled connections tried before the last one's check error is raised


class DatabaseWrapper(base.DatabaseWrapper):
    _used_at = float("-inf")  # when this thread's kept connection last gave a cursor (time.monotonic)

    def _cursor(self, name: str | None = None) -> Any:
        cursor = super()._cursor(name)
        self._used_at = time.monotonic()
        return cursor

    def close_if_health_check_failed(self) -> None:
        """Django's check of a kept connection, skipped for one used within the window."""
        if self.connection is not None and not self.health_check_done and not _idle_since(self._used_at):
            self.health_check_done = True
        super().close_if_health_check_failed()

    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        """A pooled connection is checked here, not by psycopg_pool (settings: CONN_HEALTH_CHECKS is off under
        a pool, so it does not check every borrow)."""
        if self.pool is None:
            return super().get_new_connection(conn_params)
        for tries_left in range(_BORROWS - 1, -1, -1):
            connection = super().get_new_connection(conn_params)
            if not _idle_since(getattr(connection, _RETURNED_AT, None)):
                return connection
            try:
                connection.execute("")  # as psycopg_pool's check_connection: the server answers or it is gone
            except self.Database.Error:
                self.pool.putconn(connection)  # broken: the pool closes it and opens a new one
                if not tries_left:
                    raise
            else:
                return connection
        raise AssertionError("unreachable: the last try returns or raises")

    def _close(self) -> None:
        if self.pool and self.connection is not None:
            setattr(self.connection, _RETURNED_AT, time.monotonic())
        super()._close()


def _idle_since(moment: float | None) -> bool:
    """Whether a connection last used (or handed back) at `moment` sat idle past the window; one never used (None:
    new to the pool, where it may have waited since the pool opened it) has."""
    return moment is None or time.monotonic() - moment > settings.DATABASE_CHECK_AFTER_IDLE
