"""The outside trial of issue 27's features (an engineer given the docs, not the tests,
tried to break expires, time limits, rate limits, intervals and Retry): each finding
that was a bug, kept as the test that showed it. See docs/explanation/failure-model.md,
C1 to C8."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import transaction

from django_skipqueue import task
from django_skipqueue.exceptions import ConfigurationError, InvalidJobError
from django_skipqueue.models import Job
from django_skipqueue.testing import run_jobs
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.tasks import trial_keyed, trial_rated, trial_unique_expiring


@pytest.mark.django_db
def test_rate_limited_backlog_starves_keyed_jobs_of_same_queue() -> None:
    """flow-control.md: "other tasks of the queue are not held back" / "Jobs waiting for
    their key's slot do not hold up other due jobs". A backlog of a rate-limited task
    whose bucket is empty fills the limited claim's candidates, so a keyed job of the
    same queue is never claimed while the backlog waits."""
    trial_rated.enqueue_many([((i,), {}) for i in range(50)])
    keyed = trial_keyed.enqueue("acme")
    # the bucket allows 2 an hour: two start, then it is empty
    first = run_jobs(["default"])
    ran = {execution.job_id for execution in first}
    # a worker with 4 free threads asks the limited claim for 4 jobs
    claimed, _ = Job.objects.claim_limited(queues=["default"], limits={}, limit=4)
    ran |= {job.id for job in claimed}
    assert keyed.id in ran, (
        f"keyed job never claimed; ran {len(first)} via run_jobs, limited claim gave "
        f"{[j.task for j in claimed]}"
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_rate_limited_backlog_starves_a_queue_limited_queue_in_a_real_worker(start_worker) -> None:
    """flow-control.md: rate_limit: "Other tasks of the same queue are claimed as usual
    meanwhile." With a QUEUE_LIMITS entry on the queue (concurrency 10), a plain task of
    that queue is never run while a rate-limited backlog enqueued before it waits."""
    from tests.processes import wait_until
    from tests.testapp.tasks import add

    trial_rated.using(queue_name="rq").enqueue_many([((i,), {}) for i in range(500)])
    plain = add.using(queue_name="rq").enqueue(1, 2)
    start_worker(
        "--concurrency", "4", "--queue", "rq",
        settings={"QUEUE_LIMITS": {"rq": {"concurrency": 10}}},
    )  # fmt: skip
    wait_until(lambda: Job.objects.get(id=plain.id).state == "done", timeout=8)


@pytest.mark.django_db(transaction=True)
def test_an_expired_unique_job_swallows_new_enqueues_until_reaped() -> None:
    """tasks.md: expires: "a job not started by then never runs"; unique_key: "While an
    unfinished (pending or running) job of the task holds a key, no second one is added".
    A pending job past its expires_at still holds its key until the reaper ends it (every
    REAP_INTERVAL_SECONDS, 10 s by default): an enqueue meanwhile returns the dead holder
    and writes nothing, so the caller's work never runs at all."""
    first = trial_unique_expiring.enqueue("acct-1", n=1)
    time.sleep(1.3)  # no worker ran it: it is past its expiry now
    second = trial_unique_expiring.enqueue("acct-1", n=2)  # a new, fresh request
    run_jobs()  # a worker comes back
    Job.objects.end_expired()  # and its reaper runs
    runs = Job.objects.filter(task=trial_unique_expiring.name)
    states = list(runs.values_list("id", "state", "kwargs"))
    assert second.id != first.id or runs.filter(state="done").exists(), (
        f"the second enqueue got the expired holder {first.id} back and nothing ever runs: {states}"
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_async_task_looping_past_its_time_limit_is_stopped(start_worker) -> None:
    """tasks.md time_limit: an async task is cancelled at its next await past the limit.
    An `async def` task (the docs say async tasks run to completion) loops in Python
    with awaits past its 1 s limit."""
    job = tasks.trial_async_loops.enqueue(8.0)
    start_worker("--concurrency", "4")
    wait_until(lambda: Job.objects.get(id=job.id).state == "running", timeout=10)
    wait_until(lambda: Job.objects.get(id=job.id).state != "running", timeout=6)
    job.refresh_from_db()
    assert job.state == "failed" and "TimeLimitExceeded" in job.last_error


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_sigterm_gives_away_the_slot_of_a_keyed_job_past_its_limit_while_its_code_runs(
    start_worker,
) -> None:
    """tasks.md: "A job holding a concurrency slot keeps its lease until its code stops";
    failure-model C7: "the next job of the key never starts beside it". A worker told to
    stop (SIGTERM, a deploy) while such a job is past its time limit, its thread blocked
    in C: the job's failure is the process's last write, so the key's next job never
    starts on another worker while the stuck code can still run."""
    from tests.testapp.models import Span

    first = tasks.outlives_its_timeout_per_account.enqueue("acct", 10.0)
    a = start_worker("--concurrency", "1", "--grace", "1")
    wait_until(lambda: Span.objects.filter(job_id=first.id).exists(), timeout=10)
    second = tasks.outlives_its_timeout_per_account.enqueue("acct", 0.1)
    a.wait_for_output("job timed out", timeout=5)
    b = start_worker("--concurrency", "1", "--reap-interval", "0.5")
    b.wait_for_output("worker started", timeout=10)
    a.signal()
    overlap = []
    while a.process.poll() is None:
        time.sleep(0.02)
    # The key's next job never started before the stuck attempt's failure was written,
    # the stopping process's last write, which its exit follows within milliseconds.
    stuck_ended = Job.objects.get(id=first.id).finished_at
    later = Span.objects.filter(job_id=second.id, started_at__lt=stuck_ended)
    if later.exists():
        overlap.append((stuck_ended, list(later.values_list("job_id", "started_at"))))
    # 0: the SIGTERM came first; 3: the task's grace ran out first. Either way the job
    # failed last, and the key's next job never ran beside it.
    assert a.process.returncode in (0, 3)
    assert Job.objects.get(id=first.id).state == "failed"
    assert not overlap, (
        f"slot freed (job {first.id} released / next job started) while worker A's thread "
        f"was still in job {first.id}'s code: {overlap[:3]} ... {overlap[-1:]}"
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_threaded_worker_with_all_threads_stuck_exits_3_promptly(start_worker) -> None:
    """tasks.md: a worker whose task does not stop past its hard limit stops with exit
    code 3, for its supervisor to restart it: with all four threads stuck, at once (no
    stop grace spent waiting for them)."""
    tasks.sleeps_past_its_limit.enqueue_many([((30.0,), {})] * 4)
    worker = start_worker("--concurrency", "4")
    started = time.monotonic()
    code = worker.wait(timeout=15)
    assert code == 3, code
    assert time.monotonic() - started < 8


@pytest.mark.django_db(transaction=True)
def test_a_huge_expires_breaks_the_callers_transaction() -> None:
    """tasks.md: a bad call "raises InvalidJobError ... before any SQL, so the caller's
    transaction stays usable" (and lease/time limits are clamped or refused). A huge
    `expires` passes the check and the database refuses it: DataError, which aborts the
    caller's transaction (the order saved just before is lost with it)."""
    with transaction.atomic():
        Job.objects.none()  # the caller's own work would be here
        with pytest.raises(InvalidJobError):
            tasks.add.using(expires=timedelta(days=999_999_999)).enqueue(1, 2)
        assert Job.objects.count() >= 0  # the transaction is still usable


@pytest.mark.django_db(transaction=True)
def test_an_overflowing_expires_in_seconds_raises_overflowerror() -> None:
    with pytest.raises(InvalidJobError):
        tasks.add.using(expires=10**12).enqueue(1, 2)


def _rated() -> None: ...


@pytest.mark.parametrize("rate", ["1" * 40 + "/s", "\u0661\u0660/s", "0/s", "10 per second"])
def test_a_rate_limit_the_row_cannot_hold_is_refused_where_it_is_declared(rate):
    with pytest.raises(ConfigurationError, match="rate_limit of"):
        task(rate_limit=rate)(_rated)


def test_a_rate_limit_is_stored_in_one_spelling():
    assert task(name="tests.trial.spelled", rate_limit=" 10 / minute ")(_rated).rate_limit == (
        "10/m"
    )
    from django_skipqueue.tasks.registry import registry

    registry.unregister("tests.trial.spelled")


@pytest.mark.django_db(transaction=True)
def test_a_job_that_would_expire_before_it_is_due_is_refused():
    with pytest.raises(InvalidJobError, match="would never run"):
        tasks.add.using(run_after=timedelta(hours=2), expires=timedelta(hours=1)).enqueue(1, 2)


@pytest.mark.django_db(transaction=True)
def test_one_reaper_pass_ends_a_mass_expiry_in_batches():
    from django.utils import timezone

    from django_skipqueue.queue import reap

    past = timezone.now() - timedelta(seconds=1)
    tasks.add.using(expires=past).enqueue_many([((1, 2), {})] * 25, ids_only=True)
    original = reap.EXPIRE_BATCH_SIZE
    reap.EXPIRE_BATCH_SIZE = 10
    try:
        assert Job.objects.reap().expired == 25  # three batches, one pass
    finally:
        reap.EXPIRE_BATCH_SIZE = original
