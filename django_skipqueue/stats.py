"""Queue and task overview numbers, for the admin's overview pages and `manage.py
queuestats`.

Every count is over a set a partial index serves (pending, running, finished by time),
or over the per-minute rows the workers write (QueueMinute, TaskMinute), never a
COUNT(*) of the whole table.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from django.db import connections
from django.db.models import Count, Q
from django.db.models.functions import Now

from django_skipqueue.conf import get_settings
from django_skipqueue.conf.limits import QueueLimit, queue_limits
from django_skipqueue.conf.relay import RelayConfig, relay_config
from django_skipqueue.core.states import JobState
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.models import (
    DURATION_BUCKETS,
    PICKUP_BUCKETS,
    Job,
    Queue,
    WorkerKind,
    WorkerProcess,
    queue_names_of,
)
from django_skipqueue.queue import sql


@dataclass
class QueueStats:
    queue: str
    pending_due: int = 0
    scheduled: int = 0
    #: Workflow jobs waiting on a parent (not due until it is done).
    waiting: int = 0
    #: Durable jobs parked until their time: on a sleep, or a wait for a signal (counted
    #: apart from `scheduled`).
    sleeping: int = 0
    awaiting_signal: int = 0
    running: int = 0
    stuck: int = 0
    failed: int = 0
    lag_seconds: float = 0.0  # age of the oldest due job
    done_5m: int = 0
    done_1h: int = 0
    live_workers: int = 0
    #: Of those, relays (`relayjobs`, `runworker --relay`): a relayed queue's due rows
    #: wait for one.
    live_relays: int = 0
    paused: bool = False  # an operator paused it: no worker claims from it
    limits: str = ""  # its SKIPQUEUE['QUEUE_LIMITS'], as words
    #: Relayed to RabbitMQ (SKIPQUEUE['RELAY']): pending_due is then the relay's backlog
    #: and lag_seconds its lag; the broker queue's ready messages and dead letters follow
    #: (None: the broker was not reachable).
    relayed: bool = False
    broker_ready: int | None = None
    broker_dead: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def queue_stats(
    database: str | None = None, *, broker: bool = True, finished: bool = True
) -> list[QueueStats]:
    """One row per queue that has jobs or live workers (or is relayed), sorted by name.
    `broker`: also ask RabbitMQ for the relayed queues' depths (a second at most).
    `finished`: count the jobs done in the last 5 minutes and hour from the job table
    (the finished index; the overview takes them from its per-minute rows instead)."""
    alias = database or get_settings().DATABASE_ALIAS
    jobs = Job.objects.using(alias)
    now = Now()
    stats: dict[str, QueueStats] = {}

    def row(name: str) -> QueueStats:
        return stats.setdefault(name, QueueStats(queue=name))

    for name, gauges in Job.objects.db_manager(alias).queue_gauges().items():
        entry = row(name)
        entry.pending_due, entry.scheduled = int(gauges["pending_due"]), int(gauges["scheduled"])
        entry.running, entry.stuck = int(gauges["running"]), int(gauges["stuck"])
        entry.waiting = int(gauges["waiting"])
        entry.sleeping = int(gauges["sleeping"])
        entry.awaiting_signal = int(gauges["awaiting_signal"])
        entry.lag_seconds = float(gauges["oldest_due_seconds"])
    done = (
        jobs.filter(
            state__in=[JobState.DONE, JobState.FAILED], finished_at__gte=now - timedelta(hours=1)
        )
        .values("queue_name")
        .annotate(
            done_1h=Count("id", filter=Q(state=JobState.DONE)),
            done_5m=Count(
                "id", filter=Q(state=JobState.DONE, finished_at__gte=now - timedelta(minutes=5))
            ),
        )
    )
    for item in done if finished else []:
        entry = row(item["queue_name"])
        entry.done_1h, entry.done_5m = item["done_1h"], item["done_5m"]
    for item in jobs.filter(state=JobState.FAILED).values("queue_name").annotate(n=Count("id")):
        row(item["queue_name"]).failed = item["n"]
    live = WorkerProcess.objects.using(alias).alive().values_list("queues", "kind")
    for queues, kind in live:
        for name in set(queue_names_of(queues)):  # another client's row may hold anything
            row(name).live_workers += 1
            row(name).live_relays += kind == WorkerKind.RELAY
    for name in Queue.objects.using(alias).paused().values_list("name", flat=True):
        row(name).paused = True
    try:
        limits = queue_limits()
    except ConfigurationError:  # reported by the system check skipqueue.E011
        limits = {}
    for name, limit in limits.items():
        row(name).limits = describe_limit(limit)
    try:
        relay = relay_config()
    except ConfigurationError:  # reported by the system check skipqueue.E012
        relay = RelayConfig()
    depths = {}
    if relay.enabled and broker:
        # Imported here (as checks.py does): the admin, which every process of a project
        # with django.contrib.admin imports at start-up, needs the broker layer only
        # where queues are relayed.
        from django_skipqueue.broker.topology import broker_depths

        depths = broker_depths(relay)
    for name in relay.queues:
        entry = row(name)
        entry.relayed = True
        entry.broker_ready, entry.broker_dead = depths.get(name, (None, None))
    return [stats[name] for name in sorted(stats)]


def describe_limit(limit: QueueLimit) -> str:
    """'3 at a time, 10/s': a queue's limits in the words of the overview."""
    parts = []
    if limit.concurrency is not None:
        parts.append(f"{limit.concurrency} at a time")
    if limit.rate is not None:
        unit = {1.0: "s", 60.0: "min", 3600.0: "h"}.get(limit.period, f"{limit.period:g}s")
        parts.append(f"{limit.rate}/{unit}")
    return ", ".join(parts)


#: The most running jobs `jobs_in_progress` lists.
IN_PROGRESS_SHOWN = 100


def jobs_in_progress(database: str | None = None) -> list[dict[str, Any]]:
    """Running jobs that reported progress (`context.set_progress`), the longest
    running first, at most IN_PROGRESS_SHOWN (running jobs only: a partial index)."""
    alias = database or get_settings().DATABASE_ALIAS
    running = (
        Job.objects.using(alias)
        .running()
        .filter(progress__isnull=False)
        .order_by("started_at")
        .only("id", "task", "queue_name", "attempts", "progress", "max_attempts")
    )
    shown = []
    for job in running[:IN_PROGRESS_SHOWN]:
        report = job.progress if isinstance(job.progress, dict) else {}
        shown.append(
            {
                "id": job.id,
                "task": job.task,
                "queue": job.queue_name,
                "attempt": job.attempts,
                **{key: report.get(key) for key in ("done", "total", "note", "at")},
                "summary": job.describe_progress(),
            }
        )
    return shown


# -- trends: the overview's charts, from the per-minute counts (QueueMinute) ------------

#: The overview's windows: how far back, and how many minutes a bar covers. The last
#: bar of "hour" is the overview's "done 5 min" window (this minute and the 4 before).
WINDOWS: dict[str, tuple[int, int]] = {"hour": (60, 5), "day": (24 * 60, 60)}


@dataclass
class Bucket:
    """What a queue's workers counted in one bar's minutes."""

    minutes_ago: int  # the bar's end, in minutes before the current one (0: now)
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    lost: int = 0
    pickups: int = 0
    pickup_buckets: list[int] | None = None
    oldest_due_seconds: float | None = None

    @property
    def failure_rate(self) -> float | None:
        """Failed attempts (retried or failed) over attempts ended, or None if none."""
        ended = self.succeeded + self.retried + self.failed
        return (self.retried + self.failed) / ended if ended else None

    def pickup_quantile(self, share: float) -> float | None:
        """The pickup delay under which `share` of the pickups fell: the upper bound
        of the histogram bucket where it is reached (the last finite bound for the
        open-ended one). None without pickups."""
        counts = self.pickup_buckets or []
        total = sum(counts)
        if not total:
            return None
        wanted, seen = share * total, 0
        for bound, count in zip(PICKUP_BUCKETS, counts, strict=False):
            seen += count
            if seen >= wanted:
                return bound if bound != float("inf") else PICKUP_BUCKETS[-2]
        return PICKUP_BUCKETS[-2]


def queue_trends(window: str = "hour", database: str | None = None) -> dict[str, list[Bucket]]:
    """Per queue, its bars over `window` ("hour" or "day"), oldest first: one query
    of the per-minute rows (the minute index), never the job table."""
    span, width = WINDOWS[window]
    alias = database or get_settings().DATABASE_ALIAS
    bars = span // width
    trends: dict[str, list[Bucket]] = {}
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT queue_name, "
            "floor(EXTRACT(EPOCH FROM date_trunc('minute', now()) - minute) / 60 / %s)::int, "
            "succeeded, retried, failed, cancelled, lost, pickups, pickup_buckets, "
            "oldest_due_seconds FROM skipqueue_queueminute "
            "WHERE minute > date_trunc('minute', now()) - make_interval(mins => %s) "
            "AND minute <= now()",
            [width, span],
        )
        rows = cursor.fetchall()
    for name, index, *counts in rows:
        if not 0 <= index < bars:
            continue
        series = trends.get(name)
        if series is None:
            series = trends[name] = [Bucket(minutes_ago=i * width) for i in range(bars)][::-1]
        bucket = series[bars - 1 - index]
        succeeded, retried, failed, cancelled, lost, pickups, histogram, oldest = counts
        bucket.succeeded += succeeded
        bucket.retried += retried
        bucket.failed += failed
        bucket.cancelled += cancelled
        bucket.lost += lost
        bucket.pickups += pickups
        if isinstance(histogram, str):
            histogram = json.loads(histogram)
        if isinstance(histogram, list) and histogram:
            mine = bucket.pickup_buckets or [0] * len(PICKUP_BUCKETS)
            for i, count in enumerate(histogram[: len(mine)]):
                mine[i] += int(count)
            bucket.pickup_buckets = mine
        if oldest is not None:
            bucket.oldest_due_seconds = max(bucket.oldest_due_seconds or 0.0, float(oldest))
    return dict(sorted(trends.items()))


# -- tasks: the task overview, from the per-minute counts (TaskMinute) ---------------------

#: The task overview's windows, in minutes: the last hour and the last day.
TASK_WINDOWS = {"hour": 60, "day": 24 * 60}


@dataclass
class TaskWindow:
    """What a task's attempts did in one window, as its workers counted them."""

    runs: int = 0  # attempts ended, whatever their outcome
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    cancelled: int = 0
    run_seconds: float = 0.0
    buckets: list[int] | None = None  # the run durations' histogram (DURATION_BUCKETS)

    def add(self, other: TaskWindow) -> None:
        self.runs += other.runs
        self.succeeded += other.succeeded
        self.retried += other.retried
        self.failed += other.failed
        self.cancelled += other.cancelled
        self.run_seconds += other.run_seconds
        mine = self.buckets or [0] * len(DURATION_BUCKETS)
        for i, count in enumerate((other.buckets or [])[: len(mine)]):
            mine[i] += count
        self.buckets = mine

    @property
    def failure_rate(self) -> float | None:
        """Failed attempts (retried or failed) over attempts ended, or None if none."""
        return (self.retried + self.failed) / self.runs if self.runs else None

    def duration(self, share: float) -> float | None:
        """The run time under which `share` of the attempts ended, estimated from the
        histogram as Prometheus' histogram_quantile does: linearly within the bucket
        where it is reached (the open-ended bucket answers its lower bound). None
        without runs."""
        counts = self.buckets or []
        total = sum(counts)
        if not total:
            return None
        wanted, seen, lower = share * total, 0, 0.0
        for bound, count in zip(DURATION_BUCKETS, counts, strict=False):
            if count and seen + count >= wanted:
                if bound == float("inf"):
                    return lower
                return lower + (bound - lower) * (wanted - seen) / count
            seen += count
            lower = bound
        return lower


@dataclass
class TaskStats:
    """One task's numbers over the last hour and the last day, and its newest error."""

    task: str
    hour: TaskWindow
    day: TaskWindow
    last_error: str = ""
    last_error_job: int | None = None
    last_error_age: timedelta | None = None


def task_stats(database: str | None = None) -> list[TaskStats]:
    """Per task that ended an attempt in the last day, its hour and its day, by name:
    two queries of the per-minute rows (the minute index), never the job table."""
    alias = database or get_settings().DATABASE_ALIAS
    windows = {"hour": TASK_WINDOWS["hour"], "day": TASK_WINDOWS["day"]}
    stats: dict[str, TaskStats] = {}
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.task_windows_statement(len(DURATION_BUCKETS)), windows)
        for (
            name,
            recent,
            runs,
            succeeded,
            retried,
            failed,
            cancelled,
            seconds,
            *histogram,
        ) in cursor.fetchall():
            part = TaskWindow(
                int(runs),
                int(succeeded),
                int(retried),
                int(failed),
                int(cancelled),
                float(seconds),
                [int(n or 0) for n in histogram],  # NULL: rows of fewer buckets
            )
            entry = stats.get(name) or stats.setdefault(
                name, TaskStats(name, TaskWindow(), TaskWindow())
            )
            entry.day.add(part)
            if recent:
                entry.hour.add(part)
        cursor.execute(sql.TASK_LAST_ERRORS, windows)
        for name, text, job_id, age in cursor.fetchall():
            if name in stats:
                entry = stats[name]
                entry.last_error, entry.last_error_job, entry.last_error_age = text, job_id, age
    return [stats[name] for name in sorted(stats)]
