"""The queue protocol: filters on JobQuerySet, state changes on JobManager.

Every time comparison uses the database clock (`Now()`, STATEMENT_TIMESTAMP() on
PostgreSQL), never the worker's. Every write that finishes or extends an attempt is
fenced: it matches the job id, `state = 'running'`, the claimed attempt number and an
unexpired lease in its own WHERE, so a stale attempt changes nothing (0 rows).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import connections, models
from django.db.models import (
    F,
    Q,
    Value,
)
from django.db.models.functions import Coalesce, Greatest, Now

from django_skipqueue.core.states import (
    ACTOR_MAX_LENGTH,
    validate_queue_name,
)
from django_skipqueue.queue import sql
from django_skipqueue.queue.base import BUCKET_FULL_AFTER, dead_after, locked_row
from django_skipqueue.queue.connections import bounded

if TYPE_CHECKING:
    import uuid

    from django_skipqueue.models import (  # noqa: F401
        Job,
        Queue,
        QueueMinute,
        RateBucket,
        Schedule,
        TaskMinute,
        WorkerProcess,
    )

from django_skipqueue.queue.signals import SignalVerbs


class JobManager(SignalVerbs):
    """The protocol verbs. Each owns its transaction and says what its return means.

    Its verbs live in one module each, a class each, one on top of the other:
    `claim`, `limited`, `enqueue`, `relaying`, `outcomes`, `reap`, `operator`,
    `awaiting`, `signals`."""


class WorkerProcessQuerySet(models.QuerySet["WorkerProcess"]):
    def alive(self, within: timedelta | None = None) -> WorkerProcessQuerySet:
        """Workers whose heartbeat is newer than `within` (default: `dead_after()`), on the
        database clock."""
        return self.filter(heartbeat_at__gte=Now() - Value(within or dead_after()))

    def dead(self, after: timedelta) -> WorkerProcessQuerySet:
        return self.filter(heartbeat_at__lt=Now() - Value(after))


class WorkerProcessManager(models.Manager.from_queryset(WorkerProcessQuerySet)):  # type: ignore[misc]
    """The worker registry's verbs; each one statement."""

    def register(
        self, *, queues: Sequence[str], concurrency: int, kind: str = "worker"
    ) -> WorkerProcess:
        """The row of a worker starting in this process (hostname, pid, queues); `kind`
        is a WorkerKind: a claiming worker, a broker consumer or a relay."""
        return self.create(
            hostname=socket.gethostname()[:255],
            pid=os.getpid(),
            queues=list(queues),
            concurrency=concurrency,
            kind=kind,
        )

    def mark_stopped(self, worker_id: uuid.UUID) -> None:
        """A worker stopped cleanly: `stopped_at` says so, and its heartbeat is set as old
        as a dead one's, at once."""
        self.filter(id=worker_id).update(
            heartbeat_at=Now() - dead_after(), stopped_at=Now(), waiting_since=None
        )

    def set_waiting(self, worker_id: uuid.UUID, waiting: bool) -> None:
        """The worker waits for a NOTIFY of its queues from now (`waiting`), or no longer
        (runtime/waiting.py); a stopped worker's row is left as it is."""
        rows = self.filter(id=worker_id, stopped_at__isnull=True)
        if waiting:
            rows.filter(waiting_since__isnull=True).update(waiting_since=Now())
        else:
            rows.filter(waiting_since__isnull=False).update(waiting_since=None)

    def forget_waiting_of_dead(self) -> int:
        """Dead workers wait for nothing: their flags would keep every enqueue of their
        queues notifying (the reaper's pass). Returns how many were cleared."""
        waiting = self.filter(waiting_since__isnull=False)
        return waiting.dead(dead_after()).update(waiting_since=None)


class ScheduleQuerySet(models.QuerySet["Schedule"]):
    def active(self) -> ScheduleQuerySet:
        return self.filter(paused_at__isnull=True)

    def paused(self) -> ScheduleQuerySet:
        return self.filter(paused_at__isnull=False)


class ScheduleManager(models.Manager.from_queryset(ScheduleQuerySet)):  # type: ignore[misc]
    """An operator's verbs on schedules; the scheduler's are in scheduler.py."""

    def pause(self, names: Iterable[str] | str, *, by: str = "") -> int:
        """Stop enqueuing these schedules' occurrences until resumed; returns how many
        were running. Occurrences passed while paused are not run on resume."""
        return self.filter(name__in=_names(names), paused_at__isnull=True).update(
            paused_at=Now(), paused_by=by[:ACTOR_MAX_LENGTH]
        )

    def resume(self, names: Iterable[str] | str) -> int:
        """Start these paused schedules again from now: the occurrences passed while
        paused are skipped, whatever their `missed` policy. Returns how many resumed."""
        return self.filter(name__in=_names(names), paused_at__isnull=False).update(
            paused_at=None,
            paused_by="",
            last_occurrence_at=Greatest(Coalesce(F("last_occurrence_at"), Now()), Now()),
        )


class QueueQuerySet(models.QuerySet["Queue"]):
    def paused(self) -> QueueQuerySet:
        return self.filter(paused_at__isnull=False)


class QueueManager(models.Manager.from_queryset(QueueQuerySet)):  # type: ignore[misc]
    """Pausing queues, and the row lock of a limited queue's claims."""

    def pause(self, names: Iterable[str] | str, *, by: str = "") -> int:
        """No worker claims from these queues until resumed: each worker learns it from
        a NOTIFY at once, or within a second by polling. Jobs already running finish.
        Returns how many queues were running. Kept across restarts (it is a row)."""
        names = [validate_queue_name(name) for name in dict.fromkeys(_names(names))]
        with bounded(self.db):
            self.bulk_create([self.model(name=name) for name in names], ignore_conflicts=True)
            changed = self.filter(name__in=names, paused_at__isnull=True).update(
                paused_at=Now(), paused_by=by[:ACTOR_MAX_LENGTH]
            )
            _notify_control(self.db)
        return changed

    def resume(self, names: Iterable[str] | str) -> int:
        """Let workers claim from these queues again; returns how many were paused."""
        with bounded(self.db):
            changed = self.filter(name__in=_names(names), paused_at__isnull=False).update(
                paused_at=None, paused_by=""
            )
            _notify_control(self.db)
        return changed

    def paused_names(self, names: Iterable[str]) -> set[str]:
        """Which of these queues are paused (one query on the small queue table)."""
        return set(self.paused().filter(name__in=list(names)).values_list("name", flat=True))

    def locked(self, name: str) -> tuple[Queue, datetime] | None:
        """The queue's row, created if missing and locked (see `locked_row`)."""
        return locked_row(self, name)


class RateBucketManager(models.Manager["RateBucket"]):
    """The token buckets of tasks' rate limits (`@task(rate_limit=...)`)."""

    def locked(self, key: str) -> tuple[RateBucket, datetime] | None:
        """The bucket's row, created if missing and locked (see `locked_row`)."""
        return locked_row(self, key)

    def prune_full(self) -> int:
        """Delete the buckets no claim has touched for BUCKET_FULL_AFTER: each is full,
        as a missing one is. A claim that holds one meanwhile makes the DELETE wait (the
        caller bounds the wait), and the row it leaves, touched now, is kept."""
        idle = Q(refilled_at__lt=Now() - BUCKET_FULL_AFTER) | Q(refilled_at__isnull=True)
        return self.filter(idle).delete()[0]


def _names(names: Iterable[str] | str) -> list[str]:
    """The names a pause or resume was given: one name alone is that name, never its
    letters (`pause("emails")` paused queues "e", "m", "a", "i", "l" and "s")."""
    return [names] if isinstance(names, str) else list(names)


def _notify_control(alias: str) -> None:
    """Tell every listening worker to read the queue table again (sent at commit). The
    payload is empty, like every NOTIFY of ours: channels are visible to every user."""
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, '')", [sql.CONTROL_CHANNEL])


#: The counts of attempts ended that QueueMinute and TaskMinute rows add up alike
#: (models.Outcomes' columns).
TASK_MINUTE_COUNTS = (
    "succeeded",
    "retried",
    "released",
    "failed",
    "cancelled",
    "lost",
    "unknown",
    "runs",
    "run_seconds",
)
#: The counts a QueueMinute row adds up: those, and its pickups.
MINUTE_COUNTS = (*TASK_MINUTE_COUNTS, "pickups", "pickup_seconds")


_Minute = TypeVar("_Minute", bound=models.Model)


class MinuteManager(models.Manager[_Minute]):
    """Rows of per-minute counts (QueueMinute, TaskMinute), kept MINUTES_KEPT_HOURS."""

    #: The row's key column, its counts added up, its histogram, its upsert statement.
    key = ""
    counts: tuple[str, ...] = ()
    histogram = ""
    upsert = ""

    def add(self, rows: Mapping[str, Mapping[str, Any]]) -> None:
        """Add each key's counts to its row of the database's current minute: one upsert,
        keys in name order (two workers never wait on each other's rows in opposite
        orders). A count missing from a row adds 0; the histogram adds up bucket by
        bucket (`carried`: what else a row carries)."""
        if not rows:
            return
        records = []
        for name in sorted(rows):
            counts = rows[name]
            record: dict[str, Any] = {self.key: name}
            record |= {column: counts.get(column, 0) for column in self.counts}
            record[self.histogram] = list(counts.get(self.histogram) or [])
            records.append(record | self.carried(counts))
        with connections[self.db].cursor() as cursor:
            cursor.execute(self.upsert, [json.dumps(records)])

    def carried(self, counts: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def prune(self, older_than: timedelta) -> int:
        """Delete the minutes older than `older_than` (the minute index serves it)."""
        return self.filter(minute__lt=Now() - older_than).delete()[0]


class QueueMinuteManager(MinuteManager["QueueMinute"]):
    """The per-minute counts the admin's charts read (see models.QueueMinute)."""

    key, counts, histogram, upsert = "queue_name", MINUTE_COUNTS, "pickup_buckets", sql.ADD_MINUTE

    def carried(self, counts: Mapping[str, Any]) -> dict[str, Any]:
        """`oldest_due_seconds`, which the upsert keeps the largest of."""
        return {"oldest_due_seconds": counts.get("oldest_due_seconds")}

    def sampled_this_minute(self) -> bool:
        """Whether a reaper has written the oldest due jobs' ages this minute."""
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.MINUTE_SAMPLED)
            return bool(cursor.fetchone()[0])


class TaskMinuteManager(MinuteManager["TaskMinute"]):
    """The per-minute counts the task overview reads (see models.TaskMinute)."""

    key, counts, histogram, upsert = "task", TASK_MINUTE_COUNTS, "run_buckets", sql.ADD_TASK_MINUTE

    def carried(self, counts: Mapping[str, Any]) -> dict[str, Any]:
        """`last_error`, a pair (job id, text), which replaces the row's last error."""
        job_id, text = counts.get("last_error") or (None, "")
        return {"last_error_job": job_id, "last_error": text}
