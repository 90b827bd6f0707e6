"""Job instances from raw rows, as the ORM would load them, without its per-row cost.

The claim (`UPDATE ... RETURNING job.*`) and the bulk enqueue run raw SQL for speed; the
rows they return become ordinary Job instances here. Measured: RawQuerySet's model
building and Model.__init__ took about half of a worker dispatcher's time at full
speed, and more than the INSERT itself in enqueue_many.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.models import signals
from django.db.models.base import ModelState

if TYPE_CHECKING:
    from django_skipqueue.models import Job

Converter = Callable[[Any, Any, Any], Any]


def loaded_jobs(alias: str, names: list[str], rows: Iterable[dict[str, Any]]) -> list[Job]:
    """Job instances from rows holding every concrete column (by attname), converted.

    With no pre_init or post_init receiver for Job, Model.__init__ only sets each
    attribute, so that is done directly; when a project connects one, every row takes
    from_db's full path and the receivers see every instance.
    """
    from django_skipqueue.models import Job

    if signals.pre_init.has_listeners(Job) or signals.post_init.has_listeners(Job):
        return [Job.from_db(alias, names, [row[name] for name in names]) for row in rows]
    jobs = []
    for row in rows:
        job = Job.__new__(Job)
        state = ModelState()
        state.adding, state.db = False, alias
        job.__dict__.update(row, _state=state)
        jobs.append(job)
    return jobs


def fetch_jobs(cursor: Any, alias: str) -> list[Job]:
    """Every row of `cursor` (all of skipqueue_job's columns) as a Job instance.

    Each value goes through the converters Django's compiler would apply to that
    column (JSON decoding, for one), so the instances equal what the ORM loads.
    """
    from django_skipqueue.models import Job

    names = [column.name for column in cursor.description]
    if len(names) != len(Job._meta.concrete_fields):
        raise ValueError(f"fetch_jobs needs every column of skipqueue_job, got {names}")
    converters = _converters(alias, tuple(names))
    connection = connections[alias]
    rows = []
    for values in cursor.fetchall():
        row = {}
        for name, value, convert in zip(names, values, converters, strict=True):
            for function, col in convert:
                value = function(value, col, connection)
            row[name] = value
        rows.append(row)
    return loaded_jobs(alias, names, rows)


_CONVERTERS: dict[tuple[str, str, tuple[str, ...]], list[list[tuple[Converter, Any]]]] = {}


def _converters(alias: str, names: tuple[str, ...]) -> list[list[tuple[Converter, Any]]]:
    """Per column: (converter, its Col) pairs, as SQLCompiler.get_converters finds them."""
    from django_skipqueue.models import Job

    connection = connections[alias]
    key = (alias, connection.vendor, names)
    if key not in _CONVERTERS:
        by_attname = {field.attname: field for field in Job._meta.concrete_fields}
        found = []
        for name in names:
            col = by_attname[name].get_col(Job._meta.db_table)
            functions = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
            found.append([(function, col) for function in functions])
        _CONVERTERS[key] = found
    return _CONVERTERS[key]
