"""The triggers that keep a tally table of job counts and wall seconds, on PostgreSQL and SQLite (0013, 0015).

A tally row is one group of jobs (its `key` columns) that meet a condition: every insert, update and
delete of a job leaves the old row's group (one fewer, its seconds less) and joins the new row's, in the
same transaction. Not a migration (the leading underscore keeps Django's loader off it).
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVE_STATUSES = "('queued', 'encoding', 'denoising', 'decoding')"
# Wall seconds of work left (Job.remaining_seconds × clock_scale), in SQL.
SECONDS = (
    "{t}.estimated_seconds * {greatest}(0, {t}.steps * {t}.segment_count - {t}.steps_done)"
    " / ({t}.steps * {t}.segment_count) * {t}.clock_scale"
)
SQLITE_EVENTS = (("insert", "INSERT", "NEW"), ("update_old", "UPDATE", "OLD"), ("update_new", "UPDATE", "NEW"))
SQLITE_DELETE = ("delete", "DELETE", "OLD")


@dataclass(frozen=True)
class Tally:
    table: str  # the tally's table, e.g. jobs_queuetally
    name: str  # the PostgreSQL function and trigger, and the SQLite triggers' prefix
    condition: str  # which job rows count, with {t} for the row (OLD, NEW or the table's alias)
    key: tuple[str, ...]  # the job columns a row of the tally groups by

    def _subtract(self) -> str:
        """Leave a job's group: one fewer, its seconds less (the last one leaves an exact 0, no float residue)."""
        where = " AND ".join(f"{c} = {{t}}.{c}" for c in self.key)
        return (
            f"UPDATE {self.table} SET count = count - 1, seconds = CASE WHEN count <= 1 THEN 0 ELSE seconds - ("
            + SECONDS
            + ") END WHERE "
            + where
        )

    def _add(self) -> str:
        columns = ", ".join(self.key)
        values = ", ".join(f"{{t}}.{c}" for c in self.key)
        return (
            f"INSERT INTO {self.table} ({columns}, count, seconds) VALUES ({values}, 1, " + SECONDS + ") "
            f"ON CONFLICT ({columns}) DO UPDATE "
            f"SET count = {self.table}.count + 1, seconds = {self.table}.seconds + excluded.seconds"
        )

    def _fill(self) -> str:
        columns = ", ".join(self.key)
        return (
            f"INSERT INTO {self.table} ({columns}, count, seconds) SELECT {columns}, COUNT(*), SUM("
            + SECONDS
            + ") FROM jobs_job AS j WHERE "
            + self.condition
            + f" GROUP BY {columns}"
        )

    def postgresql(self) -> list[str]:
        def fmt(text: str, t: str) -> str:
            return text.format(t=t, greatest="GREATEST")

        return [
            f"CREATE OR REPLACE FUNCTION {self.name}() RETURNS trigger AS $$\n"
            "BEGIN\n"
            f"  IF TG_OP IN ('UPDATE', 'DELETE') AND {fmt(self.condition, 'OLD')} THEN\n"
            f"    {fmt(self._subtract(), 'OLD')};\n"
            "  END IF;\n"
            f"  IF TG_OP IN ('INSERT', 'UPDATE') AND {fmt(self.condition, 'NEW')} THEN\n"
            f"    {fmt(self._add(), 'NEW')};\n"
            "  END IF;\n"
            "  RETURN NULL;\n"
            "END $$ LANGUAGE plpgsql",
            f"CREATE TRIGGER {self.name} AFTER INSERT OR UPDATE OR DELETE ON jobs_job "
            f"FOR EACH ROW EXECUTE FUNCTION {self.name}()",
            fmt(self._fill(), "j"),
        ]

    def sqlite(self) -> list[str]:
        def fmt(text: str, t: str) -> str:
            return text.format(t=t, greatest="MAX")

        statements = []
        for suffix, event, row in (*SQLITE_EVENTS, SQLITE_DELETE):
            body = self._add() if row == "NEW" else self._subtract()
            statements.append(
                f"CREATE TRIGGER {self.name}_{suffix} AFTER {event} ON jobs_job "
                f"WHEN {fmt(self.condition, row)} BEGIN {fmt(body, row)}; END"
            )
        return [*statements, fmt(self._fill(), "j")]

    def install(self, schema_editor) -> None:
        vendor = schema_editor.connection.vendor
        if vendor not in ("postgresql", "sqlite"):
            raise RuntimeError(f"{self.table}'s triggers are written for PostgreSQL and SQLite, not {vendor}")
        for statement in self.postgresql() if vendor == "postgresql" else self.sqlite():
            schema_editor.execute(statement)

    def uninstall(self, schema_editor) -> None:
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"DROP TRIGGER IF EXISTS {self.name} ON jobs_job")
            schema_editor.execute(f"DROP FUNCTION IF EXISTS {self.name}()")
        else:
            for suffix, _, _ in (*SQLITE_EVENTS, SQLITE_DELETE):
                schema_editor.execute(f"DROP TRIGGER IF EXISTS {self.name}_{suffix}")
