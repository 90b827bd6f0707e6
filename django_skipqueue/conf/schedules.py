"""SKIPQUEUE['SCHEDULES'] entries, checked: `conf` is the sole reader of settings.

An entry is `{"task": "app.tasks.report", "cron": "0 3 * * *", ...}`; the scheduler
(maintenance/scheduler.py) turns each checked entry into a `Cron` bound to its task.
Pure: no database.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from django_skipqueue.conf import check_entry, get_settings
from django_skipqueue.exceptions import ConfigurationError

#: The keys a SKIPQUEUE['SCHEDULES'] entry may have ("cron" is the expression, "every"
#: an interval instead: seconds, a timedelta, or "30s").
SCHEDULE_KEYS = frozenset(
    {"task", "cron", "every", "args", "kwargs", "queue_name", "priority", "timezone"}
    | {"missed", "catch_up", "grace", "expires"}
)


def schedule_entry(name: str, entry: object) -> dict[str, Any]:
    """One entry as the keyword arguments of a `Cron` named `name` (its "cron", or its
    "every" as `@every ...` or a timedelta, given as "expression"), or
    ConfigurationError naming the fault."""
    where = f"SKIPQUEUE['SCHEDULES'][{name!r}]"
    checked = check_entry(where, entry, SCHEDULE_KEYS)
    if not isinstance(checked.get("task"), str):
        raise ConfigurationError(f"{where} needs 'task', a string")
    if ("cron" in checked) == ("every" in checked):
        raise ConfigurationError(
            f"{where} needs one of 'cron' (an expression) or 'every' (an interval: "
            f"seconds, a timedelta, or '30s')"
        )
    expression: Any
    if "cron" in checked:
        expression = checked["cron"]
        if not isinstance(expression, str):
            raise ConfigurationError(f"{where} needs 'cron', a string")
    else:
        expression = _interval(where, checked["every"])
    options = {key: value for key, value in checked.items() if key not in ("cron", "every")}
    return {"name": name, "expression": expression, **options}


def _interval(where: str, every: object) -> str | timedelta:
    """An entry's "every" as a Cron's expression: a timedelta, or `@every <duration>`."""
    if isinstance(every, timedelta):
        return every
    if isinstance(every, (int, float)) and not isinstance(every, bool):
        if not (math.isfinite(every) and every > 0):
            raise ConfigurationError(f"{where}: 'every' must be a positive number of seconds")
        return timedelta(seconds=every)
    if isinstance(every, str):
        return f"@every {every}"
    raise ConfigurationError(
        f"{where}: 'every' must be seconds, a timedelta, or a duration such as '30s', got {every!r}"
    )


def schedule_entries() -> dict[str, Any]:
    """SKIPQUEUE['SCHEDULES'] as it is set (each entry checked by `schedule_entry`)."""
    return dict(get_settings().SCHEDULES)
