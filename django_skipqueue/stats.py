"""Queue overview numbers, for the admin's overview page and `manage.py queuestats`.

Every count is over a set a partial index serves (pending, running, finished by time),
never a COUNT(*) of the whole table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from django.db import connections
from django.db.models import Count, Q
from django.db.models.functions import Now

from django_skipqueue.broker.topology import broker_depths
from django_skipqueue.conf import get_settings
from django_skipqueue.conf.limits import QueueLimit, queue_limits
from django_skipqueue.conf.relay import RelayConfig, relay_config
from django_skipqueue.core.states import JobState
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.models import Job, Queue, WorkerProcess, queue_names_of


@dataclass
class QueueStats:
    queue: str
    pending_due: int = 0
    scheduled: int = 0
    #: Workflow jobs waiting on a parent (not due until it is done).
    waiting: int = 0
    running: int = 0
    stuck: int = 0
    failed: int = 0
    lag_seconds: float = 0.0  # age of the oldest due job
    done_5m: int = 0
    done_1h: int = 0
    live_workers: int = 0
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


def queue_stats(database: str | None = None, *, broker: bool = True) -> list[QueueStats]:
    """One row per queue that has jobs or live workers (or is relayed), sorted by name.
    `broker`: also ask RabbitMQ for the relayed queues' depths (a second at most)."""
    alias = database or get_settings().DATABASE_ALIAS
    jobs = Job.objects.using(alias)
    now = Now()
    stats: dict[str, QueueStats] = {}

    def row(name: str) -> QueueStats:
        return stats.setdefault(name, QueueStats(queue=name))

    active = (
        jobs.filter(state__in=[JobState.PENDING, JobState.RUNNING])
        .values("queue_name")
        .annotate(
            pending_due=Count("id", filter=Q(state=JobState.PENDING, run_at__lte=now)),
            scheduled=Count("id", filter=Q(state=JobState.PENDING, run_at__gt=now)),
            running=Count("id", filter=Q(state=JobState.RUNNING)),
            stuck=Count("id", filter=Q(state=JobState.RUNNING, leased_until__lt=now)),
        )
    )
    waiting = (  # the partial index skipqueue_job_waiting_idx: waiting jobs only
        jobs.filter(state=JobState.WAITING).values("queue_name").annotate(n=Count("id"))
    )
    for item in waiting:
        row(item["queue_name"]).waiting = item["n"]
    lags = _lag_seconds(alias)
    for item in active:
        entry = row(item["queue_name"])
        entry.pending_due, entry.scheduled = item["pending_due"], item["scheduled"]
        entry.running, entry.stuck = item["running"], item["stuck"]
        entry.lag_seconds = lags.get(item["queue_name"], 0.0)
    finished = (
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
    for item in finished:
        entry = row(item["queue_name"])
        entry.done_1h, entry.done_5m = item["done_1h"], item["done_5m"]
    for item in jobs.filter(state=JobState.FAILED).values("queue_name").annotate(n=Count("id")):
        row(item["queue_name"]).failed = item["n"]
    for queues in WorkerProcess.objects.using(alias).alive().values_list("queues", flat=True):
        for name in set(queue_names_of(queues)):  # another client's row may hold anything
            row(name).live_workers += 1
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
    depths = broker_depths(relay) if relay.enabled and broker else {}
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


def _lag_seconds(alias: str) -> dict[str, float]:
    """Per queue, seconds since the oldest due job became due (database clock)."""
    with connections[alias].cursor() as cursor:
        cursor.execute(
            # Clamped as the models' timestamps are: '-infinity' written by another
            # client would fail the subtraction (and the overview with it).
            "SELECT queue_name, EXTRACT(EPOCH FROM now() - GREATEST(min(run_at), "
            "'0001-01-02 00:00:00+00'::timestamptz)) FROM skipqueue_job "
            "WHERE state = 'pending' AND run_at <= now() GROUP BY queue_name"
        )
        return {name: float(seconds) for name, seconds in cursor.fetchall()}


def throughput_last_hour(database: str | None = None) -> list[tuple[int, int]]:
    """(minutes ago, jobs done) for each 5-minute bucket of the last hour, oldest first."""
    alias = database or get_settings().DATABASE_ALIAS
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT floor(EXTRACT(EPOCH FROM now() - finished_at) / 300)::int, count(*) "
            "FROM skipqueue_job WHERE state = 'done' "
            "AND finished_at >= now() - interval '1 hour' GROUP BY 1"
        )
        counts = dict(cursor.fetchall())
    return [((bucket + 1) * 5, counts.get(bucket, 0)) for bucket in range(11, -1, -1)]


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
