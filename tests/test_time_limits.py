"""Time limits (issue 27): `soft_time_limit`, which a task sees at its safe point and in
`context.time_left`, and `time_limit`, the hard one, which frees the capacity.

Real threads and real processes, with limits of a fraction of a second.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db.models import Sum

from django_skipqueue import task
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.maintenance.reaper import Reaper
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


def test_a_looping_task_is_stopped_at_its_hard_limit_and_retried_as_its_policy_says():
    """A pure-Python loop past `time_limit`: TimeLimitExceeded is raised into its thread,
    so the attempt ends through the fence at once (not when the 10 s lease runs out),
    and the thread is free again; the second attempt ends the same way, failed."""
    job = tasks.loops_forever.enqueue()  # time_limit 0.5 s, lease 10 s, 2 attempts
    after = tasks.add.enqueue(1, 2)
    worker = Worker(concurrency=1, listen=False, poll_interval=0.05, reap_interval=0)
    thread = threading.Thread(target=worker.run)
    started = time.monotonic()
    thread.start()
    try:
        wait_until(
            lambda: Job.objects.get(id=job.id).state == JobState.FAILED,
            timeout=15,
            message="the looping job was not stopped twice",
        )
        took = time.monotonic() - started
        wait_until(lambda: Job.objects.get(id=after.id).state == JobState.DONE, timeout=10)
    finally:
        worker.stop()
        thread.join(timeout=20)
    job.refresh_from_db()
    assert [error["type"] for error in job.errors] == [TIME_LIMIT_EXCEEDED] * 2
    assert "time limit of 0.5s" in job.last_error
    assert (job.attempts, job.expirations) == (2, 0)  # through the fence, not the reaper
    assert took < 8  # far below one 10 s lease
    assert worker.stats.timed_out == 2
    assert worker.stuck_threads == 0 and not worker.stuck_exit


def test_a_connection_whose_lock_an_interrupted_task_left_held_is_closed_not_waited_on():
    """The limit's interrupt leaves the thread's connection lock held (a driver's `with
    lock:` exit skipped, as CPython 3.13 can): the connection is closed after the
    attempt, whose failure is recorded through the fence, and the thread's next job runs
    on a new one. Before, the failure's write waited for the lock forever, and so did
    every job after it on that thread."""
    job = tasks.loops_holding_its_connections_lock.enqueue()
    after = tasks.add.enqueue(1, 2)
    with working():
        wait_until(
            lambda: Job.objects.get(id=after.id).state == JobState.DONE,
            timeout=10,
            message="the job after the interrupted one did not run",
        )
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert [error["type"] for error in job.errors] == [TIME_LIMIT_EXCEEDED]
    assert job.expirations == 0  # through the fence, not the reaper


@pytest.mark.timeout(90, method="thread")
@pytest.mark.parametrize("traced", ["after", "throughout"])
def test_an_interrupt_taken_back_leaves_a_thread_under_a_tracer_running(traced):
    """On CPython 3.11, taking an interrupt back (`interrupt.leave` after one was raised
    into the task, landed or not) left the interpreter's flag for a pending asynchronous
    exception up: a thread running under a tracer spun for ever at the start of its next
    Python call. Traced after the take-back (found when a test of ours used
    sys.settrace after the time-limit tests), and traced throughout, as coverage traces
    a worker's threads: there the first repair spun inside `leave`, holding its lock
    (an outside trial). (A flag another thread's undelivered interrupt holds up, as one
    given to a thread blocked in C, stalls a traced thread the same way until it lands:
    a 3.11 hazard with tracers that no take-back causes.)"""
    from django_skipqueue.exceptions import TimeLimitExceeded
    from django_skipqueue.runtime import interrupt

    entered, out = threading.Event(), []

    def task_call() -> None:
        if traced == "throughout":
            sys.settrace(lambda frame, event, arg: None)
        ident = interrupt.enter(-1)
        entered.set()
        try:
            while True:
                sum(range(10))
        except TimeLimitExceeded as raised:
            out.append(raised)
        finally:
            out.append(interrupt.leave(ident, -1))
        threading.Event().is_set()  # a Python call: on 3.11 it never started
        out.append("went on")

    thread = threading.Thread(target=task_call, daemon=True)
    thread.start()
    assert entered.wait(5)
    assert interrupt.interrupt(thread, -1, 0.25)
    thread.join(10)
    assert not thread.is_alive() and out[1:] == [0.25, "went on"]
    assert isinstance(out[0], TimeLimitExceeded)
    events: list[str] = []
    sys.settrace(lambda frame, event, arg: events.append(event))
    try:
        threading.Event().is_set()  # a Python call: on 3.11 it never returned
    finally:
        sys.settrace(None)
    assert "call" in events


def test_a_hard_limit_is_acted_on_when_it_falls_not_at_the_housekeepers_next_pass():
    """The housekeeper sleeps up to MAX_WAIT (1 s) between passes; a job started with a
    limit that falls before its planned pass wakes it. Three 0.3 s limits in a row (each
    job starts at a random point of the housekeeper's sleep; found by an outside trial,
    where a 0.25 s limit stopped its task after up to 1.2 s): each attempt ends within
    0.4 s of its limit. Before, a pass came within that window for about two jobs in five."""
    jobs = [tasks.loops_past_a_short_limit.enqueue() for _ in range(3)]
    work_until_failed([job.id for job in jobs], timeout=15, reap_interval=0)
    ran = []
    for job in jobs:
        job.refresh_from_db()
        assert [error["type"] for error in job.errors] == [TIME_LIMIT_EXCEEDED]
        ran.append((job.finished_at - job.started_at).total_seconds())
    assert all(0.3 <= seconds < 0.7 for seconds in ran), ran


def test_a_limit_that_falls_while_job_started_receivers_run_stops_the_task_as_it_starts():
    """The limit counts from the job's start, before its `job_started` receivers run; the
    interrupt lands only inside the task's call. One that fell while a slow receiver ran
    found the thread outside it, and the task then ran with no limit at all (found by an
    outside trial). It is raised as the task's call begins: the task never runs."""
    from django_skipqueue import signals

    def slow(sender, job, **kwargs):
        if job.task == tasks.loops_past_a_short_limit.name:
            time.sleep(0.6)  # past the task's 0.3 s limit

    job = tasks.loops_past_a_short_limit.enqueue()  # loops for ever, 1 attempt
    signals.job_started.connect(slow, weak=False)
    try:
        work_until_failed([job.id], timeout=10, concurrency=2, reap_interval=0)
    finally:
        signals.job_started.disconnect(slow)
    job.refresh_from_db()
    assert [error["type"] for error in job.errors] == [TIME_LIMIT_EXCEEDED]
    assert (job.attempts, job.expirations) == (1, 0)  # through the fence, not the reaper


def test_an_attempt_claimed_again_while_its_abandoned_attempt_runs_gets_its_own_limit():
    """Attempt 1 is blocked in C past its limit: its thread is given up on, its lease
    runs out, and the reaper of the same worker takes the job back; the worker claims
    attempt 2 while attempt 1's thread still sleeps. Keyed by job id, attempt 2's
    interrupt went to attempt 1's thread and attempt 3's was never raised (found by an
    outside trial). Keyed by attempt, attempts 2 and 3 each stop at their limit."""
    job = tasks.stuck_then_loops.enqueue()
    worker = work_until_failed([job.id], timeout=20, concurrency=2, reap_interval=0.5)
    job.refresh_from_db()
    kinds = [error["type"].rsplit(".", 1)[-1] for error in job.errors]
    assert kinds == ["LeaseExpiredError", "TimeLimitExceeded", "TimeLimitExceeded"], kinds
    assert job.attempts == 3 and worker.stats.timed_out == 3


def test_a_threaded_worker_whose_threads_are_stuck_past_their_limit_exits_to_be_restarted():
    """Blocked in C, the task cannot be interrupted: a new thread takes its place, and
    once more than half the worker's threads are stuck it stops with EXIT_TIME_LIMIT,
    for its supervisor to start a fresh process. The job's lease is no longer renewed:
    the reaper takes it back."""
    job = tasks.sleeps_past_its_limit.enqueue(seconds=3.0)  # lease 2 s, limit 0.5 s
    worker = Worker(concurrency=1, listen=False, poll_interval=0.05, reap_interval=0.2, grace=0.2)
    code = worker.run()
    assert code == EXIT_TIME_LIMIT
    assert "stuck in tasks past their time limit" in worker.stop_reason
    reaper = Reaper()
    wait_until(
        lambda: reaper.reap() and Job.objects.get(id=job.id).state == JobState.FAILED,
        timeout=10,
    )
    job.refresh_from_db()
    assert job.expirations == 1  # its lease ran out; the reaper ended it (1 attempt)


@pytest.mark.slow
def test_under_processes_the_child_running_a_task_past_its_hard_limit_is_replaced(
    start_worker, tmp_path, monkeypatch
):
    """`--processes`: a task blocked past its limit ends its child at once; the attempt is
    failed through the fence with TimeLimitExceeded (long before its 30 s sleep or even
    its lease), and the pool starts a new child, which runs the next job."""
    signal_log = tmp_path / "signals.log"
    monkeypatch.setenv("SKIPQUEUE_TEST_SIGNAL_LOG", str(signal_log))
    job = tasks.sleeps_past_its_limit.enqueue(seconds=30.0)
    worker = start_worker("--processes", "2", "--concurrency", "1")
    wait_until(
        lambda: Job.objects.get(id=job.id).state == JobState.FAILED,
        timeout=20,
        message="the job past its limit was not failed",
    )
    job.refresh_from_db()
    assert [error["type"] for error in job.errors] == [TIME_LIMIT_EXCEEDED]
    assert job.expirations == 0
    worker.wait_for_output("ending this worker process")
    # Counted in the queue's minutes as an executor counts a failed attempt: the exit
    # writes the counts after the fail, before its log line (not counted before: a trial).
    assert QueueMinute.objects.aggregate(n=Sum("failed"))["n"] == 1
    worker.wait_for_output("replacing it")
    # The child that ended marked its row stopped, as a graceful stop does: the admin
    # and the pruner see it dead at once, and no enqueue notifies for it. Before, its
    # heartbeat went stale until the pruner took the row (an outside trial, F5).
    ended = WorkerProcess.objects.filter(stopped_at__isnull=False)
    assert ended.count() == 1 and ended.get().waiting_since is None
    # job_failed was sent, as the executor sends it (before, the exit sent nothing).
    assert signal_log.read_text().split("\n") == [f"job_failed {job.id}", ""]
    after = tasks.add.enqueue(2, 3)
    wait_until(lambda: Job.objects.get(id=after.id).state == JobState.DONE, timeout=15)


@pytest.mark.slow
def test_a_child_ending_past_a_time_limit_started_no_job_it_then_killed(start_worker):
    """A child with one thread takes both jobs in its first claim (prefetch 4): one
    stuck past its limit, and one that waits in its buffer behind it.
    The thread taking the stuck one's place is started only once that one has stopped,
    so the waiting job is released by the exit and run by the next child, not started
    a moment before the exit killed it and left to its 30 s lease (an outside trial, 4
    of 4 runs). A thread whose task stopped at the interrupt is replaced as before."""
    stuck = tasks.sleeps_past_its_limit.using(priority=10).enqueue(seconds=30.0)
    waiting = tasks.record.using(lease=30.0).enqueue(sleep=2.0)
    worker = start_worker("--processes", "2", "--concurrency", "1", "--prefetch", "4")
    worker.wait_for_output("ending this worker process")
    wait_until(
        lambda: Job.objects.get(id=waiting.id).state == JobState.DONE,
        timeout=15,  # well inside the lease of a job the exit would have killed
        message="the job waiting behind the stuck one was left to its lease",
    )
    waiting.refresh_from_db()
    assert waiting.expirations == 0
    assert Run.objects.filter(job_id=waiting.id).count() == 1  # started once, not killed
    stuck.refresh_from_db()
    assert stuck.state == JobState.FAILED


@pytest.mark.slow
def test_a_child_ending_past_a_time_limit_fails_every_attempt_it_gave_up_on(start_worker):
    """A child with two threads takes two jobs in its first claim, both blocked past
    their limit: its exit fails both through the fence, not the first alone with the
    other left to its 30 s lease (an outside trial: 5 of 5 runs at --concurrency 2)."""
    stuck = [tasks.sleeps_past_its_limit.using(lease=30.0).enqueue(seconds=30.0) for _ in range(2)]
    worker = start_worker("--processes", "2", "--concurrency", "2", "--prefetch", "4")
    worker.wait_for_output("ending this worker process")
    wait_until(
        lambda: (
            Job.objects.filter(id__in=[job.id for job in stuck], state=JobState.FAILED).count() == 2
        ),
        timeout=15,  # well inside their lease
        message="an attempt the exiting child had given up on was left to its lease",
    )
    for job in stuck:
        job.refresh_from_db()
        assert [error["type"] for error in job.errors] == [TIME_LIMIT_EXCEEDED]
        assert job.expirations == 0
    assert QueueMinute.objects.aggregate(n=Sum("failed"))["n"] == 2


def test_a_child_whose_task_stops_at_its_limit_replaces_the_thread_and_goes_on():
    """In a child of --processes (`exit_on_time_limit`), the thread whose task stopped
    at the limit's interrupt is replaced once it has stopped, a second later: with one
    thread, the jobs after it run, and the process does not end."""
    looping = tasks.loops_past_a_short_limit.enqueue()  # pure Python: stops at once
    with working(exit_on_time_limit=True) as worker:
        wait_until(lambda: Job.objects.get(id=looping.id).state == JobState.FAILED, timeout=10)
        after = [tasks.add.enqueue(n, n) for n in range(3)]
        wait_until(
            lambda: (
                Job.objects.filter(id__in=[job.id for job in after], state=JobState.DONE).count()
                == 3
            ),
            timeout=10,
            message="no thread took the stopped one's place",
        )
        assert len(worker.threads.group("executors")) == 1
    assert worker.stats.timed_out == 1 and not worker.stuck_exit


@pytest.mark.slow
def test_a_child_ending_past_a_time_limit_strands_no_claimed_job_and_acks_its_successes(
    start_worker,
):
    """The child ends while its dispatcher claims and acks no-op jobs as fast as it can:
    every job it had claimed and not started is released (none waits for its 30 s lease),
    and every success it had not yet acknowledged is acknowledged before the exit (none
    is reaped to run again)."""
    tasks.add.enqueue_many([((n, n), {}) for n in range(30_000)])
    stuck = tasks.sleeps_past_its_limit.using(priority=10).enqueue(seconds=30.0)
    worker = start_worker("--processes", "2", "--concurrency", "2")
    worker.wait_for_output("ending this worker process")
    wait_until(
        lambda: not Job.objects.filter(task=tasks.add.name).exclude(state=JobState.DONE).exists(),
        timeout=20,  # well inside the 30 s lease of a job stranded by the exit
        message="jobs claimed by the child that ended were left to their lease",
    )
    # None was taken back by the reaper (an unacked success would have been, and run
    # again). A released job that had not started counts a second attempt when claimed
    # again, though it ran once: attempts say nothing here.
    assert not Job.objects.filter(task=tasks.add.name, expirations__gt=0).exists()
    assert Job.objects.get(id=stuck.id).state == JobState.FAILED
