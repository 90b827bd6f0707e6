"""The checks and normalizations of a task's options (priority, run_after, expires,
max_attempts, lease and time limits): each bad value named in an InvalidJobError, at
decoration and at every `.using()`."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import TYPE_CHECKING

from django.conf import settings
from django.utils import timezone

from django_skipqueue.conf import MAX_LEASE, MIN_LEASE
from django_skipqueue.core.states import (
    MAX_PRIORITY,
    MIN_PRIORITY,
)
from django_skipqueue.exceptions import (
    InvalidJobError,
)

if TYPE_CHECKING:
    pass


def validate_priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidJobError(f"priority must be an integer, got {priority!r}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidJobError(
            f"priority {priority} is out of range: use {MIN_PRIORITY} to {MAX_PRIORITY} "
            f"(higher runs first)"
        )
    return priority


def storable_instant(option: str, value: datetime) -> datetime:
    """An aware instant that is also one in UTC, where the job's row keeps it and from
    where Python reads it back: years 1 to 9999 there. Refused before any SQL, so that
    no row is written for a call that raises (in autocommit it would stay)."""
    if timezone.is_aware(value):
        try:
            value.astimezone(dt_timezone.utc)
        except OverflowError:
            raise InvalidJobError(
                f"{option} {value.isoformat()} is outside years 1 to 9999 in UTC"
            ) from None
    return value


def validate_run_after(run_after: object) -> datetime | timedelta | None:
    if run_after is None:
        return None
    if isinstance(run_after, timedelta):
        if run_after < timedelta(0):
            raise InvalidJobError(f"run_after is a negative delay ({run_after}); use >= 0")
        return run_after
    if isinstance(run_after, datetime):
        if settings.USE_TZ and timezone.is_naive(run_after):
            raise InvalidJobError(
                f"run_after {run_after.isoformat()} is a naive datetime while USE_TZ is on; "
                f"pass an aware datetime (django.utils.timezone.make_aware) or a timedelta"
            )
        return storable_instant("run_after", run_after)
    raise InvalidJobError(
        f"run_after must be an aware datetime or a timedelta, got {type(run_after).__name__}"
    )


def validate_expires(value: object, *, when: str = "a call") -> datetime | timedelta | None:
    """`expires` as a timedelta (from seconds too) or an aware datetime; InvalidJobError
    naming the fault. A task's own (`@task(expires=...)`) and a schedule's are delays:
    an instant is for one call (`.using(expires=...)`)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise InvalidJobError(f"expires must be a positive number of seconds, got {value!r}")
        try:
            return timedelta(seconds=value)
        except OverflowError:
            raise InvalidJobError(f"expires {value!r} seconds is longer than any delay") from None
    if isinstance(value, timedelta):
        if value <= timedelta(0):
            raise InvalidJobError(f"expires must be a positive delay, got {value}")
        return value
    if isinstance(value, datetime) and when == "a call":
        if settings.USE_TZ and timezone.is_naive(value):
            raise InvalidJobError(
                f"expires {value.isoformat()} is a naive datetime while USE_TZ is on; pass "
                f"an aware datetime or a delay"
            )
        return storable_instant("expires", value)
    kinds = (
        "seconds, a timedelta or an aware datetime"
        if when == "a call"
        else (
            f"seconds or a timedelta (a delay after {when}; an instant is for one call: "
            f".using(expires=...))"
        )
    )
    raise InvalidJobError(f"expires must be {kinds}, got {value!r}")


def validate_max_attempts(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidJobError(f"max_attempts must be a positive integer, got {value!r}")
    return value


def validate_lease(value: object, name: str = "lease") -> timedelta | None:
    """A lease (or timeout) as a timedelta within MIN_LEASE..MAX_LEASE, from seconds too."""
    if value is None:
        return None
    bounds = f"use {MIN_LEASE.total_seconds():g} seconds to {MAX_LEASE.days} days"
    seconds: float | None = None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
    if seconds is None or math.isnan(seconds):
        raise InvalidJobError(f"{name} must be a timedelta or seconds, got {value!r}")
    if not MIN_LEASE.total_seconds() <= seconds <= MAX_LEASE.total_seconds():
        raise InvalidJobError(f"{name} {value!r} is out of bounds: {bounds}")
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)
