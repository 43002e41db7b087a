"""Django's PostgreSQL backend, whose pooled connections are checked only after they sat idle for a while.

With a pool (GENSERVER_DATABASE_POOL, the API's processes) and health checks on, psycopg_pool runs an empty query
on every connection it hands out: a round trip to the server before each request's first statement, 3 % of the
API's CPU under a submit load (docs/BENCHMARKS.md, "Submit throughput, stop 46"). A connection the server dropped
(a restart, an idle timeout) has sat in the pool since its last use; one handed back a moment ago, as under load
all of them were, is as sound as the last request found it, and a connection that broke during that request is
not put back (the pool discards it on return). So this backend checks a borrowed connection only when it was
handed back more than `DATABASE_CHECK_AFTER_IDLE` seconds ago (PgBouncer's `server_check_delay` does the same),
and borrows another in its place when the check fails.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.db.backends.postgresql import base

_RETURNED_AT = "_genserver_returned_at"  # set on the psycopg connection when it goes back to the pool
_BORROWS = 8  # connections tried before the error of the last check is raised: the pool has max_size at most


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        if self.pool is None:
            return super().get_new_connection(conn_params)
        for tries_left in range(_BORROWS - 1, -1, -1):
            connection = super().get_new_connection(conn_params)
            if not _needs_check(connection):
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


def _needs_check(connection: Any) -> bool:
    """A connection new to the pool (never handed back) is checked too: it may have waited there since the pool
    opened it."""
    returned_at = getattr(connection, _RETURNED_AT, None)
    return returned_at is None or time.monotonic() - returned_at > settings.DATABASE_CHECK_AFTER_IDLE
