"""The scheduler: every worker enqueues the due occurrences of the periodic schedules.

- `defined_schedules()`: the schedules in the code: those of tasks (`@task(schedule=...)`)
  and SKIPQUEUE['SCHEDULES'], each a `Cron` bound to its task.
- `sync()`: copies them into the schedule table when a worker starts, and deletes the
  rows of schedules that are no longer in the code (so they stop firing, and nothing is
  left for an operator to clean), except a paused one, kept so that its pause is not
  lost if an older release re-creates it.
- `tick()`: enqueues what is due, on the database clock, a short transaction per schedule,
  from the definition in the schedule's row rather than the worker's own copy: while the
  workers of two releases overlap (a rolling deploy), they fire the same occurrences.
- `Scheduler`: a worker's thread that ticks at each occurrence.

Each occurrence becomes exactly one job however many workers tick at once: the job
table's unique constraint on (schedule, scheduled_for) makes a second insert of it a
no-op (ON CONFLICT DO NOTHING). The schedule rows are locked FOR UPDATE SKIP LOCKED only
so that workers do not do the same work twice; correctness does not rest on the lock.
Occurrences are remembered in the schedule row (`last_occurrence_at`, which only moves
forward), so pruning old jobs never makes an occurrence run again.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connections, transaction
from django.db.models import F
from django.db.models.functions import Coalesce, Greatest, Now

from django_skipqueue.conf.schedules import schedule_entries, schedule_entry
from django_skipqueue.core.cron import MAX_OCCURRENCES_PER_PASS, Cron
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.faults import is_transient
from django_skipqueue.models import Job, Schedule
from django_skipqueue.queue.connections import Backoff, bounded, discard_connection
from django_skipqueue.tasks.base import bind_schedules
from django_skipqueue.tasks.registry import registry

logger = logging.getLogger(__name__)


def default_zone() -> str:
    """The zone a schedule without its own is read in: settings.TIME_ZONE, else UTC."""
    return settings.TIME_ZONE or "UTC"


#: The longest the scheduler thread sleeps between passes: how soon it sees a schedule
#: paused or resumed by an operator, or a schedule synced by another worker.
MAX_WAIT = 5.0
#: The columns of a schedule row that come from its definition in code.
DEFINITION_FIELDS = (
    "task",
    "expression",
    "timezone",
    "args",
    "kwargs",
    "queue_name",
    "priority",
    "missed",
    "catch_up",
    "grace",
)


def cron_from_setting(name: str, entry: object) -> Cron:
    """One SKIPQUEUE['SCHEDULES'] entry as a Cron, or ConfigurationError naming the fault."""
    return Cron(**schedule_entry(name, entry))


def defined_schedules() -> dict[str, Cron]:
    """The schedules in the code, by name, each bound to its registered task.

    ConfigurationError when one cannot run (an unknown task, arguments its function does
    not take) or two share a name, naming every such schedule; the system check
    skipqueue.E010 reports each of them.
    """
    found, problems = read_schedules()
    if problems:
        raise ConfigurationError("; ".join(problems))
    return found


def read_schedules() -> tuple[dict[str, Cron], list[str]]:
    """The schedules that can run, by name, and what is wrong with each one that cannot:
    one broken schedule does not hide the next."""
    found: dict[str, Cron] = {}
    problems: list[str] = []

    def add(cron: Cron, where: str) -> None:
        assert cron.name is not None  # noqa: S101  (bound crons are named)
        if cron.name in found:
            problems.append(
                f"two schedules are named {cron.name!r} ({where} and another); rename one"
            )
            return
        found[cron.name] = cron

    for task_name in registry.names():
        for cron in registry.get(task_name).schedules:
            add(cron, f"@task {task_name}")
    for name, entry in schedule_entries().items():
        try:
            cron = cron_from_setting(name, entry)
            if cron.task not in registry:
                raise ConfigurationError(
                    f"SKIPQUEUE['SCHEDULES'][{name!r}] runs {cron.task!r}, which is not a "
                    f"registered task ({_why_unregistered(cron.task or '')})"
                )
            (bound,) = bind_schedules(registry.get(cron.task or ""), cron)
        except ConfigurationError as error:
            problems.append(str(error))
            continue
        add(bound, "SKIPQUEUE['SCHEDULES']")
    return found, problems


def _why_unregistered(path: str) -> str:
    """Why `path` names no task: a function that exists but was never registered, or a
    name no module imported at start-up defines. Looks only in modules already
    imported (a worker never imports a path read from settings or a row)."""
    module_name, _, attribute = path.rpartition(".")
    module = sys.modules.get(module_name)
    target = getattr(module, attribute, None) if module is not None else None
    if callable(target):
        return (
            f"{path} is a function, but not a task: decorate it with @task, or, for a "
            f"function you cannot change, call task({attribute}) on it in one of your "
            f"tasks modules (docs/howto/periodic-schedules.md)"
        )
    if module is not None:
        return f"the module {module_name} has no {attribute!r}"
    return (
        f"no module imported at start-up is named {module_name!r}: tasks are found in "
        f"installed apps' tasks modules and SKIPQUEUE['TASK_MODULES']"
    )


def sync(schedules: Mapping[str, Cron], *, database: str) -> None:
    """Make the schedule table match the code: insert new schedules, update changed
    definitions, delete the rows of schedules the code no longer has.

    One transaction. A changed expression or time zone starts from now (the old
    definition's missed occurrences are not run). An operator's pause is kept, across a
    change of definition and across a removal: the row of a paused schedule the code no
    longer has stays (shown as removed from the code) until it is resumed, so a worker of
    an older release that still defines it, started later, finds it paused rather than
    re-creating it active. The row's definition is the one the last worker to start
    synced; `tick()` fires from it.
    """
    rows = Schedule.objects.using(database)
    zone = default_zone()
    with bounded(database):
        existing = {row.name: row for row in rows.select_for_update()}
        fresh = []
        for name, cron in schedules.items():
            values = _definition(cron, zone)
            row = existing.get(name)
            if row is None:
                fresh.append(Schedule(name=name, **values))
                continue
            changed = {key: value for key, value in values.items() if getattr(row, key) != value}
            if not changed:
                continue
            if "expression" in changed or "timezone" in changed:
                changed["last_occurrence_at"] = Greatest(
                    Coalesce(F("last_occurrence_at"), Now()), Now()
                )
            rows.filter(name=name).update(**changed, synced_at=Now())
            logger.info("schedule changed name=%s fields=%s", name, ",".join(sorted(changed)))
        rows.bulk_create(fresh, ignore_conflicts=True)  # another worker may sync at once
        gone = sorted(set(existing) - set(schedules))
        kept = [name for name in gone if existing[name].paused_at is not None]
        deleted = [name for name in gone if name not in kept]
        if deleted:
            rows.filter(name__in=deleted, paused_at__isnull=True).delete()
            logger.info("schedules removed from the code deleted names=%s", ",".join(deleted))
        if kept:
            logger.info(
                "schedules removed from the code kept while paused names=%s", ",".join(kept)
            )


def _definition(cron: Cron, default_zone: str) -> dict[str, Any]:
    task = registry.get(cron.task or "")
    return {
        "task": cron.task,
        "expression": cron.expression,
        "timezone": cron.timezone or default_zone,
        "args": list(cron.args),
        "kwargs": dict(cron.kwargs or {}),
        "queue_name": cron.queue_name or task.queue_name,
        "priority": cron.priority if cron.priority is not None else task.priority,
        "missed": cron.missed,
        "catch_up": cron.catch_up,
        "grace": float(cron.grace),
    }


@dataclass(frozen=True)
class TickResult:
    """What one pass did, and the database-clock seconds until the next occurrence."""

    enqueued: int = 0
    missed: int = 0  # schedules that had missed occurrences (their policy applied)
    next_in: float | None = None


def due_occurrences(
    cron: Cron, row_after: datetime, now: datetime, zone: Any
) -> tuple[list[datetime], datetime | None, bool]:
    """(occurrences to enqueue, the new last occurrence, whether any were missed) for a
    schedule last advanced to `row_after`, at database time `now`.

    On time (within `grace` of now): each enqueued. Older (missed): `latest` enqueues
    the most recent once when nothing is on time, `skip` none, `catch_up` the most
    recent `catch_up`.
    """
    grace = timedelta(seconds=cron.grace)
    on_time = cron.occurrences(
        max(row_after, now - grace), now, zone, limit=MAX_OCCURRENCES_PER_PASS
    )
    late_until = now - grace
    missed: list[datetime] = []
    if row_after < late_until:
        wanted = {"latest": 0 if on_time else 1, "skip": 0, "catch_up": cron.catch_up}
        count = wanted[cron.missed]
        missed = cron.latest(late_until, row_after, zone, count) if count else []
        any_missed = bool(missed) or bool(cron.latest(late_until, row_after, zone, 1))
    else:
        any_missed = False
    fire = missed + on_time
    if on_time:
        last: datetime | None = on_time[-1]
    else:
        latest = cron.latest(now, row_after, zone, 1)
        last = latest[-1] if latest else None
    return fire, last, any_missed


def tick(schedules: Mapping[str, Cron], *, database: str) -> TickResult:
    """Enqueue the due occurrences of `schedules`, on the database clock.

    First one read of the active (not paused) schedule rows, without locks, to find
    those with an occurrence due. Then each of those in a short transaction of its own
    (`bounded`): its row locked FOR NO KEY UPDATE SKIP LOCKED (a row another worker is
    ticking is left to it), one job inserted per due occurrence (ON CONFLICT DO NOTHING
    on the occurrence constraint), and its `last_occurrence_at` moved forward. So one
    worker frozen inside a tick holds back one schedule, for the few seconds until the
    server ends its transaction, never the others; and a schedule whose tick fails is
    logged and skipped while the others fire. A schedule without a row (not synced
    yet, or removed from the code by a newer worker) does not fire.
    """
    if not schedules:
        return TickResult()
    zone_default = default_zone()
    enqueued = missed_count = 0
    found = _active_rows(list(schedules), database)
    now = found[0]["now"] if found else _database_now(database)
    effective: dict[str, Cron] = {}
    for row in found:
        name = row["name"]
        try:
            cron = as_in_row(schedules[name], row, zone_default)
            if cron is None:
                continue
            effective[name] = cron
            zone = cron.zone(zone_default)
            last_at = row["last_occurrence_at"]
            fire, last, _ = due_occurrences(cron, last_at or row["created_at"], now, zone)
            if not fire and (last is None or last == last_at):
                continue  # nothing new since the row's last occurrence
            fired, missed = _tick_one(schedules[name], database, zone_default)
        except Exception as error:
            if is_transient(error):
                raise
            logger.exception("schedule failed name=%s; the other schedules go on", name)
            continue
        enqueued += fired
        missed_count += missed
    return TickResult(
        enqueued=enqueued, missed=missed_count, next_in=_next_in(effective or schedules, now)
    )


#: Schedules rebuilt from a row whose definition differs from the worker's own, by row.
_FROM_ROWS: dict[tuple[str, str], Cron] = {}


def as_in_row(cron: Cron, row: Mapping[str, Any], zone_default: str) -> Cron | None:
    """`cron` as its row defines it (the definition the last worker to start synced), so
    that workers of two releases fire the same occurrences; `cron` itself when they
    agree. None, logged, when the row runs a task this worker does not have."""
    values = {field: row[field] for field in DEFINITION_FIELDS}
    if values == _definition(cron, zone_default):
        return cron
    key = (cron.name or "", json.dumps(values, sort_keys=True, default=str))
    if key not in _FROM_ROWS:
        if values["task"] not in registry:
            logger.warning(
                "schedule skipped name=%s: its row (synced by another release) runs %s, "
                "which this worker does not have",
                cron.name,
                values["task"],
            )
            return None
        if len(_FROM_ROWS) > 1000:
            _FROM_ROWS.clear()
        _FROM_ROWS[key] = replace(
            cron,
            task=values["task"],
            expression=values["expression"],
            timezone=values["timezone"],
            args=tuple(values["args"]),
            kwargs=dict(values["kwargs"]),
            queue_name=values["queue_name"],
            priority=values["priority"],
            missed=values["missed"],
            catch_up=values["catch_up"],
            grace=values["grace"],
        )
    return _FROM_ROWS[key]


def _active_rows(names: list[str], database: str) -> list[dict[str, Any]]:
    """name, last_occurrence_at, created_at, now and the definition of the active
    schedule rows among `names`; if one row cannot be loaded (a timestamp another
    client wrote that Python cannot hold), each alone, and the ones that fail are
    logged and left out."""
    rows = Schedule.objects.using(database).active()
    fields = ("name", "last_occurrence_at", "created_at", "now", *DEFINITION_FIELDS)
    try:
        return list(rows.filter(name__in=names).annotate(now=Now()).values(*fields))
    except DatabaseError as error:
        if is_transient(error):
            raise
    found: list[dict[str, Any]] = []
    for name in names:
        try:
            found.extend(rows.filter(name=name).annotate(now=Now()).values(*fields))
        except DatabaseError as error:
            if is_transient(error):
                raise
            logger.error("schedule failed name=%s: its row cannot be read: %s", name, error)
    return found


def _tick_one(defined: Cron, database: str, zone_default: str) -> tuple[int, int]:
    """One schedule's due occurrences, in a transaction of its own: (jobs, missed 0/1),
    from the definition of its row as locked."""
    rows = Schedule.objects.using(database)
    with bounded(database):
        locked = (
            rows.filter(name=defined.name)
            .active()
            .select_for_update(skip_locked=True, no_key=True)
            .annotate(now=Now())
            .values("last_occurrence_at", "created_at", "now", *DEFINITION_FIELDS)
            .first()
        )
        if locked is None:
            return 0, 0  # paused meanwhile, gone, or another worker is ticking it
        cron = as_in_row(defined, locked, zone_default)
        if cron is None:
            return 0, 0
        zone = cron.zone(zone_default)
        last_at, now = locked["last_occurrence_at"], locked["now"]
        fire, last, missed = due_occurrences(cron, last_at or locked["created_at"], now, zone)
        if last is None:
            return 0, 0
        inserted = _enqueue(cron, fire, database) if fire else 0
        rows.filter(name=cron.name).update(
            last_occurrence_at=Greatest(Coalesce(F("last_occurrence_at"), last), last)
        )
    if missed:
        logger.warning(
            "schedule missed occurrences name=%s policy=%s enqueued=%d",
            cron.name,
            cron.missed,
            inserted,
        )
    if inserted:
        logger.debug("schedule ticked name=%s occurrences=%d", cron.name, inserted)
    return inserted, int(missed)


#: The most occurrences one backfill enqueues (a range over it is refused: split it).
MAX_BACKFILL_OCCURRENCES = 10_000


@dataclass(frozen=True)
class Backfill:
    """What `backfill` found in its range and how many of them it enqueued (the others
    were enqueued already: a tick's, or an earlier backfill's)."""

    occurrences: list[datetime]
    enqueued: int


def backfill(
    name: str,
    start: datetime,
    end: datetime,
    *,
    database: str,
    dry_run: bool = False,
    schedules: Mapping[str, Cron] | None = None,
) -> Backfill:
    """Enqueue the schedule `name`'s occurrences in (start, end], each once: an
    occurrence enqueued before (by a tick or an earlier backfill) is skipped by the
    occurrence constraint, as a tick's own is. Each job runs as the schedule's would,
    its `scheduled_for` the occurrence. `end` may not pass the database's now (the
    ticks own what is to come), and at most MAX_BACKFILL_OCCURRENCES at once. The
    schedule's own progress (`last_occurrence_at`) is left as it is. ValueError, in
    words, for an unknown schedule or a range refused. `schedules`: the code's
    (`defined_schedules()`) unless given."""
    defined = defined_schedules() if schedules is None else schedules
    cron = defined.get(name)
    if cron is None:
        known = ", ".join(sorted(defined)) or "none"
        raise ValueError(f"no schedule named {name!r} in the code (schedules: {known})")
    # In UTC: the occurrences are counted in the schedule's zone from UTC instants (a
    # range given in the project's zone was shifted by its offset a second time).
    start, end = start.astimezone(timezone.utc), end.astimezone(timezone.utc)
    if end <= start:
        raise ValueError(f"the range is empty: {end.isoformat()} is not after {start.isoformat()}")
    now = _database_now(database)
    if end > now:
        raise ValueError(
            f"the range ends at {end.isoformat()}, after the database's now "
            f"({now.isoformat()}): a backfill runs past occurrences only"
        )
    zone = cron.zone(default_zone())
    try:
        found = cron.occurrences(start, end, zone, limit=MAX_BACKFILL_OCCURRENCES + 1)
    except (OverflowError, ValueError) as error:  # a range at the calendar's ends
        raise ValueError(f"the range cannot be counted in {zone}: {error}") from error
    if len(found) > MAX_BACKFILL_OCCURRENCES:
        raise ValueError(
            f"the range holds more than {MAX_BACKFILL_OCCURRENCES} occurrences of "
            f"{name!r}: backfill it in parts"
        )
    if dry_run or not found:
        return Backfill(found, 0)
    with transaction.atomic(using=database):
        enqueued = _enqueue(cron, found, database, expires_from=now)
    logger.info(
        "schedule backfilled name=%s occurrences=%d enqueued=%d", name, len(found), enqueued
    )
    return Backfill(found, enqueued)


def _enqueue(
    cron: Cron, instants: list[datetime], database: str, expires_from: datetime | None = None
) -> int:
    """The occurrences at `instants`, through the queue layer's verb, from the task's spec
    with the schedule's queue and priority: how many rows were really inserted."""
    task = registry.get(cron.task or "")
    if cron.queue_name or cron.priority is not None or cron.expires is not None:
        task = task.using(queue_name=cron.queue_name, priority=cron.priority, expires=cron.expires)
    jobs = Job.objects.db_manager(database)
    return jobs.enqueue_occurrences(
        task.spec(),
        cron.args,
        cron.kwargs or {},
        schedule=cron.name or "",
        instants=instants,
        expires_from=expires_from,
    )


def _database_now(database: str) -> datetime:
    with connections[database].cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        value: datetime = cursor.fetchone()[0]
        return value


def _next_in(schedules: Mapping[str, Cron], now: datetime) -> float | None:
    """Seconds from the database's `now` to the soonest next occurrence."""
    zone_default = default_zone()
    soonest = None
    for cron in schedules.values():
        upcoming = cron.next_after(now, cron.zone(zone_default))
        if upcoming is not None and (soonest is None or upcoming < soonest):
            soonest = upcoming
    return None if soonest is None else (soonest - now).total_seconds()


class Scheduler:
    """A worker's scheduler thread: `run()` syncs once, then ticks until `halted` (a
    worker whose code has no schedule left syncs too, deleting the rows, then stops)."""

    def __init__(
        self, *, schedules: Mapping[str, Cron], database: str, halted: threading.Event
    ) -> None:
        self.schedules = dict(schedules)
        self.database = database
        self.halted = halted
        self.enqueued = 0

    def run(self) -> None:
        backoff = Backoff()
        synced = False
        try:
            while not self.halted.is_set():
                try:
                    if not synced:
                        sync(self.schedules, database=self.database)
                        synced = True
                        if not self.schedules:
                            return  # it only deleted the rows of schedules now gone
                    result = tick(self.schedules, database=self.database)
                    self.enqueued += result.enqueued
                    backoff.reset()
                    wait = MAX_WAIT if result.next_in is None else min(result.next_in, MAX_WAIT)
                    wait += 0.002  # past the occurrence, not just before it
                except Exception as error:  # noqa: BLE001  (this thread must not die)
                    wait = backoff.next()
                    if is_transient(error):
                        logger.warning("scheduler failed, retrying in %.2fs: %s", wait, error)
                    else:
                        logger.exception("scheduler failed, retrying in %.2fs", wait)
                    discard_connection(self.database)
                self.halted.wait(max(wait, 0.002))
        finally:
            connections.close_all()


@dataclass(frozen=True)
class ScheduleStatus:
    """One schedule as an operator sees it: its definition, state and next occurrence."""

    name: str
    task: str
    expression: str
    timezone: str
    state: str  # active, paused, not synced (no worker started since), removed from code
    last_occurrence_at: datetime | None
    next_occurrence_at: datetime | None
    paused_by: str = ""
    #: The next runs in words (`Cron.describe_upcoming`), "" while it does not run.
    next_runs: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "task": self.task,
            "cron": self.expression,
            "timezone": self.timezone,
            "state": self.state,
            "last_occurrence_at": _iso(self.last_occurrence_at),
            "next_occurrence_at": _iso(self.next_occurrence_at),
            "paused_by": self.paused_by,
            "next_runs": self.next_runs,
        }


def schedule_statuses(
    database: str, schedules: Mapping[str, Cron] | None = None
) -> list[ScheduleStatus]:
    """The schedules of the code and of the table, by name, with their next occurrence
    after the database's now (none while paused, or for a row the code no longer has)."""
    defined = defined_schedules() if schedules is None else schedules
    rows = {row.name: row for row in Schedule.objects.using(database)}
    now = _database_now(database)
    zone_default = default_zone()
    found = []
    for name in sorted(set(defined) | set(rows)):
        cron, row = defined.get(name), rows.get(name)
        if cron is None:
            assert row is not None  # noqa: S101
            found.append(
                ScheduleStatus(
                    name,
                    row.task,
                    row.expression,
                    row.timezone,
                    "removed from code",
                    row.last_occurrence_at,
                    None,
                )
            )
            continue
        state = "not synced" if row is None else "paused" if row.is_paused else "active"
        zone = cron.zone(zone_default)
        found.append(
            ScheduleStatus(
                name=name,
                task=cron.task or "",
                expression=cron.expression,
                timezone=cron.timezone or zone_default,
                state=state,
                last_occurrence_at=row.last_occurrence_at if row is not None else None,
                next_occurrence_at=None if state == "paused" else cron.next_after(now, zone),
                paused_by=row.paused_by if row is not None else "",
                next_runs="" if state == "paused" else cron.describe_upcoming(now, zone),
            )
        )
    return found


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
