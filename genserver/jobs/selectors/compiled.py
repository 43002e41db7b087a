"""Reads of a fixed statement, compiled once per connection: the few that every submit and every list page make.

Django compiles a queryset's SQL at each evaluation: for the tally's rows, the held tally's and the running
jobs that is 0.1-0.3 ms each, about as long as the database takes to answer them, and 1-2 ms for a list page's
sums over the middle of a deep priority (a CASE per page job). A statement with no per-call values (no clock),
or only values compared as they are with a column (a queue's name, a priority, a job's id, a cutoff moment),
bound at each call, is the same SQL every time, so it is compiled at its first use on a connection and executed
as is afterwards, its rows converted with the converters Django would apply.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections, router
from django.db.models import Model, QuerySet


class _Statement:
    """One connection's compiled statement: its SQL and parameters (with the positions of the named values
    among them), and how its rows become values."""

    def __init__(self, queryset: QuerySet, alias: str, stand_ins: dict[str, Any]) -> None:
        self.compiler = queryset.query.get_compiler(using=alias)
        self.sql, params = self.compiler.as_sql()
        self.params = list(params)
        self.adapt_moment = connections[alias].ops.adapt_datetimefield_value
        self.native_ids = connections[alias].features.has_native_uuid_field
        self.positions = {
            name: [i for i, p in enumerate(self.params) if p == self._adapted(value)]
            for name, value in stand_ins.items()
        }
        if not all(self.positions.values()):
            raise TypeError(f"a named value is not a parameter of the statement: {self.positions}")
        columns = [selected[0] for selected in self.compiler.select[: self.compiler.col_count]]
        self.converters = self.compiler.get_converters(columns)
        # A model's rows (no annotation, no related model): the attribute each column fills, in order.
        self.attnames = [getattr(column, "target", None) and column.target.attname for column in columns]
        # Each column's name as `values()` would key it: its alias, else its field's.
        self.names = [
            selected[2] or getattr(selected[0], "target", None) and selected[0].target.attname
            for selected in self.compiler.select[: self.compiler.col_count]
        ]

    def _adapted(self, value: Any) -> Any:
        """A value as the compiled parameters hold it: a moment as its column adapts it (SQLite: text), an id
        as a UUID column does (SQLite: its hex)."""
        if isinstance(value, datetime):
            return self.adapt_moment(value)
        if isinstance(value, uuid.UUID) and not self.native_ids:
            return value.hex
        return value

    def rows(self, alias: str, values: dict[str, Any]) -> list[tuple[Any, ...]]:
        params = self.params
        if values:
            params = list(params)
            for name, value in values.items():
                adapted = self._adapted(value)
                for index in self.positions[name]:
                    params[index] = adapted
        with connections[alias].cursor() as cursor:
            cursor.execute(self.sql, params)
            rows = cursor.fetchall()
        if self.converters:  # they answer lists
            rows = [tuple(row) for row in self.compiler.apply_converters(rows, self.converters)]
        return rows


class CompiledRead:
    """A read of `model` whose queryset is `build(**values)`. `tuples(**values)` answers its rows as
    `values_list` would, `dicts(**values)` as `values` would; `instances()` as model instances, for a queryset of
    the model's own columns (`only`).

    `names` are the values a call passes: strings that the statement compares as they are (a queue's name),
    `moments`, aware datetimes it compares with a datetime column (a cutoff), `ints`, whole numbers it compares
    with an integer column, a small one included (a priority), and `ids`, UUIDs it compares with a UUID column (a
    job's id), bound at each call into the SQL compiled with stand-ins. Anything else the queryset reads is
    frozen at its compilation: give only statements that take no other value (no clock but a moment). The SQL
    is kept per connection (its converters may read it).
    """

    def __init__(
        self,
        model: type[Model],
        build: Callable[..., QuerySet],
        names: tuple[str, ...] = (),
        moments: tuple[str, ...] = (),
        ints: tuple[str, ...] = (),
        ids: tuple[str, ...] = (),
    ) -> None:
        self._model, self._build = model, build
        self._stand_ins: dict[str, Any] = {name: f"\x00stand-in for {name}" for name in names}
        epoch = datetime(1901, 1, 1, tzinfo=UTC)  # no call's moment: microseconds apart, one per name
        self._stand_ins |= {name: epoch + timedelta(microseconds=7 + i) for i, name in enumerate(moments)}
        # No call's value either, and no constant's of a statement (a small CASE's results, a bound 0 or 1), yet
        # within a small integer column's range, which Django checks a compared value against.
        self._stand_ins |= {name: 32_001 + i for i, name in enumerate(ints)}
        self._stand_ins |= {name: uuid.UUID(int=0x5A_7A_4D_1D_0000 + i) for i, name in enumerate(ids)}
        self._statements: weakref.WeakKeyDictionary[Any, _Statement] = weakref.WeakKeyDictionary()

    def _statement(self) -> tuple[str, _Statement]:
        alias = router.db_for_read(self._model)
        connection = connections[alias]
        statement = self._statements.get(connection)
        if statement is None:
            statement = _Statement(self._build(**self._stand_ins), alias, self._stand_ins)
            self._statements[connection] = statement
        return alias, statement

    def tuples(self, **values: Any) -> list[tuple[Any, ...]]:
        if values.keys() != self._stand_ins.keys():
            raise TypeError(f"this read takes {sorted(self._stand_ins)}, not {sorted(values)}")
        alias, statement = self._statement()
        return statement.rows(alias, values)

    def dicts(self, **values: Any) -> list[dict[str, Any]]:
        """Its rows as `values()` would give them: a dict per row, keyed by the columns' names."""
        if values.keys() != self._stand_ins.keys():
            raise TypeError(f"this read takes {sorted(self._stand_ins)}, not {sorted(values)}")
        alias, statement = self._statement()
        return [dict(zip(statement.names, row, strict=True)) for row in statement.rows(alias, values)]

    def instances(self) -> list[Any]:
        alias, statement = self._statement()
        if not all(statement.attnames):
            raise TypeError("instances() reads a queryset of the model's own columns only")
        names = statement.attnames
        return [self._model.from_db(alias, names, row) for row in statement.rows(alias, {})]


def sql_words(values: Iterable[str]) -> str:
    """Constants of the code (statuses) as a list of SQL string literals, for a statement's text: bound as
    parameters instead, a prepared statement's generic plan cannot match a partial index's condition on them,
    and PostgreSQL plans such a statement again at every execution."""
    words = list(values)
    if not all(word.isidentifier() for word in words):
        raise ValueError(f"not plain words: {words!r}")
    return ", ".join(f"'{word}'" for word in words)
