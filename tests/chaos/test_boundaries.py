"""T9 repeated backend kills, T35 SIGTERM drain at CI size."""

from __future__ import annotations

import signal
import time

import pytest
from django.db import connection

from django_skipqueue.models import Job, JobState
from tests.chaos.harness import check, scalar
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def finished(ids: list[int]) -> bool:
    return not Job.objects.filter(id__in=ids).exclude(state__in=["done", "failed"]).exists()


@pytest.mark.timeout(240)
def test_t9_backend_kills_every_five_seconds_fail_no_job(supervisor):
    ids = [j.id for j in tasks.probe.using(lease=5.0).enqueue_many([((), {"ms": 10})] * 6000)]
    for _ in range(2):
        supervisor.start("--concurrency", "4", "--reap-interval", "1")
    kills = 0
    ends = time.monotonic() + 30
    while time.monotonic() < ends and not finished(ids):
        time.sleep(5)  # the fault's period, not a synchronisation
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend'"
            )
            kills += cursor.fetchone()[0]
    wait_until(lambda: finished(ids), timeout=180)
    report = check(ids, supervisor.deadlocks_at_start)
    connection_failures = Job.objects.filter(
        id__in=ids, state=JobState.FAILED, last_error__iregex=r"OperationalError|InterfaceError"
    ).count()
    print(f"\nT9 sessions_killed={kills} connection_failures={connection_failures} {report}")
    assert report.violations() == []
    assert connection_failures == 0
    assert report.figures["done"] == 6000
    assert all(worker.process.poll() is None for worker in supervisor.workers)


@pytest.mark.timeout(120)
def test_t35_sigterm_drain_finishes_short_jobs_and_releases_long_ones(supervisor):
    durations = [0.2, 0.5, 1.0, 1.5, 2.0, 2.5, 4.0, 5.0, 6.0, 6.0, 5.5, 4.5]
    jobs = {tasks.probe.enqueue(ms=int(seconds * 1000)).id: seconds for seconds in durations}
    worker = supervisor.start("--concurrency", "12", "--grace", "3")
    # Started means in the task body (the probe's Run row), not just claimed: a claimed
    # job still in the worker's hand-off queue at SIGTERM is released at once, by design
    # (seen in CI under load: 7 of 12 not yet picked up by their threads).
    wait_until(lambda: Run.objects.filter(job_id__in=jobs).count() == 12, timeout=20)
    started = time.monotonic()
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=3 + 5) == 0
    elapsed = time.monotonic() - started
    states = dict(Job.objects.filter(id__in=jobs).values_list("id", "state"))
    short = [i for i, seconds in jobs.items() if seconds <= 2.5]
    long = [i for i, seconds in jobs.items() if seconds >= 4.0]
    print(f"\nT35 exit_after={elapsed:.1f}s states={sorted(states.values())}")
    assert elapsed <= 3 + 2
    assert all(states[i] == JobState.DONE for i in short)
    assert all(states[i] == JobState.PENDING for i in long)  # released, not lost
    released = Job.objects.filter(id__in=long)
    assert set(released.values_list("attempts", "releases")) == {(1, 1)}  # attempt given back
    assert not Job.objects.filter(state=JobState.RUNNING).exists()


@pytest.mark.timeout(400)
def test_t3_at_the_lease_boundary_an_attempt_is_acked_or_reaped_never_both(supervisor):
    """T3 at the plan's CI size: lease 1 s, 2,000 jobs, renewal off, a reaper every 10 ms.
    The probe sleeps to its lease's end +/- 50 ms by the database's clock, not a fixed
    1 s +/- 50 ms: under load the claim-to-start delay (tens of ms on 2 cores with 64
    threads) pushed most fixed sleeps past the lease, 5.2 expirations per job, and 5
    jobs spent all 40 attempts."""
    lease_ms = 1000
    calls = [((), {"mode": "boundary", "jitter_ms": 50})] * 2000
    ids = [
        j.id for j in tasks.probe.using(lease=lease_ms / 1000, max_attempts=40).enqueue_many(calls)
    ]
    supervisor.start_command("reapjobs", "--loop", "--interval", "0.01")
    for _ in range(2):
        supervisor.start(
            *("--concurrency", "32", "--prefetch", "0", "--reap-interval", "0"),
            *("--no-listen", "--poll-interval", "0.05"),
            command="runworker_without_renewal",
        )
    wait_until(lambda: finished(ids), timeout=330)

    report = check(ids, supervisor.deadlocks_at_start)
    done_twice = scalar(
        "SELECT count(*) FROM (SELECT job_id FROM testapp_jobaudit WHERE job_id = ANY(%s) "
        "AND old_state = 'running' AND new_state = 'done' GROUP BY job_id "
        "HAVING count(*) <> 1) AS bad",
        [ids],
    )
    expirations = scalar("SELECT sum(expirations) FROM skipqueue_job WHERE id = ANY(%s)", [ids])
    refused = supervisor.count_in_logs(r"outcome refused by the fence")
    print(f"\nT3 {report} expirations={expirations} refused_acks={refused}")
    assert report.violations() == []
    assert Job.objects.filter(id__in=ids, state=JobState.DONE).count() == len(ids)
    assert done_twice == 0  # exactly one running -> done per job
    assert expirations > 100 and refused > 0  # the race really ran, both ways
    assert refused <= expirations  # a refused ack always matches a lease taken back
