"""What a worker counts of the jobs it runs: per queue, for the admin's charts (the
QueueMinute rows), and, when `runworker --metrics-port` asked for them, for Prometheus.

The executor threads and the dispatcher call `picked_up` and `finished` (a lock and a
few dict operations: about a microsecond a job); the housekeeper calls `flush` every
FLUSH_SECONDS, which adds the counts since the last flush to the database's current
minute in one upsert (`QueueMinuteManager.add`). Counts a failed flush could not
write are kept for the next one. Nothing here imports prometheus_client: the series
are `runtime.prometheus`'s, attached only when asked for.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Mapping
from typing import Any, Protocol

from django.db import DatabaseError

from django_skipqueue.models import PICKUP_BUCKETS, QueueMinute
from django_skipqueue.runtime.runner import OUTCOME_LABELS, Outcome


class Series(Protocol):
    """Where a Meter also counts (runtime.prometheus.PrometheusSeries)."""

    def finished(self, queue: str, task: str, outcome: str, duration: float) -> None: ...
    def picked_up(self, queue: str, seconds: float) -> None: ...
    def lease_expired(self, queue: str, count: int) -> None: ...


logger = logging.getLogger(__name__)

#: How often a worker adds its counts to the QueueMinute rows (seconds).
FLUSH_SECONDS = 5.0

#: The QueueMinute column that counts each label.
_COLUMNS = {"refused": "lost"}


def _empty() -> dict[str, Any]:
    return {"pickup_buckets": [0] * len(PICKUP_BUCKETS)}


class Meter:
    """A worker's counts since its last flush, per queue. Safe to call from any thread."""

    def __init__(self, prometheus: Series | None = None) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, dict[str, Any]] = {}
        self.prometheus = prometheus

    def picked_up(self, queue: str, seconds: float) -> None:
        """A job started `seconds` after it was due (a claim's started_at - run_at)."""
        seconds = max(seconds, 0.0)
        bucket = bisect.bisect_left(PICKUP_BUCKETS, seconds)
        with self._lock:
            counts = self._queues.get(queue) or self._queues.setdefault(queue, _empty())
            counts["pickups"] = counts.get("pickups", 0) + 1
            counts["pickup_seconds"] = counts.get("pickup_seconds", 0.0) + seconds
            counts["pickup_buckets"][bucket] += 1
        if self.prometheus is not None:
            self.prometheus.picked_up(queue, seconds)

    def finished(self, queue: str, task: str, outcome: Outcome, duration: float) -> None:
        """An attempt ended with `outcome` after running `duration` seconds."""
        label = OUTCOME_LABELS[outcome]
        column = _COLUMNS.get(label, label)
        with self._lock:
            counts = self._queues.get(queue) or self._queues.setdefault(queue, _empty())
            counts[column] = counts.get(column, 0) + 1
            counts["runs"] = counts.get("runs", 0) + 1
            counts["run_seconds"] = counts.get("run_seconds", 0.0) + duration
        if self.prometheus is not None:
            self.prometheus.finished(queue, task, label, duration)

    def leases_expired(self, by_queue: Mapping[str, int]) -> None:
        """The reaper of this process took back these expired leases, per queue."""
        if self.prometheus is not None:
            for queue, count in by_queue.items():
                self.prometheus.lease_expired(queue, count)

    def take(self) -> dict[str, dict[str, Any]]:
        """The counts since the last take, emptied."""
        with self._lock:
            taken, self._queues = self._queues, {}
        return taken

    def put_back(self, counts: Mapping[str, Mapping[str, Any]]) -> None:
        """Counts a flush could not write, added back for the next one."""
        with self._lock:
            for queue, values in counts.items():
                mine = self._queues.setdefault(queue, _empty())
                for key, value in values.items():
                    if key == "pickup_buckets":
                        mine[key] = [a + b for a, b in zip(mine[key], value, strict=True)]
                    elif key != "oldest_due_seconds":
                        mine[key] = mine.get(key, 0) + value

    def flush(self, database: str) -> None:
        """Add the counts since the last flush to the current minute's rows."""
        counts = self.take()
        if not counts:
            return
        try:
            QueueMinute.objects.db_manager(database).add(counts)
        except DatabaseError:
            self.put_back(counts)
            raise
