"""No single row, task or server state may stop a worker, stall a queue or lose a write.

Each test puts one bad thing in front of real `runworker` processes and checks that the
worker lives on, that the bad job alone fails with its real error, and that every other
job runs once. The rules they check are in docs/explanation/protocol.md ("Faults").
"""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.test import Client

from django_skipqueue.models import Job, JobState
from tests.chaos.harness import check
from tests.processes import wait_until
from tests.queue.test_managers import insert_raw
from tests.testapp import tasks
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def finished(ids: list[int]) -> bool:
    return not Job.objects.filter(id__in=ids).exclude(state__in=["done", "failed"]).exists()


def runs(ids: list[int]) -> list[int]:
    """How many times each job's body ran, in id order."""
    return [Run.objects.filter(job_id=job_id).count() for job_id in sorted(ids)]


def test_a_task_leaving_a_raw_transaction_open_loses_no_later_write(supervisor):
    leaky = tasks.begins_raw_transaction.enqueue().id
    writers = [job.id for job in tasks.probe.enqueue_many([((), {})] * 20)]
    worker = supervisor.start("--concurrency", "1")

    wait_until(lambda: finished([leaky, *writers]), timeout=60)

    connection.close()  # a new session sees only what was committed
    job = Job.objects.get(id=leaky)
    assert (job.state, job.attempts) == (JobState.FAILED, 1)
    assert "its writes were rolled back" in job.last_error
    assert not Run.objects.filter(job_id=leaky).exists()
    assert runs(writers) == [1] * 20  # all 20 later writes committed
    assert Job.objects.filter(id__in=writers, state="done").count() == 20
    assert worker.process.poll() is None


def test_one_result_over_the_stored_limit_fails_alone_and_its_batch_runs_once(supervisor):
    poisoned = tasks.returns_huge_floats.enqueue(30000).id  # 210 KB as JSON, 9 MB stored
    innocent = [job.id for job in tasks.probe.enqueue_many([((), {"ms": 5})] * 26)]
    worker = supervisor.start("--concurrency", "4")

    wait_until(lambda: finished([poisoned, *innocent]), timeout=60)

    job = Job.objects.get(id=poisoned)
    assert (job.state, job.attempts, job.expirations) == (JobState.FAILED, 1, 0)
    assert "bytes as stored" in job.last_error and "InvalidJobError" in job.last_error
    assert runs(innocent) == [1] * 26
    report = check(innocent, supervisor.deadlocks_at_start)
    assert report.violations() == []
    assert report.figures["done"] == 26
    assert worker.process.poll() is None


def test_rows_no_worker_could_handle_before_fail_alone_and_stop_nothing(supervisor, admin_user):
    """Item 3's rows, all at once, in front of two workers for one queue."""
    undecodable = insert_raw(args="'[1e4400]'")  # valid jsonb Python's json cannot load
    huge_lease = insert_raw(lease="'999999999 days'")  # timedelta.max
    spent = insert_raw(state="'pending'", attempts=5, max_attempts=5)  # failed, set back
    not_an_array = insert_raw(
        state="'running'", attempts=1, leased_until="now() - interval '1 minute'", errors="'{}'"
    )
    innocent = [job.id for job in tasks.probe.enqueue_many([((), {"ms": 5})] * 8)]
    workers = [supervisor.start("--reap-interval", "0.2") for _ in range(2)]
    with connection.cursor() as cursor:  # a later migration, applied while they run
        cursor.execute("ALTER TABLE skipqueue_job ADD COLUMN from_the_future integer")
    try:
        more = [job.id for job in tasks.probe.enqueue_many([((), {"ms": 5})] * 8)]
        wait_until(
            lambda: finished([undecodable, huge_lease, spent, not_an_array, *innocent, *more]),
            timeout=60,
        )
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE skipqueue_job DROP COLUMN from_the_future")

    bad = Job.objects.get(id=undecodable)
    assert (bad.state, bad.attempts) == (JobState.FAILED, 1)  # not retried
    assert "cannot load from JSON" in bad.last_error and "4300" in bad.last_error
    assert Job.objects.get(id=huge_lease).state == JobState.DONE
    assert Job.objects.filter(id=spent, state="done", attempts=6).exists()
    repaired = Job.objects.get(id=not_an_array)
    assert repaired.state == JobState.DONE and repaired.errors[0] == {}
    assert runs([*innocent, *more]) == [1] * 16
    assert all(worker.process.poll() is None for worker in workers)

    client = Client()  # the admin shows the row it cannot decode, never a 500
    client.force_login(admin_user)
    assert client.get("/admin/skipqueue/job/").status_code == 200
    page = client.get(f"/admin/skipqueue/job/{undecodable}/change/")
    assert page.status_code == 200
    assert "1" + "0" * 50 in page.content.decode()  # its text, as stored


@pytest.mark.timeout(120)
def test_a_read_only_window_during_a_failover_is_ridden_out(supervisor):
    ids = [job.id for job in tasks.probe.using(lease=5.0).enqueue_many([((), {"ms": 20})] * 600)]
    workers = [supervisor.start("--concurrency", "2") for _ in range(2)]
    wait_until(lambda: Job.objects.filter(id__in=ids, state="done").count() >= 50, timeout=30)

    with connection.cursor() as cursor:  # the primary is now a standby, for 8 seconds
        cursor.execute("SELECT current_database()")
        name = cursor.fetchone()[0]
        cursor.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
            [name],
        )
    try:
        time.sleep(8)  # the fault's duration, not a synchronisation
        during = Job.objects.filter(id__in=ids, state="done").count()
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')

    wait_until(lambda: finished(ids), timeout=90)
    assert all(worker.process.poll() is None for worker in workers)  # none exited
    assert supervisor.count_in_logs("read-only transaction") > 0  # the window was met
    report = check(ids, supervisor.deadlocks_at_start)
    print(f"\nread-only window: {report} done during it={during}")
    assert report.violations() == []
    assert report.figures["done"] == 600
