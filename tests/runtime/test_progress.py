"""The worker's counters and its periodic progress line, without threads or a database."""

from __future__ import annotations

import logging

from django_skipqueue.runtime.executor import Outcome
from django_skipqueue.runtime.progress import ProgressLog, WorkerStats


def finish(stats: WorkerStats, outcome: Outcome, n: int = 1) -> None:
    stats.claimed += n
    stats.finished += n
    stats.outcomes[outcome.value] = stats.outcomes.get(outcome.value, 0) + n


def test_the_closing_summary_names_every_outcome():
    stats = WorkerStats()
    finish(stats, Outcome.SUCCEEDED, 3)
    finish(stats, Outcome.RETRYING)
    assert stats.summary() == (
        "claimed=4 succeeded=3 retried=1 failed=0 released=0 lost=0 unknown=0 cancelled=0 "
        "timed_out=0 "
        "released_on_stop=0 expired=0"
    )


def test_a_progress_line_says_what_ran_since_the_last_and_the_rate(caplog):
    stats = WorkerStats()
    progress = ProgressLog(stats, 10.0, now=100.0)
    assert progress.next_at == 110.0
    finish(stats, Outcome.SUCCEEDED, 40)
    finish(stats, Outcome.FAILED, 2)

    with caplog.at_level(logging.INFO, logger="django_skipqueue.runtime.worker"):
        line = progress.emit(110.0)

    assert line == "worker progress last=10s claimed=42 succeeded=40 failed=2 rate=4.2/s"
    assert caplog.records[0].levelno == logging.INFO and caplog.messages == [line]
    assert progress.next_at == 120.0
    finish(stats, Outcome.SUCCEEDED, 5)
    assert progress.emit(125.0) == "worker progress last=15s claimed=5 succeeded=5 rate=0.3/s"


def test_an_idle_worker_writes_no_progress_line(caplog):
    stats = WorkerStats()
    progress = ProgressLog(stats, 10.0, now=0.0)
    with caplog.at_level(logging.INFO, logger="django_skipqueue.runtime.worker"):
        assert progress.emit(10.0) is None
        assert progress.emit(20.0) is None
    assert caplog.messages == []
