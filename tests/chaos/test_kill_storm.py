"""T1 and T5: SIGKILL storm with reapers racing everything."""

from __future__ import annotations

import random
import time

import pytest

from django_skipqueue.models import Job
from tests.chaos.harness import check, deadlocks
from tests.processes import wait_until
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)

WORKERS, THREADS, JOBS, KILL_SECONDS = 4, 4, 10_000, 30.0


@pytest.mark.timeout(420)
def test_sigkill_storm_loses_nothing_and_acks_each_job_once(supervisor):
    rng = random.Random(20261130)
    probe = tasks.probe.using(lease=3.0)
    jobs = probe.enqueue_many([((), {"ms": rng.randint(2, 30)}) for _ in range(JOBS)])
    ids = [job.id for job in jobs]
    deadlocks_before = deadlocks()
    worker_args = ("--concurrency", str(THREADS), "--reap-interval", "1")
    for _ in range(WORKERS):
        supervisor.start(*worker_args)
    for _ in range(2):  # T5: two standalone reapers racing the workers' own
        supervisor.start_command("reapjobs", "--loop", "--interval", "0.05")

    storm_ends = time.monotonic() + KILL_SECONDS
    while time.monotonic() < storm_ends:
        time.sleep(rng.uniform(1.0, 2.0))  # the storm's pace, not a synchronisation
        supervisor.kill_random(rng)
        supervisor.start(*worker_args)
    done_at_storm_end = Job.objects.filter(id__in=ids, state="done").count()
    drain_started = time.monotonic()

    wait_until(
        lambda: not Job.objects.filter(id__in=ids).exclude(state__in=["done", "failed"]).exists(),
        timeout=3 + 2 * 1 + 240,
        message="jobs still unfinished after the drain",
    )
    drain_seconds = time.monotonic() - drain_started
    report = check(ids, deadlocks_before)
    refused = supervisor.count_in_logs(r"job lease lost")
    print(
        f"\nT1 kills={supervisor.kills} done_at_storm_end={done_at_storm_end} "
        f"drain={drain_seconds:.1f}s "
        f"refused_acks={refused} {report}"
    )

    assert report.violations() == []
    assert report.figures["done"] == JOBS  # 0 lost, none failed
    assert report.figures["acked_done_twice"] == 0
    assert report.figures["C6_duplicate_runs"] <= report.figures["expirations"]
    assert refused <= report.figures["expirations"]
    # T5: every expiry counted once, however many reapers raced.
    assert report.figures["reaped_transitions"] == report.figures["expirations"]
    assert supervisor.kills >= 15


@pytest.mark.timeout(300)
def test_a_sigkill_storm_on_pool_children_loses_nothing(supervisor):
    """The same invariants with `runworker --processes`: children SIGKILLed at random are
    replaced by their parent, and the fence, the lease and the reaper hold as for single
    workers (duplicates within expirations, each expiry counted once, 0 lost)."""
    import os
    import signal

    import psutil

    rng = random.Random(20261201)
    jobs = tasks.probe.using(lease=3.0).enqueue_many(
        [((), {"ms": rng.randint(2, 30)}) for _ in range(4000)]
    )
    ids = [job.id for job in jobs]
    deadlocks_before = deadlocks()
    pools = [
        supervisor.start("--processes", "2", "--concurrency", "4", "--reap-interval", "1")
        for _ in range(2)
    ]
    kills = 0
    storm_ends = time.monotonic() + 15.0
    while time.monotonic() < storm_ends:
        time.sleep(rng.uniform(0.7, 1.5))  # the storm's pace, not a synchronisation
        pool = rng.choice(pools)
        children = psutil.Process(pool.pid).children()
        if children:
            os.kill(rng.choice(children).pid, signal.SIGKILL)
            kills += 1

    wait_until(
        lambda: not Job.objects.filter(id__in=ids).exclude(state__in=["done", "failed"]).exists(),
        timeout=180,
        message="jobs still unfinished after the storm",
    )
    report = check(ids, deadlocks_before)
    print(f"\npool storm kills={kills} {report}")
    assert report.violations() == []
    assert report.figures["done"] == 4000
    assert report.figures["C6_duplicate_runs"] <= report.figures["expirations"]
    assert report.figures["reaped_transitions"] == report.figures["expirations"]
    assert kills >= 8
    assert all(pool.process.poll() is None for pool in pools)  # the parents live on
    assert all(len(psutil.Process(pool.pid).children()) == 2 for pool in pools)
