"""Database faults: T8 PostgreSQL restart, T43 pruning under load, fault 6 clock skew."""

from __future__ import annotations

import os
import pwd
import subprocess

import pytest
from django.db import OperationalError, connection

from django_skipqueue.models import Job
from tests.chaos.harness import check, deadlocks, scalar
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)


def done_count(ids: list[int]) -> int:
    """Done jobs, tolerating the test's own connection dying in a restart."""
    try:
        return Job.objects.filter(id__in=ids, state="done").count()
    except OperationalError:
        connection.close()
        return -1


def restart_postgres(mode: str) -> None:
    """`pg_ctl restart -m mode` on the server this test runs against (as its owner)."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW data_directory")
        data_dir = cursor.fetchone()[0]
    owner = pwd.getpwuid(os.stat(data_dir).st_uid).pw_name
    pg_ctl = _pg_ctl(data_dir)
    connection.close()
    # Restart reuses the server's recorded options (postmaster.opts). Its output goes to a
    # log file: a pipe would be inherited by the new postmaster and never reach EOF.
    log = os.path.join(data_dir, "skipqueue-restart.log")
    subprocess.run(
        [pg_ctl, "-D", data_dir, "-w", "-t", "60", "-l", log, "restart", "-m", mode],
        user=owner,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=90,
    )


def _pg_ctl(data_dir: str) -> str:
    with open(os.path.join(data_dir, "postmaster.opts")) as opts:
        postgres = opts.read().split()[0]
    return os.path.join(os.path.dirname(postgres), "pg_ctl")


@pytest.mark.timeout(300)
def test_t8_workers_ride_out_postgres_restarts(supervisor):
    ids = [j.id for j in tasks.probe.using(lease=5.0).enqueue_many([((), {"ms": 5})] * 4000)]
    before = deadlocks()
    workers = [supervisor.start("--concurrency", "4", "--reap-interval", "1") for _ in range(2)]
    wait_until(lambda: done_count(ids) >= 800, timeout=60)
    restart_postgres("fast")
    wait_until(lambda: done_count(ids) >= 2400, timeout=120)
    restart_postgres("immediate")
    wait_until(lambda: done_count(ids) == 4000, timeout=180)

    report = check(ids, before)
    print(f"\nT8 {report}")
    assert report.violations() == []
    assert [worker.process.poll() for worker in workers] == [None, None]  # none died
    # Tasks whose own queries met the restart failed and were retried (logged with their
    # traceback); the workers themselves never crashed or lost an outcome.
    logs = supervisor.logs()
    assert "Exception in thread" not in logs
    assert "could not record" not in logs


@pytest.mark.timeout(240)
def test_t43_pruning_in_parallel_with_workers_deadlocks_nothing(supervisor):
    ids = [j.id for j in tasks.probe.enqueue_many([((), {"ms": 2})] * 3000)]
    before = deadlocks()
    for _ in range(2):
        supervisor.start("--concurrency", "3")
    for _ in range(2):
        supervisor.start_command(
            "reapjobs",
            "--loop",
            "--interval",
            "0.05",
            "--prune-done-older-than",
            "0s",
            "--batch-size",
            "200",
        )
    wait_until(lambda: Run.objects.values("job_id").distinct().count() == 3000, timeout=120)
    wait_until(
        lambda: not Job.objects.filter(id__in=ids).exclude(state="done").exists(), timeout=60
    )
    pruned = 3000 - scalar("SELECT count(*) FROM skipqueue_job WHERE id = ANY(%s)", [ids])
    print(f"\nT43 pruned={pruned} deadlocks={deadlocks() - before}")
    assert deadlocks() - before == 0
    assert pruned > 0
    assert not Job.objects.filter(id__in=ids, state__in=["pending", "running"]).exists()


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
def test_fault6_a_skewed_worker_clock_changes_no_lease_decision(supervisor, skew):
    ids = [j.id for j in tasks.probe.using(lease=2.0).enqueue_many([((), {"ms": 600})] * 30)]
    supervisor.start("--concurrency", "4", "--reap-interval", "0.2", clock_skew=skew)
    wait_until(lambda: done_count(ids) == 30, timeout=60)
    report = check(ids, supervisor.deadlocks_at_start)
    print(f"\nfault6 skew={skew:+.0f}s {report}")
    assert report.violations() == []
    assert report.figures["expirations"] == 0  # nothing reclaimed early or late
    assert report.figures["C6_duplicate_runs"] == 0
