"""Poison jobs and pauses: T2, T22-T26, T31, and the issue's poison-job list."""

from __future__ import annotations

import signal
import time
from datetime import timedelta

import pytest
from django.db.models.functions import Now

from django_skipqueue.models import Job, JobState
from tests.chaos.harness import check
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def finished(ids: list[int]) -> bool:
    return not Job.objects.filter(id__in=ids).exclude(state__in=["done", "failed"]).exists()


def test_t2_a_paused_worker_loses_its_jobs_and_its_late_writes_are_refused(supervisor):
    ids = [job.id for job in tasks.probe.using(lease=1.0).enqueue_many([((), {"ms": 1500})] * 4)]
    paused = supervisor.start("--concurrency", "4", "--reap-interval", "0")
    wait_until(lambda: Run.objects.filter(job_id__in=ids).count() == 4, timeout=20)

    paused.signal(signal.SIGSTOP)
    supervisor.start("--concurrency", "4", "--reap-interval", "0.2")
    wait_until(lambda: Job.objects.filter(id__in=ids, attempts=2).count() == 4, timeout=20)
    paused.signal(signal.SIGCONT)  # its jobs finish now, their acks are stale

    wait_until(lambda: finished(ids), timeout=30)
    wait_until(lambda: paused.output().count("job lease lost") >= 4, timeout=10)
    report = check(ids, supervisor.deadlocks_at_start)
    print(f"\nT2 {report} refused={paused.output().count('job lease lost')}")
    assert report.violations() == []
    assert report.figures["done"] == 4
    assert report.figures["acked_done_twice"] == 0


def test_t4_a_released_attempt_can_never_ack_the_next_claim():
    """ABA (finding 0.1, docs/explanation/failure-model.md): 1,000 trials of release,
    reclaim, stale ack."""
    tasks.add.enqueue(1, 1)
    refused = accepted = 0
    for _ in range(1000):
        [a] = Job.objects.claim(queues=["default"])
        assert Job.objects.release(a.id, a.attempts)  # graceful stop with grace 0
        [b] = Job.objects.claim(queues=["default"])
        refused += not Job.objects.ack(a.id, a.attempts)
        assert Job.objects.release(b.id, b.attempts)
    [last] = Job.objects.claim(queues=["default"])
    accepted += Job.objects.ack(last.id, last.attempts)
    assert (refused, accepted) == (1000, 1)
    job = Job.objects.get()
    assert (job.attempts, job.releases) == (2001, 2000)


def test_t22_an_always_raising_task_fails_after_its_attempts_with_backoff(supervisor):
    job = tasks.t22_always_raises.enqueue()
    others = [j.id for j in tasks.probe.using(priority=-10).enqueue_many([((), {"ms": 5})] * 50)]
    supervisor.start("--concurrency", "2", "--poll-interval", "0.05")

    wait_until(lambda: Job.objects.get(id=job.id).state == JobState.FAILED, timeout=30)
    wait_until(lambda: finished(others), timeout=30)

    job.refresh_from_db()
    assert (job.attempts, len(job.errors)) == (5, 5)
    assert all("RuntimeError: always" in entry["traceback"] for entry in job.errors)
    # Gaps between attempts follow the policy: 0.2, 0.4, 0.8, 1.6 s (+/- 10 %, plus pickup).
    from datetime import datetime

    times = [datetime.fromisoformat(entry["at"]) for entry in job.errors]
    gaps = [(b - a).total_seconds() for a, b in zip(times, times[1:], strict=False)]
    for gap, nominal in zip(gaps, [0.2, 0.4, 0.8, 1.6], strict=True):
        assert nominal * 0.9 <= gap <= nominal * 1.1 + 0.5, gaps
    assert Job.objects.filter(id__in=others, state="done").count() == 50


def test_t23_a_hung_task_fails_once_and_its_worker_is_restarted_while_others_flow(supervisor):
    """The task sleeps in C past its 1 s limit and never reaches a safe point: a second
    later its worker stops (the other jobs get the stop's grace), fails the attempt
    through the fence (not retried: Celery's default for a time limit; its 0.6 s lease
    was renewed, so no expiry) and exits with code 3; this test, as the supervisor,
    starts a new worker, which runs what the first gave back."""
    hung = tasks.t23_hangs.enqueue(30)
    others = [j.id for j in tasks.probe.enqueue_many([((), {"ms": 20})] * 150)]
    worker = supervisor.start("--concurrency", "8", "--reap-interval", "0.2")
    assert worker.wait(timeout=40) == 3
    supervisor.workers.remove(worker)
    supervisor.retired.append(worker)
    hung.refresh_from_db()
    print(f"\nT23 attempts={hung.attempts} expirations={hung.expirations}")
    assert (hung.state, hung.attempts, hung.expirations) == (JobState.FAILED, 1, 0)
    assert hung.errors[-1]["type"] == "django_skipqueue.exceptions.TimeLimitExceeded"
    assert worker.output().count("job timed out") == 1
    supervisor.start("--concurrency", "8", "--reap-interval", "0.2")
    wait_until(lambda: finished(others), timeout=40)
    assert Job.objects.filter(id__in=others, state="done").count() == 150


@pytest.mark.parametrize("mode", ["exit", "segv"])
def test_t24_a_task_that_kills_its_process_ends_failed_after_its_attempts(supervisor, mode):
    job = tasks.probe.using(lease=1.0, max_attempts=3).enqueue(mode=mode)
    others = [j.id for j in tasks.probe.enqueue_many([((), {"ms": 5})] * 30)]
    restarts = 0
    worker = supervisor.start("--reap-interval", "0.2", "--concurrency", "2")
    deadline = time.monotonic() + 60
    while not finished([job.id, *others]):
        assert time.monotonic() < deadline, "poison job not settled"
        if worker.process.poll() is not None:  # the poison job killed it: restart it
            supervisor.workers.remove(worker)
            supervisor.retired.append(worker)
            restarts += 1
            worker = supervisor.start("--reap-interval", "0.2", "--concurrency", "2")
        time.sleep(0.05)
    job.refresh_from_db()
    print(f"\nT24 mode={mode} restarts={restarts} attempts={job.attempts}")
    assert (job.state, job.attempts, job.expirations) == (JobState.FAILED, 3, 3)
    assert restarts <= 3
    assert Job.objects.filter(id__in=others, state="done").count() == 30


def test_t25_a_task_leaving_a_transaction_open_is_rolled_back_and_recorded():
    from django.db import connection

    from django_skipqueue.runtime.executor import Outcome, execute

    tasks.leaves_transaction_open.enqueue()
    [job] = Job.objects.claim(queues=["default"])
    execution = execute(job)
    assert execution.outcome in (Outcome.RETRYING, Outcome.FAILED)
    assert not connection.in_atomic_block
    job.refresh_from_db()
    assert "TransactionLeftOpenError" in job.errors[0]["type"]
    assert not Run.objects.filter(job_id=0).exists()  # the task's write was rolled back
    tasks.add.enqueue(1, 2)
    [next_job] = Job.objects.claim(queues=["default"])
    assert execute(next_job).outcome is Outcome.SUCCEEDED


def test_t26_a_worker_never_imports_a_task_name_from_a_row(monkeypatch):
    import importlib

    from django_skipqueue.testing import run_jobs

    def refuse(name, *args, **kwargs):
        raise AssertionError(f"the worker tried to import {name!r}")

    Job.objects.create(task="os.system", args=["true"], lease=timedelta(seconds=30), max_attempts=1)
    monkeypatch.setattr(importlib, "import_module", refuse)
    [execution] = run_jobs()
    job = Job.objects.get()
    assert job.state == JobState.FAILED
    assert "no task named 'os.system' is registered" in job.last_error
    assert execution.error is not None


def test_t26_rolling_deploy_jobs_for_a_task_only_new_workers_know_end_done():
    """Half the workers lack task X: with backoff and attempts left, X still ends done."""
    from django_skipqueue.tasks.registry import registry
    from django_skipqueue.testing import run_jobs

    ids = [j.id for j in tasks.add.using(max_attempts=3).enqueue_many([((1, 1), {})] * 20)]
    add = registry.get("tests.testapp.tasks.add")
    registry.unregister(add.name)  # an old worker, deployed before the task existed
    try:
        old = run_jobs(limit=10)
    finally:
        registry.register(add)
    assert {execution.outcome.value for execution in old} == {"retried"}
    wait_until(lambda: Job.objects.due().count() == 20, timeout=10)
    run_jobs()
    assert Job.objects.filter(id__in=ids, state="done").count() == 20


def test_t31_a_retry_longer_than_the_lease_runs_once_per_retry(supervisor):
    job = tasks.retry_once.using(lease=0.5).enqueue(delay=2.5)  # 5 x lease
    supervisor.start("--reap-interval", "0.1")
    wait_until(lambda: Job.objects.get(id=job.id).releases == 1, timeout=20)
    assert Job.objects.filter(id=job.id, run_at__gt=Now() + timedelta(seconds=1.5)).exists()
    time.sleep(1.5)  # inside the delay: nothing may run
    assert Job.objects.get(id=job.id).state == JobState.PENDING
    wait_until(lambda: Job.objects.get(id=job.id).state == JobState.DONE, timeout=10)
    job.refresh_from_db()
    assert (job.attempts, job.expirations) == (2, 0)
    assert Run.objects.filter(job_id=job.id).count() == 1  # the second run returns early
