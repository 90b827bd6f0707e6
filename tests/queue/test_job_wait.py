"""Waiting on one job (`Job.wait()`, `await_result()`): Celery's `AsyncResult.get()`.

Woken by a NOTIFY that only a row somebody waits on sends (migration 0022), through one
LISTEN connection per process; refused at once inside the transaction that enqueued the
job. Real PostgreSQL, real threads, jobs run by `run_jobs()` or a worker thread."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import psycopg
import pytest
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError

from django_skipqueue import chain
from django_skipqueue.exceptions import JobFailed
from django_skipqueue.models import Job, JobState
from django_skipqueue.queue.awaiting import POLL_SECONDS
from django_skipqueue.queue.finished import JOB_FINISHED_CHANNEL
from django_skipqueue.testing import run_jobs
from tests.processes import listening_backends
from tests.testapp.tasks import add, always_fails, waits_inside

pytestmark = pytest.mark.django_db(transaction=True)


def listener() -> psycopg.Connection:
    params = connection.get_connection_params()
    raw = psycopg.connect(**params, autocommit=True)
    raw.execute(f'LISTEN "{JOB_FINISHED_CHANNEL}"')  # the trigger's literal (0022)
    return raw


def notified(raw: psycopg.Connection) -> list[str]:
    time.sleep(0.2)
    return [n.payload for n in raw.notifies(timeout=0.5, stop_after=10)]


def test_only_a_job_somebody_waits_on_notifies_when_it_finishes():
    raw = listener()
    try:
        other = add.enqueue(3, 4)
        run_jobs()
        assert Job.objects.get(id=other.id).state == JobState.DONE
        assert notified(raw) == []
        awaited = add.enqueue(1, 2)
        Job.objects.filter(id=awaited.id).update(awaited=True)
        run_jobs()
        assert notified(raw) == [""]  # no payload: channels are visible to every user
    finally:
        raw.close()


def test_wait_returns_the_result_once_a_worker_ran_it():
    job = add.enqueue(2, 3)
    runner = threading.Timer(0.5, lambda: (run_jobs(), connection.close()))
    runner.start()
    started = time.monotonic()
    assert job.wait(timeout=10) == 5
    runner.join()
    assert job.state == JobState.DONE
    assert time.monotonic() - started < 5


def test_a_failed_job_raises_its_error_and_a_cancelled_one_says_who():
    failed = always_fails.using(max_attempts=1).enqueue("disk full")
    run_jobs()
    with pytest.raises(JobFailed, match=r"failed: .*RuntimeError: disk full") as raised:
        failed.wait(timeout=5)
    assert raised.value.state == JobState.FAILED and raised.value.job_id == failed.id
    cancelled = add.enqueue(1, 1)
    Job.objects.cancel([cancelled.id], by="ops")
    with pytest.raises(JobFailed, match="was cancelled by ops"):
        cancelled.wait(timeout=5)


def test_a_wait_that_times_out_names_the_job_and_its_state():
    job = add.enqueue(1, 1)
    with pytest.raises(TimeoutError, match=rf"job {job.id} \(.*add\) is still pending after 0.3 s"):
        job.wait(timeout=0.3)


def test_waiting_inside_the_enqueueing_transaction_is_refused_and_the_transaction_lives():
    with transaction.atomic():
        job = add.enqueue(1, 1)
        with pytest.raises(TransactionManagementError, match="has not committed yet"):
            job.wait(timeout=5)
        assert Job.objects.filter(id=job.id).exists()  # still usable
    assert Job.objects.get(id=job.id).state == JobState.PENDING


def test_a_job_that_is_gone_says_why():
    job = add.enqueue(1, 1)
    Job.objects.filter(id=job.id).delete()
    with pytest.raises(Job.DoesNotExist, match="pruned after it finished, or relayed"):
        job.wait(timeout=5)


def test_twenty_waiting_threads_share_one_listen_connection_and_all_wake():
    jobs = [add.enqueue(n, 1) for n in range(20)]
    answers: dict[int, object] = {}
    ready = threading.Barrier(21)

    def waiter(job_id: int) -> None:
        try:
            ready.wait(timeout=10)
            answers[job_id] = Job.objects.get(id=job_id).wait(timeout=20)
        finally:
            connection.close()

    threads = [threading.Thread(target=waiter, args=(job.id,)) for job in jobs]
    for thread in threads:
        thread.start()
    ready.wait(timeout=10)
    time.sleep(0.3)  # the waiters are past their first look (a deadline, not a sync)
    listening = listening_backends()
    run_jobs()
    for thread in threads:
        thread.join(timeout=20)
    assert listening == 1
    assert answers == {job.id: n + 1 for n, job in enumerate(jobs)}
    assert Job.objects.filter(awaited=True).count() == 20


def test_each_finish_wakes_the_read_of_its_own_waiter_only():
    """Trial finding 3: every job notification made every waiter read its row again (24
    waiters, one job finished at a time: 249 reads in 3.8 s). Now one read asks which
    watched jobs are finished, and only their waiters read their rows."""
    jobs = [add.enqueue(n, 1) for n in range(24)]
    reads = {job.id: 0 for job in jobs}
    answers: dict[int, object] = {}
    ready = threading.Barrier(len(jobs) + 1)

    def waiter(job_id: int) -> None:
        def count(execute, sql, params, many, context):
            if sql.startswith("SELECT"):
                reads[job_id] += 1
            return execute(sql, params, many, context)

        try:
            job = Job.objects.get(id=job_id)
            ready.wait(timeout=10)
            with connection.execute_wrapper(count):
                answers[job_id] = job.wait(timeout=30)
        finally:
            connection.close()

    threads = [threading.Thread(target=waiter, args=(job.id,)) for job in jobs]
    for thread in threads:
        thread.start()
    ready.wait(timeout=10)
    time.sleep(0.3)  # past their first look (a deadline, not a sync)
    started = time.monotonic()
    for _ in jobs:  # one finish, one notification, at a time
        run_jobs(limit=1)
        time.sleep(0.02)
    for thread in threads:
        thread.join(timeout=30)
    seconds = time.monotonic() - started
    assert answers == {job.id: n + 1 for n, job in enumerate(jobs)}
    # Each waiter: its first look, the read after its job finished, and one poll a
    # second at most (POLL_SECONDS) while it waited. Every waiter woken at every
    # notification would read ~300 times.
    polls = int(seconds / POLL_SECONDS) + 1
    assert sum(reads.values()) <= len(jobs) * (2 + polls), (reads, seconds)


def test_await_result_does_not_block_the_event_loop():
    job = add.enqueue(20, 22)
    ticks = 0

    async def main() -> object:
        nonlocal ticks

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.05)

        ticker = asyncio.create_task(tick())
        try:
            return await job.await_result(timeout=10)
        finally:
            ticker.cancel()

    threading.Timer(0.5, lambda: (run_jobs(), connection.close())).start()
    assert asyncio.run(main()) == 42
    assert ticks >= 5


@pytest.mark.parametrize(
    ("allow", "error"),
    [(False, "RuntimeError: job .* waits on job .* inside its task"), (True, "TimeoutError")],
)
def test_waiting_inside_a_task_is_refused_unless_allowed(allow, error):
    """A task that waited on a job it enqueued held its worker's thread for ever at
    --concurrency 1 (the outside trial); Celery refuses the same."""
    job = waits_inside.enqueue(allow)
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert re.search(error, job.last_error), job.last_error


@pytest.mark.parametrize(
    ("timeout", "error"), [(-1, ValueError), (float("nan"), ValueError), ("3", TypeError)]
)
def test_a_bad_timeout_is_refused_naming_it(timeout, error):
    job = add.enqueue(1, 1)
    with pytest.raises(error, match="timeout must be"):
        job.wait(timeout=timeout)


def test_a_job_only_built_says_it_was_not_enqueued():
    with pytest.raises(ValueError, match="built .* not enqueued"):
        add.build(1, 2).wait(timeout=1)


def test_a_step_cancelled_by_its_failed_parent_says_so_in_words():
    workflow = chain(always_fails.using(max_attempts=1).s("boom"), add.si(1, 1)).enqueue()
    run_jobs()
    step = Job.objects.filter(workflow_id=workflow.id, task=add.name).get()
    with pytest.raises(JobFailed, match="was cancelled by its workflow: a job it waits on"):
        step.wait(timeout=5)


def test_the_atomic_requests_case_is_named_in_the_refusal():
    with transaction.atomic():
        job = add.enqueue(1, 1)
        with pytest.raises(TransactionManagementError, match="ATOMIC_REQUESTS"):
            job.wait(timeout=1)
