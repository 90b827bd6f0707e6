"""A worker's counts between flushes (runtime/meter.py): bounded, and none lost, per
queue and per task."""

from __future__ import annotations

import threading

import pytest

from django_skipqueue.models import (
    DURATION_BUCKETS,
    LAST_ERROR_MAX_CHARS,
    PICKUP_BUCKETS,
    QueueMinute,
    TaskMinute,
)
from django_skipqueue.queue.base import ErrorInfo
from django_skipqueue.runtime.meter import FOLD_AT, Counts, Meter
from django_skipqueue.runtime.runner import Outcome


def test_the_events_kept_between_flushes_do_not_grow_with_the_jobs_run():
    meter = Meter()
    for _ in range(20 * FOLD_AT):
        meter.picked_up("default", 0.004)
        meter.finished("default", "tasks.noop", Outcome.SUCCEEDED, 0.001)
        assert len(meter._events) < FOLD_AT
    taken = meter.take()
    counts = taken.queues["default"]
    assert counts["pickups"] == counts["runs"] == counts["succeeded"] == 20 * FOLD_AT
    assert counts["pickup_buckets"][PICKUP_BUCKETS.index(0.005)] == 20 * FOLD_AT
    task = taken.tasks["tasks.noop"]
    assert task["runs"] == task["succeeded"] == 20 * FOLD_AT
    assert task["run_buckets"][DURATION_BUCKETS.index(0.001)] == 20 * FOLD_AT
    assert not meter.take()


def test_events_from_threads_folding_while_the_housekeeper_takes_are_all_counted():
    meter, start, per_thread = Meter(), threading.Barrier(5), 5 * FOLD_AT + 17
    taken: list[Counts] = []
    done = threading.Event()

    def executor(queue: str) -> None:
        start.wait(timeout=10)
        for _ in range(per_thread):
            meter.finished(queue, "tasks.noop", Outcome.SUCCEEDED, 0.001)
            meter.picked_up(queue, 0.02)

    def housekeeper() -> None:
        start.wait(timeout=10)
        while not done.is_set():
            taken.append(meter.take())
        taken.append(meter.take())

    threads = [threading.Thread(target=executor, args=(f"q{i % 2}",)) for i in range(4)]
    keeper = threading.Thread(target=housekeeper)
    for thread in [*threads, keeper]:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    done.set()
    keeper.join(timeout=60)
    for queue in ("q0", "q1"):
        assert sum(t.queues.get(queue, {}).get("runs", 0) for t in taken) == 2 * per_thread
        assert sum(t.queues.get(queue, {}).get("pickups", 0) for t in taken) == 2 * per_thread
    assert sum(t.tasks.get("tasks.noop", {}).get("runs", 0) for t in taken) == 4 * per_thread


def test_counts_a_failed_flush_put_back_are_added_to_those_folded_since():
    meter = Meter()
    for _ in range(FOLD_AT):
        meter.finished("default", "tasks.noop", Outcome.SUCCEEDED, 0.5)
    failed_flush = meter.take()
    for _ in range(FOLD_AT + 1):  # folded once meanwhile
        meter.finished("default", "tasks.noop", Outcome.RETRYING, 0.5)
    meter.put_back(failed_flush)
    taken = meter.take()
    for counts in (taken.queues["default"], taken.tasks["tasks.noop"]):
        assert counts["succeeded"] == FOLD_AT
        assert counts["retried"] == FOLD_AT + 1
        assert counts["runs"] == 2 * FOLD_AT + 1
        assert counts["run_seconds"] == pytest.approx(0.5 * (2 * FOLD_AT + 1))
    assert sum(taken.tasks["tasks.noop"]["run_buckets"]) == 2 * FOLD_AT + 1


def test_the_last_error_is_the_newest_failure_of_the_task_and_a_put_back_keeps_newer():
    meter = Meter()
    boom = ErrorInfo("builtins.ValueError", "first")
    meter.finished("default", "tasks.a", Outcome.RETRYING, 0.1, boom, 1)
    meter.finished("default", "tasks.a", Outcome.CANCELLED, 0.1, ErrorInfo("x.JobCancelled", ""), 2)
    assert meter.take().tasks["tasks.a"]["last_error"] == (1, "builtins.ValueError: first")
    meter.finished(
        "default", "tasks.a", Outcome.FAILED, 0.1, ErrorInfo("builtins.KeyError", "x"), 3
    )
    failed_flush = meter.take()
    meter.finished("default", "tasks.a", Outcome.FAILED, 0.1, ErrorInfo("builtins.OSError", "y"), 4)
    meter.put_back(failed_flush)
    assert meter.take().tasks["tasks.a"]["last_error"] == (4, "builtins.OSError: y")
    meter.finished("default", "tasks.a", Outcome.FAILED, 0.1, ErrorInfo("E", "m" * 5000), 5)
    job_id, text = meter.take().tasks["tasks.a"]["last_error"]
    assert job_id == 5 and len(text) == LAST_ERROR_MAX_CHARS


@pytest.mark.django_db
def test_a_flush_writes_the_folded_counts_to_the_current_minute():
    meter = Meter()
    for _ in range(3 * FOLD_AT):
        meter.finished("default", "tasks.noop", Outcome.SUCCEEDED, 0.001)
    meter.finished("default", "tasks.other", Outcome.FAILED, 2.0, ErrorInfo("E", "why"), 9)
    meter.flush("default")
    row = QueueMinute.objects.get(queue_name="default")
    assert row.succeeded == 3 * FOLD_AT and row.failed == 1
    noop, other = TaskMinute.objects.order_by("task")
    assert (noop.task, noop.succeeded, noop.last_error_job) == ("tasks.noop", 3 * FOLD_AT, None)
    assert (other.failed, other.last_error, other.last_error_job) == (1, "E: why", 9)
    assert other.last_error_at is not None
