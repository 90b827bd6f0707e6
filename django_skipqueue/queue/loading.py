"""Model instances from raw rows, as the ORM would load them, without its per-row cost.

The claim (an `UPDATE ... RETURNING` of named columns) and the bulk enqueue run one
statement each; the rows they return become ordinary Job instances here. Measured:
RawQuerySet's model building and Model.__init__ took about half of a worker
dispatcher's time at full speed, and more than the INSERT itself in enqueue_many.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.db import DatabaseError, connections, models
from django.db.models import signals
from django.utils.asyncio import async_unsafe

from django_skipqueue.core.payload import PayloadField
from django_skipqueue.db.hooks import (
    fetch_all,
    has_receivers,
    instance_from_row,
    kept_cursor,
    load_timestamps_natively,
    raw_result,
    result_column_names,
)

M = TypeVar("M", bound=models.Model)

Converter = Callable[[Any, Any, Any], Any]

# Converters that give None for None (`_json_columns`).
_NONE_SAFE_FROM_DB_VALUE = (models.JSONField.from_db_value, PayloadField.from_db_value)


def loaded_jobs(
    model: type[M], alias: str, names: list[str], rows: Iterable[dict[str, Any]]
) -> list[M]:
    """`model` instances from rows holding every concrete column (by attname), converted.

    With no pre_init or post_init receiver for the model, Model.__init__ only sets each
    attribute, so that is done directly; when a project connects one, every row takes
    from_db's full path and the receivers see every instance.
    """
    if has_receivers(signals.pre_init, model) or has_receivers(signals.post_init, model):
        return [model.from_db(alias, names, [row[name] for name in names]) for row in rows]
    return [instance_from_row(model, alias, row) for row in rows]


def loaded_job(
    model: type[M], alias: str, names: list[str], row: dict[str, Any], own: dict[str, Any]
) -> M:
    """`loaded_jobs` of one row given in two parts, `own` laid over `row` (which holds
    every concrete column): an enqueued job, whose spec's columns are shared, is built
    without merging them into a new row first."""
    if has_receivers(signals.pre_init, model) or has_receivers(signals.post_init, model):
        return loaded_jobs(model, alias, names, (row | own,))[0]
    instance = instance_from_row(model, alias, row)
    instance.__dict__.update(own)
    return instance


@async_unsafe("You cannot call this from an async context - use a thread or sync_to_async.")
def job_cursor(alias: str) -> Any:
    """`with job_cursor(alias) as cursor:` a cursor of `alias` for the statements of the
    hot paths (enqueue, claim, ack), whose results are read inside the block
    (`db.hooks.fetch_one`, `fetch_all`): the connection's kept psycopg cursor where that
    is safe (`db.hooks.kept_cursor`), which loads `timestamptz` with psycopg's C loader
    where that gives Django's values (`db.hooks.load_timestamps_natively`; a claimed job
    row holds five of them)."""
    return kept_cursor(connections[alias], load_timestamps_natively)


def fetch_jobs(
    model: type[M],
    cursor: Any,
    alias: str,
    *,
    unloadable: list[tuple[int, str]] | None = None,
) -> list[M]:
    """Every row of `cursor` (all of the model's columns) as a `model` instance.

    All of them: a deferred field sends Django's `from_db` down its slow path, 14 us a
    row against 5 (measured with 38 of 40 columns), more than loading two NULLs costs.

    Each value goes through the converters Django's compiler would apply to that
    column (JSON decoding, for one), so the instances equal what the ORM loads.

    With `unloadable`, a row that Python cannot load (a timestamp of 'infinity' written
    by another client, which no datetime holds) is left out and listed there as (id,
    reason), so that one such row cannot strand the others; without it the error is
    raised.
    """
    names = result_column_names(cursor)
    if len(names) != len(model._meta.concrete_fields):
        raise ValueError(f"fetch_jobs needs every column of {model._meta.db_table}, got {names}")
    converting = [
        (name, functions)
        for name, functions in zip(names, _converters(model, alias, tuple(names)), strict=True)
        if functions
    ]  # most columns have none: only these are visited per row
    none_is_none = _json_columns(model)  # most of them NULL in most rows
    connection = connections[alias]

    def convert(values: Any) -> dict[str, Any]:
        row = dict(zip(names, values, strict=True))
        for name, functions in converting:
            value = row[name]
            if value is None and name in none_is_none:
                continue  # NULL in a JSON column: its converters give None for None
            for function, col in functions:
                value = function(value, col, connection)
            row[name] = value
        return row

    if unloadable is None:
        return loaded_jobs(model, alias, names, [convert(values) for values in fetch_all(cursor)])
    count = cursor.rowcount
    try:
        rows = [convert(values) for values in fetch_all(cursor)]
    except (DatabaseError, ValueError, TypeError, OverflowError):
        rows = []
        id_index = names.index(model._meta.pk.attname)
        for position in range(count):  # row by row: a row's error is its own
            cursor.scroll(position, mode="absolute")
            try:
                rows.append(convert(cursor.fetchone()))
            except (DatabaseError, ValueError, TypeError, OverflowError) as error:
                unloadable.append((raw_id(cursor, position, id_index), str(error)))
    return loaded_jobs(model, alias, names, rows)


@functools.lru_cache(maxsize=16)
def _json_columns(model: type[models.Model]) -> frozenset[str]:
    """The attnames of `model`'s JSON fields: Django's JSONField.from_db_value (and so
    PayloadField's) returns None for None, so a NULL there needs no converter call."""
    return frozenset(
        field.attname
        for field in model._meta.concrete_fields
        if isinstance(field, models.JSONField)
        and type(field).from_db_value in _NONE_SAFE_FROM_DB_VALUE
    )


def raw_id(cursor: Any, position: int, column: int) -> int:
    """The id at `position` of the result, read from the server's text, not loaded."""
    return int(raw_result(cursor).get_value(position, column))


_CONVERTERS: dict[
    tuple[type[models.Model], str, str, tuple[str, ...]], list[list[tuple[Converter, Any]]]
] = {}


def _converters(
    model: type[models.Model], alias: str, names: tuple[str, ...]
) -> list[list[tuple[Converter, Any]]]:
    """Per column: (converter, its Col) pairs, as SQLCompiler.get_converters finds them."""
    connection = connections[alias]
    key = (model, alias, connection.vendor, names)
    if key not in _CONVERTERS:
        by_attname = {field.attname: field for field in model._meta.concrete_fields}
        found = []
        for name in names:
            col = by_attname[name].get_col(model._meta.db_table)
            functions = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
            found.append([(function, col) for function in functions])
        _CONVERTERS[key] = found
    return _CONVERTERS[key]
