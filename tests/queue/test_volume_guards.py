"""Volume guards (case S11, docs/explanation/failure-model.md): attempt and delay caps,
and a cap on pending jobs."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connections
from django.utils import timezone

from django_skipqueue.checks import check_settings, check_task_limits
from django_skipqueue.exceptions import InvalidJobError, QueueFullError
from django_skipqueue.models import Job, JobState
from django_skipqueue.runtime.worker import Worker
from tests.guard import setting_up
from tests.testapp import tasks


def ids(errors) -> list[str]:
    return [error.id for error in errors]


@pytest.mark.django_db
def test_max_attempts_over_the_limit_is_refused_before_any_sql(settings):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "MAX_ATTEMPTS_LIMIT": 10}
    tasks.add.using(max_attempts=10).enqueue(1, 2)
    with pytest.raises(InvalidJobError, match=r"max_attempts 11 is over .*MAX_ATTEMPTS_LIMIT"):
        tasks.add.using(max_attempts=11).enqueue(1, 2)
    with pytest.raises(InvalidJobError, match="MAX_ATTEMPTS_LIMIT"):
        tasks.add.using(max_attempts=10**9).enqueue_many([((1, 2), {})])
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_a_far_future_run_after_is_refused(settings):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "MAX_DELAY_SECONDS": 3600}
    tasks.add.using(run_after=timedelta(minutes=59)).enqueue(1, 2)
    with pytest.raises(InvalidJobError, match="run_after is 2:00:00 ahead"):
        tasks.add.using(run_after=timedelta(hours=2)).enqueue(1, 2)
    with pytest.raises(InvalidJobError, match="MAX_DELAY_SECONDS"):
        tasks.add.using(run_after=timezone.now() + timedelta(days=400)).enqueue_many([((1, 2), {})])
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_a_task_that_passed_its_bounds_is_checked_again_under_new_settings(settings):
    late = tasks.add.using(run_after=timedelta(hours=2), max_attempts=11)
    late.enqueue(1, 2)
    late.enqueue(1, 2)  # passed twice: kept beside these settings
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "MAX_DELAY_SECONDS": 3600}
    with pytest.raises(InvalidJobError, match="run_after is 2:00:00 ahead"):
        late.enqueue(1, 2)
    settings.SKIPQUEUE = {
        **settings.SKIPQUEUE,
        "MAX_DELAY_SECONDS": 10**6,
        "MAX_ATTEMPTS_LIMIT": 10,
    }
    with pytest.raises(InvalidJobError, match="MAX_ATTEMPTS_LIMIT"):
        late.enqueue(1, 2)
    assert Job.objects.count() == 2


@pytest.mark.django_db
def test_a_full_queue_refuses_more_and_other_queues_are_unaffected(settings):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "MAX_PENDING_PER_QUEUE": 5}
    tasks.add.enqueue_many([((n, n), {}) for n in range(4)])
    with pytest.raises(QueueFullError, match="holds 4 pending jobs; adding 2 would pass"):
        tasks.add.enqueue_many([((1, 1), {})] * 2)  # all or nothing
    tasks.add.enqueue(1, 1)  # the fifth fits
    with pytest.raises(QueueFullError, match="'default' holds 5 pending"):
        tasks.add.enqueue(1, 1)
    tasks.add.using(queue_name="other").enqueue(1, 1)
    assert Job.objects.filter(queue_name="default").count() == 5
    with setting_up():
        Job.objects.filter(id=Job.objects.first().id).update(state=JobState.DONE)
    tasks.add.enqueue(1, 1)  # only pending jobs count


def test_the_checks_report_limits_that_cannot_hold(settings):
    settings.SKIPQUEUE = {"MAX_ATTEMPTS": 50, "MAX_ATTEMPTS_LIMIT": 20}
    [error] = check_settings()
    assert error.id == "skipqueue.E002" and "MAX_ATTEMPTS_LIMIT (20)" in error.msg
    settings.SKIPQUEUE = {"MAX_PENDING_PER_QUEUE": 0, "MAX_DELAY_SECONDS": "a year"}
    assert ids(check_settings()) == ["skipqueue.E002"] * 2
    settings.SKIPQUEUE = {"MAX_ATTEMPTS_LIMIT": 3, "MAX_ATTEMPTS": 3}  # probe asks for 10
    errors = check_task_limits()
    assert "skipqueue.E007" in ids(errors)
    assert any("'tests.testapp.tasks.probe'" in error.msg for error in errors)


@pytest.mark.django_db(transaction=True)
def test_a_task_that_enqueues_itself_without_end_stops_at_the_cap(settings):
    cap = 30
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "MAX_PENDING_PER_QUEUE": cap}
    tasks.fan_out.enqueue()
    # A fixed prefetch: the bound below needs the most jobs the worker ever held, and the
    # adaptive prefetch moves during the run (seen: 16 at the end, more before: peak 54).
    worker = Worker(concurrency=2, prefetch=8, listen=False, poll_interval=0.05, reap_interval=0)
    peak, done = 0, threading.Event()

    def watch() -> None:
        nonlocal peak
        try:
            while not done.wait(0.01):
                peak = max(peak, Job.objects.filter(state=JobState.PENDING).count())
        finally:
            connections.close_all()

    watcher = threading.Thread(target=watch)
    watcher.start()
    threading.Timer(3.0, worker.stop).start()
    try:
        worker.run()
    finally:
        done.set()
        watcher.join()
    refused = Job.objects.filter(last_error__startswith="django_skipqueue.exceptions.QueueFull")
    # Over the cap only by jobs that come back rather than in: failed attempts retried
    # from the worker's hands (threads plus prefetch), and enqueues that raced.
    in_hand = worker.concurrency + worker.prefetch
    assert peak <= cap + in_hand + worker.concurrency
    assert refused.exists()  # the cap is what stopped it
    assert worker.stats.finished > cap  # and the worker kept working meanwhile
