"""What a worker counts of the jobs it runs: per queue, for the admin's charts (the
QueueMinute rows), per task, for the task overview (the TaskMinute rows), and, when
`runworker --metrics-port` asked for them, for Prometheus.

The executor threads and the dispatcher call `picked_up` and `finished` (an append to
a deque: 0.2 microseconds a job); the housekeeper calls `flush` every
FLUSH_SECONDS, which adds the counts since the last flush to the database's current
minute in one transaction (`QueueMinuteManager.add`, `TaskMinuteManager.add`). Counts
a failed flush could not write are kept for the next one. The deque is folded into
counts whenever it holds FOLD_AT events, so that what a worker keeps between flushes
does not grow with its speed (`python benchmarks/run.py --parts memory` measures what
a worker holds). Nothing here imports prometheus_client: the series are
`runtime.prometheus`'s, attached only when asked for.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from django.db import DatabaseError

from django_skipqueue.models import (
    DURATION_BUCKETS,
    LAST_ERROR_MAX_CHARS,
    PICKUP_BUCKETS,
    QueueMinute,
    TaskMinute,
)
from django_skipqueue.queue.connections import bounded
from django_skipqueue.runtime.runner import Outcome

if TYPE_CHECKING:
    from django_skipqueue.queue.base import ErrorInfo


class Series(Protocol):
    """Where a Meter also counts (runtime.prometheus.PrometheusSeries)."""

    def finished(self, queue: str, task: str, outcome: str, duration: float) -> None: ...
    def picked_up(self, queue: str, seconds: float) -> None: ...
    def lease_expired(self, queue: str, count: int) -> None: ...
    def prime(self, queues: Sequence[str], tasks: Mapping[str, str]) -> None: ...


logger = logging.getLogger(__name__)

#: How often a worker adds its counts to the QueueMinute rows (seconds).
FLUSH_SECONDS = 5.0

#: The events the deque holds at most before the thread that appends one folds them
#: into counts. Unfolded, a worker draining 14,000 jobs a second held 140,000 of them
#: (about 12 MB) by each flush, and the cycle collector walked them in every full
#: collection.
FOLD_AT = 2048


#: The outcomes whose error is the task's (a cancel's, a lost write's are not).
_FAILURES = (Outcome.RETRYING, Outcome.FAILED)


def _empty() -> dict[str, Any]:
    return {"pickup_buckets": [0] * len(PICKUP_BUCKETS)}


def _empty_task() -> dict[str, Any]:
    return {"run_buckets": [0] * len(DURATION_BUCKETS)}


#: What a TaskMinute row holds that a QueueMinute row does not.
_TASK_ONLY = frozenset({"run_buckets", "last_error"})


def _add(into: dict[str, dict[str, Any]], name: str, counts: Any, empty: Any) -> None:
    """Add one key's `counts` to `into[name]`: numbers add up, histograms bucket by
    bucket; a last error replaces the one there (the caller adds the newer last)."""
    mine = into.get(name)
    if mine is None:
        into[name] = mine = empty()
    for key, value in counts.items():
        if key in ("pickup_buckets", "run_buckets"):
            mine[key] = [a + b for a, b in zip(mine[key], value, strict=True)]
        elif key == "last_error":
            mine[key] = value
        elif key != "oldest_due_seconds":
            mine[key] = mine.get(key, 0) + value


def _merge(older: Counts, newer: Counts) -> None:
    """Add `newer` into `older` (in place)."""
    for name, counts in newer.queues.items():
        _add(older.queues, name, counts, _empty)
    for name, counts in newer.tasks.items():
        _add(older.tasks, name, counts, _empty_task)


@dataclass
class Counts:
    """What a worker counted since its last flush: per queue (the QueueMinute columns)
    and per task (the TaskMinute columns; `last_error` a pair: job id, text)."""

    queues: dict[str, dict[str, Any]] = field(default_factory=dict)
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.queues or self.tasks)


class Meter:
    """A worker's counts since its last flush, per queue and per task. Safe to call from
    any thread.

    The executor threads only append to a deque (atomic, no lock: 0.2 us a job where a
    lock and the dict updates cost 1 us, measured); the events are added up under the
    lock by `take()`, from the housekeeper's thread every FLUSH_SECONDS, and by the
    thread whose append brings the deque to FOLD_AT."""

    def __init__(self, prometheus: Series | None = None) -> None:
        # (queue, None, pickup seconds, None, None) or (queue, outcome, run seconds,
        # task, (job id, error) or None)
        self._events: deque[tuple[str, Any, float, Any, Any]] = deque()
        self._lock = threading.Lock()  # folds, take() and put_back()
        # Counts not yet flushed: events folded early (pickups per queue; ended attempts
        # per queue and task), and what a failed flush put back.
        self._pickups: dict[str, dict[str, Any]] = {}
        self._runs: dict[tuple[str, str], dict[str, Any]] = {}
        self._kept = Counts()
        self.prometheus = prometheus

    def picked_up(self, queue: str, seconds: float) -> None:
        """A job started `seconds` after it was due (a claim's started_at - run_at)."""
        self._events.append((queue, None, seconds, None, None))
        if len(self._events) >= FOLD_AT:
            self._fold()
        if self.prometheus is not None:
            self.prometheus.picked_up(queue, max(seconds, 0.0))

    def finished(
        self,
        queue: str,
        task: str,
        outcome: Outcome,
        duration: float,
        error: ErrorInfo | None = None,
        job_id: int | None = None,
    ) -> None:
        """An attempt ended with `outcome` after running `duration` seconds; `error`,
        if it failed, and its job's id become the task's last error."""
        failure = (job_id, error) if error is not None and outcome in _FAILURES else None
        self._events.append((queue, outcome, duration, task, failure))
        if len(self._events) >= FOLD_AT:
            self._fold()
        if self.prometheus is not None:
            self.prometheus.finished(queue, task, outcome.value, duration)

    def prime(self, queues: Sequence[str], tasks: Mapping[str, str]) -> None:
        """Every series this worker may count, made at 0 now (`tasks`: name -> queue):
        a counter that appears only at its first increment leaves an alert on its rate
        without data until then."""
        if self.prometheus is not None:
            self.prometheus.prime(queues, tasks)

    def leases_expired(self, by_queue: Mapping[str, int]) -> None:
        """The reaper of this process took back these expired leases, per queue."""
        if self.prometheus is not None:
            for queue, count in by_queue.items():
                self.prometheus.lease_expired(queue, count)

    def take(self) -> Counts:
        """The counts since the last take (and any put back), emptied."""
        with self._lock:
            self._fold_locked()
            pickups, runs, kept = self._pickups, self._runs, self._kept
            self._pickups, self._runs, self._kept = {}, {}, Counts()
        fresh = Counts(queues=pickups)
        for (queue, task), counts in runs.items():
            mine = fresh.queues.get(queue) or fresh.queues.setdefault(queue, _empty())
            for column, value in counts.items():
                if column not in _TASK_ONLY:
                    mine[column] = mine.get(column, 0) + value
            _add(fresh.tasks, task, counts, _empty_task)
        _merge(kept, fresh)  # what a failed flush put back is the older
        return kept

    def _fold(self) -> None:
        with self._lock:
            self._fold_locked()

    def _fold_locked(self) -> None:
        """Add the events queued so far to the counts (the lock held): pickups per queue,
        ended attempts per queue and task (what `take` adds up per queue and per task:
        one dict a job, where one per queue and one per task took 0.7 us more a job).
        Those appended meanwhile stay queued for the next fold."""
        pickups, runs = self._pickups, self._runs
        events = self._events
        for _ in range(len(events)):
            queue, outcome, seconds, task, failure = events.popleft()
            if outcome is None:
                counts = pickups.get(queue) or pickups.setdefault(queue, _empty())
                seconds = max(seconds, 0.0)
                counts["pickups"] = counts.get("pickups", 0) + 1
                counts["pickup_seconds"] = counts.get("pickup_seconds", 0.0) + seconds
                counts["pickup_buckets"][bisect.bisect_left(PICKUP_BUCKETS, seconds)] += 1
                continue
            column = outcome.value  # the QueueMinute and TaskMinute column of that name
            key = (queue, task)
            mine = runs.get(key) or runs.setdefault(key, _empty_task())
            mine[column] = mine.get(column, 0) + 1
            mine["runs"] = mine.get("runs", 0) + 1
            mine["run_seconds"] = mine.get("run_seconds", 0.0) + seconds
            mine["run_buckets"][bisect.bisect_left(DURATION_BUCKETS, max(seconds, 0.0))] += 1
            if failure is not None:
                job_id, error = failure
                text = f"{error.type}: {error.message}"[:LAST_ERROR_MAX_CHARS]
                mine["last_error"] = (job_id, text)

    def put_back(self, counts: Counts) -> None:
        """Counts a flush could not write, added back for the next one (a last error
        folded since is newer, and wins)."""
        with self._lock:
            _merge(counts, self._kept)
            self._kept = counts

    def flush(self, database: str, lock_seconds: float | None = None) -> None:
        """Add the counts since the last flush to the current minute's rows, waiting at
        most `lock_seconds` for a lock (SKIPQUEUE['LOCK_TIMEOUT_SECONDS'] if None); kept
        for the next flush if the write fails."""
        counts = self.take()
        if not counts:
            return
        try:
            with bounded(database, lock_seconds=lock_seconds):
                QueueMinute.objects.db_manager(database).add(counts.queues)
                TaskMinute.objects.db_manager(database).add(counts.tasks)
        except DatabaseError:
            self.put_back(counts)
            raise
