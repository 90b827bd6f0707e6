"""Flow control against the database: pause, concurrency and rate limits, cancellation.

Limits are enforced by `JobManager.claim_limited` under locks that hold across
processes; these tests race real threads on real connections. The 4-process checks are
in tests/chaos/test_flow_control.py.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models import F
from django.db.models.functions import Now

from django_skipqueue.conf.limits import QueueLimit, parse_rate, queue_limits
from django_skipqueue.exceptions import ConfigurationError, JobCancelled
from django_skipqueue.models import Job, Queue
from django_skipqueue.queue.base import Renewal
from django_skipqueue.runtime.worker import Worker
from django_skipqueue.testing import run_jobs
from tests.conftest import set_lease
from tests.processes import run_in_threads, wait_until
from tests.testapp import tasks

pytestmark = pytest.mark.django_db


@contextmanager
def listening_on(channel: str) -> Iterator[Any]:
    """A connection of its own to the test database, LISTENing on `channel`."""
    import psycopg

    settings = connection.settings_dict
    with psycopg.connect(
        dbname=settings["NAME"], host=settings["HOST"], port=settings["PORT"] or 5432,
        user=settings["USER"], autocommit=True,
    ) as listener:  # fmt: skip
        listener.execute(f'LISTEN "{channel}"')
        yield listener


def claim_limited(limits: dict[str, QueueLimit], queues=("default",), limit=10, worker=None):
    return Job.objects.claim_limited(queues=list(queues), limits=limits, limit=limit, worker=worker)


# -- pause -------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_paused_queue_is_not_claimed_and_its_pause_is_a_row():
    tasks.add.enqueue(1, 2)
    tasks.add.using(queue_name="other").enqueue(3, 4)
    assert Queue.objects.pause(["default"], by="ops") == 1
    assert Queue.objects.pause(["default"]) == 0  # already paused
    worker = Worker(queues=["default", "other"], burst=True, listen=False, reap_interval=0)
    worker.run()
    assert list(Job.objects.filter(state="done").values_list("queue_name", flat=True)) == ["other"]
    row = Queue.objects.get(name="default")
    assert row.is_paused and row.paused_by == "ops"
    assert Queue.objects.resume(["default"]) == 1
    Worker(burst=True, listen=False, reap_interval=0).run()
    assert not Job.objects.exclude(state="done").exists()


@pytest.mark.django_db(transaction=True)
def test_a_pause_notifies_the_control_channel():
    with listening_on("skipqueue!control") as listener:
        Queue.objects.pause(["default"])
        got = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
    assert got == [""]  # empty, like every NOTIFY of ours


# -- concurrency per queue ---------------------------------------------------------------


def test_a_queue_limit_claims_only_its_free_slots():
    tasks.add.enqueue_many([((1, 2), {})] * 6)
    limits = {"default": QueueLimit(concurrency=2)}
    first, _ = claim_limited(limits)
    assert len(first) == 2
    second, retry_in = claim_limited(limits)
    assert second == [] and retry_in is not None and retry_in <= 0.1
    assert Job.objects.ack(first[0].id, first[0].attempts, 3)
    third, _ = claim_limited(limits)
    assert len(third) == 1


def test_an_expired_lease_frees_its_slot():
    tasks.add.enqueue_many([((1, 2), {})] * 3)
    limits = {"default": QueueLimit(concurrency=1)}
    (first,), _ = claim_limited(limits)
    set_lease(first.id, -1)  # its worker died: the lease ran out, not yet reaped
    second, _ = claim_limited(limits)
    assert len(second) == 1


@pytest.mark.django_db(transaction=True)
def test_racing_claimers_never_pass_a_queue_limit():
    tasks.add.enqueue_many([((1, 2), {})] * 40)
    limits = {"default": QueueLimit(concurrency=3)}
    start, lock, peaks = threading.Barrier(8), threading.Lock(), []

    def claimer() -> None:
        start.wait(timeout=10)
        for _ in range(10):
            claimed, _ = claim_limited(limits, limit=2)
            running = Job.objects.filter(state="running").count()
            with lock:
                peaks.append(running)
            for job in claimed:
                Job.objects.ack(job.id, job.attempts, None)

    run_in_threads(claimer, 8)
    assert max(peaks) <= 3
    assert Job.objects.filter(state="done").count() > 3


# -- concurrency per key -----------------------------------------------------------------


def test_jobs_sharing_a_key_run_one_at_a_time_and_do_not_block_others():
    blocked = [tasks.per_account.enqueue("acme") for _ in range(3)]
    other = tasks.per_account.enqueue("globex")
    plain = tasks.add.enqueue_many([((1, 2), {})] * 3)
    assert blocked[0].concurrency_key == 'account="acme"'
    fast = Job.objects.claim(queues=["default"], limit=10)
    assert sorted(job.id for job in fast) == sorted(job.id for job in plain)  # no keyed job
    claimed, _ = claim_limited({}, limit=10)
    assert sorted(job.id for job in claimed) == sorted([blocked[0].id, other.id])
    again, retry_in = claim_limited({}, limit=10)
    assert again == []
    Job.objects.ack(blocked[0].id, 1, None)
    (nxt,), _ = claim_limited({}, limit=10)
    assert nxt.id == blocked[1].id


def test_a_key_and_its_limit_can_be_given_at_enqueue():
    jobs = [
        tasks.add.using(concurrency_key="report:7", concurrency_limit=2).enqueue(1, 2)
        for _ in range(3)
    ]
    assert {(job.concurrency_key, job.concurrency_limit) for job in jobs} == {("report:7", 2)}
    claimed, _ = claim_limited({}, limit=10)
    assert len(claimed) == 2


@pytest.mark.django_db(transaction=True)
def test_racing_claimers_never_run_two_jobs_of_one_key():
    tasks.per_account.enqueue_many([(("acme",), {})] * 20)
    start, lock, seen = threading.Barrier(6), threading.Lock(), []

    def claimer() -> None:
        start.wait(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and Job.objects.exclude(state="done").exists():
            claimed, _ = claim_limited({}, limit=3)
            running = Job.objects.filter(state="running").count()
            with lock:
                seen.append(running)
            for job in claimed:
                Job.objects.ack(job.id, job.attempts, None)

    run_in_threads(claimer, 6)
    assert max(seen) <= 1
    assert Job.objects.filter(state="done").count() == 20


# -- rate ----------------------------------------------------------------------------------


def test_a_rate_limit_lets_through_its_rate_then_refills_on_the_database_clock():
    tasks.add.enqueue_many([((1, 2), {})] * 30)
    limits = {"default": QueueLimit(rate=5, period=1.0)}
    first, _ = claim_limited(limits, limit=20)
    assert len(first) == 5  # a full bucket: one second's worth
    second, retry_in = claim_limited(limits, limit=20)
    assert len(second) <= 1 and retry_in is not None and 0 < retry_in <= 0.2
    Queue.objects.filter(name="default").update(
        rate_refilled_at=F("rate_refilled_at") - timedelta(seconds=1)
    )
    third, _ = claim_limited(limits, limit=20)
    assert 4 <= len(third) <= 5


def test_queue_limits_are_read_from_settings_and_bad_ones_are_named(settings):
    settings.SKIPQUEUE = {"QUEUE_LIMITS": {"reports": {"concurrency": 3, "rate": "100/m"}}}
    assert queue_limits() == {"reports": QueueLimit(concurrency=3, rate=100, period=60.0)}
    assert parse_rate("5000/h") == (5000, 3600.0)
    for bad, message in [
        ({"reports": {"concurrency": 0}}, "concurrency"),
        ({"reports": {"rate": "fast"}}, "'10/s'"),
        ({"reports": {"burst": 3}}, "unknown keys burst"),
    ]:
        settings.SKIPQUEUE = {"QUEUE_LIMITS": bad}
        with pytest.raises(ConfigurationError, match=message):
            queue_limits()


# -- cancelling a running job ----------------------------------------------------------------


def test_cancel_ends_pending_jobs_and_asks_running_ones_to_stop(worker_process):
    pending = tasks.add.enqueue(1, 2)
    running = tasks.add.enqueue(3, 4)
    Job.objects.filter(id=pending.id).update(run_at=Now() + timedelta(hours=1))
    (claimed,) = Job.objects.claim(queues=["default"], worker=worker_process)
    assert claimed.id == running.id
    assert Job.objects.cancel([pending.id, running.id], by="ops") == 2
    pending.refresh_from_db()
    assert (pending.state, pending.cancelled_by) == ("cancelled", "ops")
    assert Job.objects.renewal(running.id, 1) is Renewal.CANCEL_REQUESTED
    assert Job.objects.end_cancelled(running.id, 1)
    running.refresh_from_db()
    assert (running.state, running.cancelled_by) == ("cancelled", "ops")
    assert running.cancel_requested_at is not None and running.finished_at is not None


@pytest.mark.django_db(transaction=True)
def test_jobs_cancelled_while_waiting_in_the_prefetch_buffer_never_run():
    from tests.testapp.models import Run, Span

    tasks.occupy.using(priority=10).enqueue(seconds=1.5)  # holds the only thread
    buffered = [job.id for job in tasks.record.enqueue_many([((), {})] * 2)]
    worker = Worker(concurrency=1, prefetch=2, burst=True, listen=False, reap_interval=0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Span.objects.exists(), timeout=10, message="occupy never started")
        assert set(Job.objects.filter(id__in=buffered).values_list("state", flat=True)) == {
            "running"  # claimed ahead, into the buffer
        }
        assert Job.objects.cancel(buffered, by="ops") == 2
    finally:
        thread.join(timeout=30)
    assert not Run.objects.filter(job_id__in=buffered).exists()
    assert set(Job.objects.filter(id__in=buffered).values_list("state", flat=True)) == {"cancelled"}
    assert worker.stats.outcomes.get("cancelled") == 2


def test_a_task_ignoring_a_cancel_loses_its_lease_and_the_reaper_ends_it_cancelled(worker_process):
    job = tasks.add.enqueue(1, 2)
    (claimed,) = Job.objects.claim(queues=["default"], worker=worker_process)
    Job.objects.cancel([job.id])
    assert not Job.objects.renew(job.id, 1)  # the renewal stops: the lease runs out
    set_lease(job.id, -1)
    assert not Job.objects.ack(job.id, 1, 3)  # the fence refuses the late ack
    assert Job.objects.reap().cancelled == 1
    job.refresh_from_db()
    assert job.state == "cancelled" and job.attempts == 1  # never retried


def test_extend_lease_and_check_cancelled_raise_job_cancelled():
    job = tasks.cancellable.enqueue(how="extend", seconds=0.1)
    Job.objects.claim(queues=["default"])
    Job.objects.cancel([job.id])
    from django_skipqueue.tasks.context import TaskContext

    context = TaskContext(
        job_id=job.id, attempt=1, max_attempts=5, task_name=job.task,
        queue_name="default", database="default",
    )  # fmt: skip
    assert context.cancel_requested
    with pytest.raises(JobCancelled):
        context.extend_lease(5)
    with pytest.raises(JobCancelled):
        context.check_cancelled()


def test_retrying_a_cancelled_job_clears_its_cancel_request(worker_process):
    job = tasks.add.enqueue(1, 2)
    Job.objects.claim(queues=["default"], worker=worker_process)
    Job.objects.cancel([job.id])
    Job.objects.end_cancelled(job.id, 1)
    assert Job.objects.retry_now([job.id]) == 1
    job.refresh_from_db()
    assert (job.state, job.cancel_requested_at, job.cancelled_by) == ("pending", None, "")
    assert run_jobs()[0].outcome == "succeeded"


# -- with a real worker process ----------------------------------------------------------


def spans_started_after(moment):
    from tests.testapp.models import Span

    return Span.objects.filter(started_at__gt=moment)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_pause_reaches_a_running_worker_within_a_second_and_resume_too(start_worker):
    worker = start_worker("--concurrency", "2")
    worker.wait_for_output("worker listening")
    tasks.occupy.enqueue_many([((), {"seconds": 0.05})] * 2000)
    wait_until(lambda: spans_started_after(Now() - timedelta(days=1)).exists(), timeout=10)
    Queue.objects.pause(["default"])
    paused_at = Queue.objects.get(name="default").paused_at
    time.sleep(1.5)  # the pause must hold: nothing may start in it after its first second
    late = spans_started_after(paused_at + timedelta(seconds=1))
    assert not late.exists()
    Queue.objects.resume(["default"])
    wait_until(lambda: spans_started_after(paused_at + timedelta(seconds=1)).exists(), timeout=3)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["flag", "extend"])
def test_a_running_task_sees_a_cancel_and_its_job_ends_cancelled(start_worker, how):
    job = tasks.cancellable.enqueue(how=how)
    start_worker("--concurrency", "1")
    wait_until(lambda: Job.objects.filter(id=job.id, state="running").exists(), timeout=10)
    time.sleep(0.2)
    Job.objects.cancel([job.id], by="ops")
    # The worker renews every third of the 1.5 s lease: the task hears of it by then.
    wait_until(lambda: Job.objects.filter(id=job.id, state="cancelled").exists(), timeout=3)
    job.refresh_from_db()
    assert (job.attempts, job.cancelled_by, job.result) == (1, "ops", None)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_task_that_ignores_a_cancel_is_cut_off_by_its_lease(start_worker):
    job = tasks.cancellable.enqueue(how="ignore", seconds=4.0)
    worker = start_worker("--concurrency", "1", "--reap-interval", "0.5")
    wait_until(lambda: Job.objects.filter(id=job.id, state="running").exists(), timeout=10)
    Job.objects.cancel([job.id])
    wait_until(lambda: Job.objects.filter(id=job.id, state="cancelled").exists(), timeout=5)
    worker.wait_for_output("job lease lost", timeout=10)  # its late success was refused
    job.refresh_from_db()
    assert job.attempts == 1 and job.result is None


# -- the plans of the new claim paths ------------------------------------------------------


@pytest.fixture
def realistic_table():
    """100,000 done, 10,000 plain pending, 2,000 keyed pending (200 keys), 50 keyed running."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
                lease, attempts, max_attempts, expirations, releases, last_error, errors,
                created_at, finished_at, leased_until, concurrency_key, concurrency_limit)
            SELECT 'tests.testapp.tasks.add', '[]', '{}', 'default', 0,
                   CASE WHEN n <= 100000 THEN 'done' WHEN n <= 111950 THEN 'pending'
                        ELSE 'running' END,
                   now() - (n * interval '1 millisecond'), interval '5 minutes',
                   CASE WHEN n <= 100000 OR n > 111950 THEN 1 ELSE 0 END, 5, 0, 0, '', '[]',
                   now(), CASE WHEN n <= 100000 THEN now() END,
                   CASE WHEN n > 111950 THEN now() + interval '5 minutes' END,
                   CASE WHEN n > 110000 THEN 'key-' || (n % 200) END,
                   CASE WHEN n > 110000 THEN 1 END
            FROM generate_series(1, 112000) AS n
            """
        )
        cursor.execute("ANALYZE skipqueue_job")


def plan_of(queryset) -> str:
    with transaction.atomic():  # a locking query compiles only in a transaction
        return queryset.explain()


def test_the_keyed_probe_reads_only_the_keyed_claim_index(realistic_table):
    queryset = Job.objects.due().for_queues(["default"]).filter(concurrency_key__isnull=False)
    plan = queryset.explain()
    assert "skipqueue_job_keyed_claim_idx" in plan, plan
    assert "Seq Scan" not in plan, plan
    assert Job.objects.keyed_due(["default"])


def test_the_limited_claim_reads_keyed_jobs_by_index_and_counts_each_keys_running(
    realistic_table,
):
    queryset = Job.objects.claimable_under_limits(keyed_in=["default"], all_in=[])[:20]
    plan = plan_of(queryset)
    assert "skipqueue_job_keyed_claim_idx" in plan, plan
    assert "skipqueue_job_key_running_idx" in plan, plan  # the per-key count
    assert "Seq Scan on skipqueue_job" not in plan, plan  # (the small bucket table may be)
    assert "Sort" not in plan, plan  # in the index's order, not all keyed jobs sorted
    claimed, _ = claim_limited({}, limit=20)
    keys = [job.concurrency_key for job in claimed]
    assert len(claimed) == 20 and len(set(keys)) == 20  # one per key, the busy keys skipped
    busy = set(
        Job.objects.filter(state="running")
        .exclude(id__in=[job.id for job in claimed])
        .values_list("concurrency_key", flat=True)
    )
    assert not busy & set(keys)


def test_the_plain_claim_keeps_its_index_order_with_keyed_jobs_in_the_table(realistic_table):
    with transaction.atomic(), connection.cursor() as cursor:
        statement, params = Job.objects.claim_statement(["default"], limit=10)
        cursor.execute("EXPLAIN " + statement, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "skipqueue_job_claim_idx" in plan, plan
    assert "Sort" not in plan and "Seq Scan" not in plan, plan


def test_pausequeue_and_resumequeue_commands():
    from io import StringIO

    from django.core.management import CommandError, call_command

    out = StringIO()
    call_command("pausequeue", "default", "reports", stdout=out)
    assert Queue.objects.paused_names(["default", "reports", "other"]) == {"default", "reports"}
    assert Queue.objects.get(name="reports").paused_by == "manage.py pausequeue"
    call_command("resumequeue", "reports", stdout=out)
    assert Queue.objects.paused_names(["default", "reports"]) == {"default"}
    assert "paused 2 of 2" in out.getvalue() and "resumed 1 of 1" in out.getvalue()
    with pytest.raises(CommandError, match="queue name '' is invalid"):
        call_command("pausequeue", "", stdout=out)


def test_a_worker_starting_on_a_paused_queue_says_so():
    from django_skipqueue.management.preflight import queue_warnings

    tasks.add.enqueue(1, 2)
    Queue.objects.pause(["default"], by="ops")
    assert queue_warnings(["default"], "default") == [
        "queue 'default' is paused by ops: no job of it runs until `manage.py resumequeue default`"
    ]


def test_the_count_of_a_limited_queues_running_jobs_reads_the_lease_index(realistic_table):
    running = Job.objects.filter(state="running", queue_name="default", leased_until__gt=Now())
    plan = running.explain()
    assert "skipqueue_job_lease_idx" in plan, plan


@pytest.mark.django_db(transaction=True)
def test_a_keyed_enqueue_notifies_the_keyed_channel_and_a_plain_one_does_not():
    with listening_on("skipqueue!keyed") as listener:
        tasks.add.enqueue(1, 2)
        assert list(listener.notifies(timeout=0.5, stop_after=1)) == []
        tasks.per_account.enqueue("acme")
        got = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
    assert got == [""]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_runs_keyed_jobs_announced_or_not(start_worker):
    worker = start_worker("--concurrency", "2")
    worker.wait_for_output("worker listening")
    announced = tasks.per_account.enqueue("acme", seconds=0.01)
    wait_until(lambda: Job.objects.filter(id=announced.id, state="done").exists(), timeout=5)
    # Written by another client, without the keyed NOTIFY: the housekeeper's probe finds it.
    quiet = Job.objects.create(
        task=tasks.per_account.name, args=["globex"], kwargs={"seconds": 0.01},
        lease=timedelta(minutes=5), max_attempts=3, concurrency_key="account:globex",
        concurrency_limit=1,
    )  # fmt: skip
    wait_until(lambda: Job.objects.filter(id=quiet.id, state="done").exists(), timeout=5)


def test_queuestats_shows_a_paused_queue_and_its_limits(settings):
    import json
    from io import StringIO

    from django.core.management import call_command

    settings.SKIPQUEUE = {"QUEUE_LIMITS": {"default": {"concurrency": 3, "rate": "100/m"}}}
    tasks.add.enqueue(1, 2)
    Queue.objects.pause(["default"])
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    (row,) = json.loads(out.getvalue())["queues"]
    assert (row["paused"], row["limits"]) == (True, "3 at a time, 100/min")
    table = StringIO()
    call_command("queuestats", stdout=table)
    assert "paused" in table.getvalue().splitlines()[1]


def test_a_cancelled_job_that_fails_or_is_released_ends_cancelled_not_retried(worker_process):
    from django_skipqueue.queue.base import ErrorInfo

    first, second = tasks.add.enqueue(1, 2), tasks.add.enqueue(3, 4)
    Job.objects.claim(queues=["default"], worker=worker_process, limit=2)
    Job.objects.cancel([first.id, second.id])
    error = ErrorInfo("builtins.RuntimeError", "boom")
    assert Job.objects.fail(first.id, 1, error=error, retry_in=timedelta(0)) == "cancelled"
    assert Job.objects.release(second.id, 1)  # a graceful stop gives it back: cancelled
    states = dict(Job.objects.values_list("id", "state"))
    assert states == {first.id: "cancelled", second.id: "cancelled"}
    assert Job.objects.get(id=first.id).last_error == "builtins.RuntimeError: boom"


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_timed_out_job_keeps_its_slot_while_its_code_runs():
    from tests.testapp.models import Span

    for _ in range(2):  # 0.6 s past the 0.3 s limit: inside the grace, so no exit
        tasks.outlives_its_timeout_per_account.enqueue(account="a", seconds=0.9)
    worker = Worker(concurrency=2, listen=False, reap_interval=0.2, poll_interval=0.1)
    thread = threading.Thread(target=worker.run, name="test-worker")
    thread.start()
    try:
        # Each ends with TimeLimitExceeded when its sleep ends, through the fence: its
        # lease, so its slot, was kept till then (renewed past its 1 s lease).
        wait_until(lambda: Job.objects.filter(state="failed").count() == 2, timeout=30)
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert not worker.stuck_exit
    assert {tuple(job.errors[-1]["type"].rsplit(".", 1)[-1:]) for job in Job.objects.all()} == {
        ("TimeLimitExceeded",)
    }
    spans = sorted(Span.objects.filter(key="a").values_list("started_at", "ended_at"))
    assert len(spans) == 2
    for (_, first_end), (second_start, _) in itertools.pairwise(spans):
        assert second_start >= first_end  # never two at once: the limit held


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_cancelled_job_under_a_limit_keeps_its_slot_while_its_code_runs():
    """An operator cancels a running job whose task ignores the request: its lease, and
    so its key's slot, is kept until its thread ends (H23); the reaper used to end it
    cancelled after one lease and let the next job of the key start beside it."""
    from tests.testapp.models import Span

    first = tasks.per_account_ignores_cancel.enqueue(account="x", seconds=3.0)
    tasks.per_account_ignores_cancel.enqueue(account="x", seconds=0.3)
    worker = Worker(concurrency=2, listen=False, reap_interval=0.2, poll_interval=0.1)
    thread = threading.Thread(target=worker.run, name="test-worker")
    thread.start()
    try:
        wait_until(lambda: Span.objects.filter(job_id=first.id).exists(), timeout=30)
        Job.objects.cancel([first.id], by="ops")
        wait_until(lambda: Span.objects.filter(key="x", ended_at__isnull=False).count() == 2, 30)
    finally:
        worker.stop()
        thread.join(timeout=30)

    spans = sorted(Span.objects.filter(key="x").values_list("started_at", "ended_at"))
    assert len(spans) == 2
    (_, first_end), (second_start, _) = spans
    assert second_start >= first_end  # never two at once: the limit held
    assert Job.objects.get(id=first.id).state in {"done", "cancelled"}
