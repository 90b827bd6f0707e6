"""A worker's counters, and the periodic line that tells an operator what ran.

Per-job lines (started, succeeded, retrying, released) are DEBUG: at full speed, two
INFO lines a job cost about a third of a worker's CPU. At INFO an operator sees a
`worker progress` line every PROGRESS_SECONDS with what ran since the last one (only
when something did), and every failure one by one (the executor logs those at ERROR).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from django_skipqueue.runtime.executor import Outcome

logger = logging.getLogger("django_skipqueue.runtime.worker")


@dataclass
class WorkerStats:
    """Counters since start. Read them for progress; they decide nothing."""

    claimed: int = 0
    finished: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    acked_batches: int = 0
    renewed: int = 0
    renew_refused: int = 0
    released_on_shutdown: int = 0
    reaped: int = 0
    expired: int = 0  # ended by this worker's reaper: not started by their expires_at
    timed_out: int = 0
    thread_restarts: int = 0
    started: float = field(default_factory=time.monotonic)

    def count(self, outcome: Outcome) -> int:
        return self.outcomes.get(outcome.value, 0)

    def counts(self) -> dict[str, int]:
        """Every count an operator reads, by name, in the order they are shown."""
        counts = {"claimed": self.claimed}
        counts |= {outcome.value: self.count(outcome) for outcome in Outcome}
        counts |= {"timed_out": self.timed_out, "released_on_stop": self.released_on_shutdown}
        counts["expired"] = self.expired  # ended by this worker's reaper before they started
        return counts

    def summary(self) -> str:
        """The counts in `key=value` form (the worker's closing line)."""
        return " ".join(f"{key}={value}" for key, value in self.counts().items())


class ProgressLog:
    """Writes `worker progress` at INFO every `interval` seconds in which something ran:
    the counts since the previous line, and the rate of finished jobs."""

    def __init__(self, stats: WorkerStats, interval: float, *, now: float | None = None) -> None:
        self.stats = stats
        self.interval = interval
        self.last_at = time.monotonic() if now is None else now
        self.last = stats.counts()
        self.last_finished = stats.finished

    @property
    def next_at(self) -> float:
        return self.last_at + self.interval

    def emit(self, now: float) -> str | None:
        """Log the line if anything ran since the last one; returns it (None: quiet)."""
        current = self.stats.counts()
        delta = {key: value - self.last.get(key, 0) for key, value in current.items()}
        finished = self.stats.finished - self.last_finished
        elapsed = max(now - self.last_at, 1e-9)
        self.last, self.last_finished, self.last_at = current, self.stats.finished, now
        if not any(delta.values()):
            return None
        shown = " ".join(f"{key}={value}" for key, value in delta.items() if value)
        line = f"worker progress last={elapsed:.0f}s {shown} rate={finished / elapsed:.1f}/s"
        logger.info(line)
        return line
