"""Time limits: `soft_time_limit`, which a task sees at its safe point and in
`context.time_left`, and `time_limit`, the hard one (runtime/timelimits.py): the task
sees it at its safe point too; one whose code does not stop makes its worker process
exit with code 3, to be replaced. Nothing is ever raised into a thread.

Real threads and real worker processes, with limits of a fraction of a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db.models import Sum

from django_skipqueue import task
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.models import Job, JobState, QueueMinute, WorkerProcess
from django_skipqueue.runtime.worker import EXIT_TIME_LIMIT, Worker
from django_skipqueue.testing import run_jobs
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import Run

pytestmark = [pytest.mark.django_db(transaction=True)]

TIME_LIMIT_EXCEEDED = "django_skipqueue.exceptions.TimeLimitExceeded"


@contextmanager
def working(**options: object) -> Iterator[Worker]:
    """A polling worker in a thread (one thread, no reaper, unless given), stopped on
    leaving the block."""
    worker = Worker(  # type: ignore[arg-type]
        listen=False, poll_interval=0.05, **{"concurrency": 1, "reap_interval": 0, **options}
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=20)


def work_until_failed(job_ids: list[int], timeout: float, **options: float) -> Worker:
    """A polling worker in a thread (concurrency 1 unless given), stopped once every job
    of `job_ids` has ended failed; returns it for its counts."""
    worker = Worker(listen=False, poll_interval=0.05, **{"concurrency": 1, **options})
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(
            lambda: (
                Job.objects.filter(id__in=job_ids, state=JobState.FAILED).count() == len(job_ids)
            ),
            timeout=timeout,
            message="the jobs did not end failed in time",
        )
    finally:
        worker.stop()
        thread.join(timeout=20)
    return worker


def test_a_task_sees_its_soft_limit_coming_and_stops_at_its_safe_point():
    job = tasks.soft_limited.enqueue()
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE
    result = job.result
    assert result["stopped"] is True
    assert 0.2 < result["first"] <= 0.3  # counted from the start of the task
    assert result["left"] == 0.0
    assert 3 <= result["steps"] <= 8  # about 0.3 s of 0.05 s steps, not 1000


def test_time_left_is_none_without_a_limit():
    job = tasks.no_limits.enqueue()
    run_jobs()
    job.refresh_from_db()
    assert (job.state, job.result) == (JobState.DONE, None)


def _limits() -> None: ...


def test_a_soft_limit_must_be_shorter_than_the_hard_one():
    with pytest.raises(ConfigurationError, match="must be shorter than its time_limit"):
        task(soft_time_limit=5, time_limit=2)(_limits)
    with pytest.raises(ConfigurationError, match="time_limit or timeout"):
        task(timeout=5, time_limit=2)(_limits)


def test_a_task_checking_its_safe_point_stops_at_its_hard_limit_and_is_retried_if_its_policy_says():
    """A loop that calls `check_cancelled()`: TimeLimitExceeded there at the limit, so the
    attempt ends through the fence at once (not when the 10 s lease runs out); its
    policy says `retry_time_limits`, so the second attempt runs and ends the same way.
    The worker goes on: the job after it runs, and it never stops for it."""
    job = tasks.loops_forever.enqueue()  # time_limit 0.5 s, lease 10 s, 2 attempts
    after = tasks.add.enqueue(1, 2)
    started = time.monotonic()
    with working() as worker:
        wait_until(
            lambda: Job.objects.get(id=job.id).state == JobState.FAILED,
            timeout=15,
            message="the looping job was not stopped twice",
        )
        took = time.monotonic() - started
        wait_until(lambda: Job.objects.get(id=after.id).state == JobState.DONE, timeout=10)
        assert not worker.stuck_exit and not worker.stop_reason
    job.refresh_from_db()
    assert [error["type"] for error in job.errors] == [TIME_LIMIT_EXCEEDED] * 2
    assert "time limit of 0.5s" in job.last_error
    assert (job.attempts, job.expirations) == (2, 0)  # through the fence, not the reaper
    assert took < 8  # far below one 10 s lease


def test_a_time_limit_failure_is_not_retried_by_default_as_in_celery():
    """Celery fails a task past its time limit once; so does the default policy, for the
    hard limit and for a soft one the task lets out of its safe point."""
    hard = tasks.checks_past_its_limit.enqueue()  # 3 attempts allowed
    soft = tasks.ignores_its_soft_limit.enqueue()
    work_until_failed([hard.id, soft.id], timeout=15, concurrency=2, reap_interval=0)
    hard.refresh_from_db()
    soft.refresh_from_db()
    assert (hard.attempts, [e["type"] for e in hard.errors]) == (1, [TIME_LIMIT_EXCEEDED])
    assert (soft.attempts, soft.errors[0]["type"].rsplit(".", 1)[-1]) == (
        1,
        "SoftTimeLimitExceeded",
    )


def test_a_task_returning_just_past_its_limit_fails_and_its_worker_goes_on():
    """The housekeeper's pass is planned for each limit (it sleeps up to a second
    otherwise): three tasks returning 0.3 s past their 0.3 s limit, inside the grace,
    each end with TimeLimitExceeded (whatever they returned), through the fence, and the
    worker never stops for them."""
    jobs = [tasks.returns_just_past_its_limit.enqueue() for _ in range(3)]
    worker = work_until_failed([job.id for job in jobs], timeout=15, reap_interval=0)
    for job in jobs:
        job.refresh_from_db()
        assert [error["type"] for error in job.errors] == [TIME_LIMIT_EXCEEDED]
        assert (job.result, job.expirations) == (None, 0)
    assert worker.stats.timed_out == 3
    assert not worker.stuck_exit


def test_a_threaded_worker_whose_task_does_not_stop_fails_it_releases_the_rest_and_exits_3():
    """Blocked in C past its limit and its grace: the worker stops, gives the buffered job
    back at once, fails the stuck attempt through the fence (its lease was renewed until
    then: no expiry, no reaper) and returns EXIT_TIME_LIMIT for its supervisor."""
    stuck = tasks.sleeps_past_its_limit.using(priority=10).enqueue(seconds=5.0)
    waiting = tasks.add.enqueue(1, 1)
    worker = Worker(
        concurrency=1, listen=False, poll_interval=0.05, reap_interval=0.2, prefetch=4, grace=5
    )
    started = time.monotonic()
    code = worker.run()
    assert code == EXIT_TIME_LIMIT
    assert time.monotonic() - started < 4  # 0.5 s limit, 1 s grace: no stop grace spent
    assert "past its time limit of 0.5s did not stop" in worker.stop_reason
    stuck.refresh_from_db()
    assert (stuck.state, stuck.attempts, stuck.expirations) == (JobState.FAILED, 1, 0)
    assert [error["type"] for error in stuck.errors] == [TIME_LIMIT_EXCEEDED]
    waiting.refresh_from_db()
    assert waiting.state == JobState.PENDING  # released, not left to its lease
    assert WorkerProcess.objects.get().stopped_at is not None


@pytest.mark.timeout(90)
def test_a_task_logging_past_its_limit_ends_its_worker_not_every_thread_that_logs(start_worker):
    """The outside trial's worst case: a task logging in a tight loop past its limit.
    An exception raised into its thread landed inside logging's handler lock and froze
    every thread that logs, the housekeeper too, and SIGTERM was ignored. Now: the other
    jobs keep running, the worker exits 3 within seconds, the attempt fails through the
    fence, and no job is lost (a second worker finishes what the first gave back)."""
    chatty = tasks.logs_past_its_limit.enqueue()
    others = [job.id for job in tasks.occupy.enqueue_many([((0.05,), {})] * 40)]
    first = start_worker("--concurrency", "2", "--grace", "5")
    wait_until(lambda: Run.objects.filter(job_id=chatty.id).exists(), timeout=15)
    code = first.wait(timeout=20)
    assert code == EXIT_TIME_LIMIT, first.output()[-3000:]
    output = first.output()
    assert "did not stop: this worker stops" in output
    assert "worker stopped" in output
    chatty.refresh_from_db()
    assert (chatty.state, chatty.attempts, chatty.expirations) == (JobState.FAILED, 1, 0)
    assert Job.objects.filter(id__in=others, state=JobState.DONE).exists()  # ran meanwhile
    assert not Job.objects.filter(id__in=others, state=JobState.RUNNING).exists()
    second = start_worker("--concurrency", "2", "--burst")
    assert second.wait(timeout=30) == 0
    assert Job.objects.filter(id__in=others, state=JobState.DONE).count() == 40


@pytest.mark.timeout(90)
def test_under_processes_the_child_whose_task_does_not_stop_is_replaced(
    start_worker, tmp_path, monkeypatch
):
    """`--processes`: the child running the logging task exits 3 and the pool starts a
    new one; the attempt is failed through the fence, with `job_failed` sent, and the
    pool's other child and the new one run the jobs after it."""
    signal_log = tmp_path / "signals.log"
    monkeypatch.setenv("SKIPQUEUE_TEST_SIGNAL_LOG", str(signal_log))
    chatty = tasks.logs_past_its_limit.enqueue()
    pool = start_worker("--processes", "2", "--concurrency", "1", "--grace", "5")
    wait_until(
        lambda: Job.objects.get(id=chatty.id).state == JobState.FAILED,
        timeout=20,
        message="the job past its limit was not failed",
    )
    pool.wait_for_output("exited with 3")
    pool.wait_for_output("replacing it")
    chatty.refresh_from_db()
    assert (chatty.attempts, chatty.expirations) == (1, 0)
    assert [error["type"] for error in chatty.errors] == [TIME_LIMIT_EXCEEDED]
    assert QueueMinute.objects.aggregate(n=Sum("failed"))["n"] == 1
    assert signal_log.read_text().split("\n") == [f"job_failed {chatty.id}", ""]
    assert WorkerProcess.objects.filter(stopped_at__isnull=False).count() == 1
    after = [job.id for job in tasks.add.enqueue_many([((n, n), {}) for n in range(10)])]
    wait_until(
        lambda: Job.objects.filter(id__in=after, state=JobState.DONE).count() == 10, timeout=20
    )
    assert pool.process.poll() is None


@pytest.mark.timeout(120)
def test_a_keyed_task_stuck_in_c_holds_its_slot_until_its_worker_exits_then_frees_it(
    start_worker,
):
    """A job under `concurrency_limit=1` blocked in a socket read past its 1 s limit, on
    one of two `-c 4` workers: the key's next job never starts while the stuck code
    runs (its lease, so its slot, is renewed), the worker exits 3, its attempt's failure
    frees the slot, and the key's next job runs at once on the other worker, long before
    the stuck job's 30 s lease would have run out."""
    from tests.testapp.models import Span

    stuck = tasks.reads_a_silent_socket.enqueue("acct", 60.0)
    a = start_worker("--concurrency", "4", "--grace", "3")
    wait_until(lambda: Span.objects.filter(job_id=stuck.id).exists(), timeout=15)
    following = tasks.reads_a_silent_socket.enqueue("acct", 0.0)
    b = start_worker("--concurrency", "4")
    b.wait_for_output("worker started", timeout=15)
    while a.process.poll() is None:
        assert not Span.objects.filter(job_id=following.id).exists(), (
            "the key's next job started while the stuck one's code still ran"
        )
        time.sleep(0.02)
    assert a.process.returncode == EXIT_TIME_LIMIT
    exited = time.monotonic()
    stuck.refresh_from_db()
    assert (stuck.state, stuck.expirations) == (JobState.FAILED, 0)
    wait_until(
        lambda: Job.objects.get(id=following.id).state == JobState.DONE,
        timeout=15,
        message="the key's next job did not run after the stuck worker's exit",
    )
    assert time.monotonic() - exited < 15  # not at the stuck job's lease (30 s)
    assert b.process.poll() is None


@pytest.mark.timeout(120)
def test_a_short_lease_outlives_the_stop_until_the_stuck_attempts_failure(start_worker):
    """A stuck keyed job with a 0.25 s lease, beside a job still running after the stop's
    grace: the stop waited a second for that job's thread while no lease was renewed,
    the stuck job's lease ran out first, the reaper gave it (and its key) to another
    worker, the key's next job ran beside the stuck code, and the job ran again (an
    outside trial, 6 of 6). Now its lease is extended past the stop and no thread in a
    job is waited for: the failure is written while the attempt owns the job."""
    from tests.testapp.models import Span

    stuck = tasks.reads_a_silent_socket.using(lease=0.25).enqueue("short", 60.0)
    busy = tasks.occupy.enqueue(10.0)  # no limit: still running when the grace ends
    a = start_worker("--concurrency", "2", "--grace", "1", "--reap-interval", "1")
    wait_until(lambda: Span.objects.filter(job_id=stuck.id).exists(), timeout=15)
    following = [tasks.reads_a_silent_socket.using(lease=0.25).enqueue("short", 0.3).id]
    b = start_worker("--concurrency", "1", "--reap-interval", "0.3")
    b.wait_for_output("worker started", timeout=15)
    while a.process.poll() is None:
        assert not Span.objects.filter(job_id__in=following).exists(), (
            "the key's next job started while the stuck code still ran"
        )
        time.sleep(0.02)
    assert a.process.returncode == EXIT_TIME_LIMIT
    stuck.refresh_from_db()
    assert (stuck.state, stuck.attempts, stuck.expirations) == (JobState.FAILED, 1, 0)
    assert "lease lost" not in a.output()
    wait_until(
        lambda: Job.objects.get(id=following[0]).state == JobState.DONE,
        timeout=15,
        message="the key's next job did not run after the exit",
    )
    assert Span.objects.filter(job_id=stuck.id).count() == 1  # never run again
    assert Job.objects.get(id=busy.id).state in (JobState.PENDING, JobState.DONE)


@pytest.mark.timeout(90)
def test_a_stuck_task_holding_its_own_row_does_not_hold_the_exit(start_worker):
    """The task locks its own job's row, then blocks: the failure's write waited on that
    lock for as long as the code ran (26 s for a 25 s sleep). It waits a second now, and
    the job is left to the reaper."""
    held = tasks.holds_its_own_row.enqueue(seconds=30.0)
    worker = start_worker("--concurrency", "1", "--grace", "1", "--burst")
    started = time.monotonic()
    assert worker.wait(timeout=30) == EXIT_TIME_LIMIT
    assert time.monotonic() - started < 15
    assert "left to the reaper" in worker.output()
    held.refresh_from_db()
    assert held.state == JobState.RUNNING and held.expirations == 0  # the reaper's, later
