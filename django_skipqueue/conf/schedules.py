"""SKIPQUEUE['SCHEDULES'] entries, checked: `conf` is the sole reader of settings.

An entry is `{"task": "app.tasks.report", "cron": "0 3 * * *", ...}`; the scheduler
(maintenance/scheduler.py) turns each checked entry into a `Cron` bound to its task.
Pure: no database.
"""

from __future__ import annotations

from typing import Any

from django_skipqueue.conf import check_entry, get_settings
from django_skipqueue.exceptions import ConfigurationError

#: The keys a SKIPQUEUE['SCHEDULES'] entry may have ("cron" is the expression).
SCHEDULE_KEYS = frozenset(
    {"task", "cron", "args", "kwargs", "queue_name", "priority", "timezone", "missed"}
    | {"catch_up", "grace"}
)


def schedule_entry(name: str, entry: object) -> dict[str, Any]:
    """One entry as the keyword arguments of a `Cron` named `name` (its "cron" given as
    "expression"), or ConfigurationError naming the fault."""
    where = f"SKIPQUEUE['SCHEDULES'][{name!r}]"
    checked = check_entry(where, entry, SCHEDULE_KEYS)
    for key in ("task", "cron"):
        if not isinstance(checked.get(key), str):
            raise ConfigurationError(f"{where} needs {key!r}, a string")
    options = {key: value for key, value in checked.items() if key != "cron"}
    return {"name": name, "expression": checked["cron"], **options}


def schedule_entries() -> dict[str, Any]:
    """SKIPQUEUE['SCHEDULES'] as it is set (each entry checked by `schedule_entry`)."""
    return dict(get_settings().SCHEDULES)
