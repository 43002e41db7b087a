"""PostgreSQL's view of a server process's connections, by the application name it connects with (PGAPPNAME)."""

from __future__ import annotations

from django.db import connection


def open_connections(application_name: str) -> int:
    """Connections to this database from the processes that connect as `application_name`."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
            [application_name],
        )
        return cursor.fetchone()[0]


def end_connections(application_name: str) -> int:
    """End those connections on the server's side, as a restart or an idle timeout would; how many there were."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s) ended",
            [application_name],
        )
        return cursor.fetchone()[0]
