"""The model fields of the job tables that load every value PostgreSQL can store (another
client may write `'infinity'` or an interval no `timedelta` holds): clamped in the
select only, the stored value unchanged. Migrations see Django's plain fields."""

from __future__ import annotations

from typing import Any

from django.db import models


class DateTimeField(models.DateTimeField):
    """A `DateTimeField` that loads every value PostgreSQL can store.

    PostgreSQL accepts `'infinity'`, `'-infinity'` and years beyond 9999 or before 1 in a
    `timestamptz`; Python's `datetime` holds none of them, so psycopg raises DataError
    when such a row is loaded, and one row written by another client would break every
    page and query that lists it. This field's select clamps them into the range that
    survives a conversion to any local time (`LOADABLE_LATEST`, `LOADABLE_EARLIEST`), in
    the SQL only: filters, ordering and the stored value are unchanged, and the worker's
    claim (raw SQL, `loading.fetch_jobs`) still fails such a job alone, with its reason.
    Migrations see a plain `models.DateTimeField`.
    """

    def select_format(self, compiler: Any, sql: str, params: Any) -> tuple[str, Any]:
        sql, params = super().select_format(compiler, sql, params)
        return _clamped(
            sql, params, f"'{LOADABLE_EARLIEST}'::timestamptz", f"'{LOADABLE_LATEST}'::timestamptz"
        )

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.DateTimeField", args, kwargs


class DurationField(models.DurationField):
    """A `DurationField` that loads every interval PostgreSQL can store: an interval
    longer than a `timedelta` holds (`'100000000 years'`, written by another client)
    is clamped to `LONGEST_INTERVAL` in the select, as `DateTimeField` does for
    timestamps; the stored value is unchanged. Migrations see a plain DurationField."""

    def select_format(self, compiler: Any, sql: str, params: Any) -> tuple[str, Any]:
        sql, params = super().select_format(compiler, sql, params)
        return _clamped(
            sql, params, f"interval '-{LONGEST_INTERVAL}'", f"interval '{LONGEST_INTERVAL}'"
        )

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.DurationField", args, kwargs


def _clamped(sql: str, params: Any, low: str, high: str) -> tuple[str, Any]:
    """A selected column held between two SQL literals (our own constants, not input)."""
    clamped = f"CASE WHEN {sql} > {high} THEN {high} WHEN {sql} < {low} THEN {low} ELSE {sql} END"
    return clamped, (*params, *params, *params)


#: The longest interval loaded as it is (a timedelta holds up to 999,999,999 days).
LONGEST_INTERVAL = "999999 days"

# A day inside Python's range at each end, so that no time zone's offset pushes a loaded
# value out of it.
LOADABLE_LATEST = "9999-12-30 00:00:00+00"
LOADABLE_EARLIEST = "0001-01-02 00:00:00+00"
