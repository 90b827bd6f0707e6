"""Rows: the one mapping from a job spec and its calls to the parameters of the
enqueue's statements (`sql.ENQUEUE_ONE`, `sql.ENQUEUE_MANY`, `sql.WORKFLOW_INSERT`), and
a job row as an enqueue returns it. Used by the enqueue verbs and by workflows."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django_skipqueue.core.payload import encode
from django_skipqueue.core.spec import SpecMemo
from django_skipqueue.db.direct import text_parameters
from django_skipqueue.queue import sql
from django_skipqueue.queue.base import Checked

if TYPE_CHECKING:
    from django_skipqueue.core.spec import JobSpec
    from django_skipqueue.models import Job


@functools.cache
def job_template(model: type[Job]) -> tuple[list[str], dict[str, Any]]:
    """The concrete attnames of `model`, and a row of them holding each field's default
    (None where it has none): what an enqueued job holds before its own columns. Fields
    whose default is a callable (args, kwargs, errors: a new list or dict) are set by
    every enqueue itself; the template's copies are never handed out."""
    fields = model._meta.concrete_fields
    names = [field.attname for field in fields]
    defaults = {field.attname: field.get_default() for field in fields if field.has_default()}
    return names, dict.fromkeys(names) | defaults


def enqueue_parts(
    spec: JobSpec, model: type[Job]
) -> tuple[dict[str, bytes | None] | None, dict[str, Any]]:
    """What every enqueue of `spec` shares, kept in `_PARTS`: its INSERT's parameters
    other than the call's own, in the text form `db.direct.direct_row` sends (None where
    one has none), and the job row before the call's own columns."""
    cached = _PARTS.get((spec, model))
    if cached is not None:
        return cached
    params = insert_params(spec, [])
    del params["args"], params["kwargs"]
    parts = (text_parameters(params), job_template(model)[1] | spec.shared_columns())
    _PARTS.put((spec, model), parts)
    return parts


#: enqueue_parts' values, by (spec, model).
_PARTS = SpecMemo()


@functools.cache
def insert_defaults(model: type[Job]) -> tuple[tuple[str, object], ...]:
    """The model's defaults of the columns `sql.ENQUEUE_MANY` fills with them (the model
    fields are their one source), as (column, value) for `sql.enqueue_many_statement`."""
    fields = {field.name: field for field in model._meta.concrete_fields}
    values = {name: fields[name].get_default() for name in sql.ENQUEUE_DEFAULTS}
    values |= {"state": str(values["state"]), "errors": encode(values["errors"])}
    return tuple(values.items())


@functools.cache
def job_columns(model: type[Job]) -> tuple[str, ...]:
    """The job table's column names, in the model's order."""
    return tuple(field.column for field in model._meta.concrete_fields if field.column)


def insert_params(spec: JobSpec, batch: Sequence[Checked]) -> dict[str, Any]:
    """The parameters of an enqueue's INSERT for `spec` and its checked calls: the
    spec's shared columns, and the calls' arguments as one JSON array text each."""
    shared = spec.shared_columns()
    return {
        "task": shared["task"],
        "queue": shared["queue_name"],
        "priority": shared["priority"],
        "run_at": spec.run_after if isinstance(spec.run_after, datetime) else None,
        "delay": spec.run_after if isinstance(spec.run_after, timedelta) else timedelta(0),
        "lease": shared["lease"],
        "max_attempts": shared["max_attempts"],
        "expires_at": spec.expires if isinstance(spec.expires, datetime) else None,
        "expires_in": spec.expires if isinstance(spec.expires, timedelta) else None,
        "rate_key": spec.rate_key,
        "rate_limit": spec.rate_limit,
        # One JSON array text per column, not a text[] of one element per call:
        # psycopg dumps a list element by element (measured: a sixth of a bulk enqueue).
        "args": "[" + ", ".join(args_json for _, _, args_json, _ in batch) + "]",
        "kwargs": "[" + ", ".join(kwargs_json for _, _, _, kwargs_json in batch) + "]",
    }
