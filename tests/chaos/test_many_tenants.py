"""Many tenants under a SIGKILL storm (issue 56): a fair queue with weights, a rate per
tenant, ordered accounts and the fault harness's probe, on four worker processes killed
at random. Nothing is lost, no job runs more often than its claims allow, each tenant's
rate and each account's order hold as measured from the tasks themselves (their Spans,
on the database clock)."""

from __future__ import annotations

import random
import time

import pytest

from django_skipqueue.models import Job
from tests.chaos.harness import check, deadlocks
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import Span

pytestmark = pytest.mark.django_db(transaction=True)

WORKERS, THREADS, TENANTS, KILL_SECONDS = 4, 4, 8, 15.0


@pytest.mark.timeout(300)
def test_fair_share_and_rates_per_tenant_hold_through_a_sigkill_storm(supervisor):
    rng = random.Random(20261208)
    probe = tasks.probe.using(
        queue_name="tenants", lease=3.0, fair_key=lambda ms=0, mode="ok", jitter_ms=0: f"t{ms % 8}"
    )
    heavy = probe.using(fair_weight=3)
    jobs = probe.enqueue_many([((), {"ms": rng.randint(2, 30)}) for _ in range(2000)])
    jobs += heavy.enqueue_many([((), {"ms": 8 * rng.randint(1, 3)}) for _ in range(400)])
    # Ten attempts, as the probe's: a run killed at each of a job's attempts fails it,
    # and a failed ordered job holds its key (CI: an ordered job of one attempt, killed
    # once, held its account's 30 others for good).
    rated = tasks.rated_tenant_job.using(lease=3.0, max_attempts=10).enqueue_many(
        [((f"r{n % 3}", n), {}) for n in range(240)]
    )
    ordered = [
        tasks.ordered_step.using(lease=3.0, queue_name="tenants", max_attempts=10).enqueue(
            account, n, seconds=0.01
        )
        for n in range(40)
        for account in ("o1", "o2")
    ]
    ids = [job.id for job in jobs]
    deadlocks_before = deadlocks()
    worker_args = ("--queue", "tenants", "--concurrency", str(THREADS), "--reap-interval", "1")
    for _ in range(WORKERS):
        supervisor.start(*worker_args)
    storm_ends = time.monotonic() + KILL_SECONDS
    while time.monotonic() < storm_ends:
        time.sleep(rng.uniform(1.0, 2.0))  # the storm's pace, not a synchronisation
        supervisor.kill_random(rng)
        supervisor.start(*worker_args)
    every = ids + [job.id for job in rated] + [job.id for job in ordered]
    wait_until(
        lambda: not Job.objects.filter(id__in=every).exclude(state__in=["done", "failed"]).exists(),
        timeout=240,
        message="tenants' jobs still unfinished after the storm",
    )
    report = check(ids, deadlocks_before)
    print(f"\nmany tenants kills={supervisor.kills} {report}")
    assert report.violations() == []
    assert report.figures["done"] == len(ids)
    assert report.figures["C6_duplicate_runs"] <= report.figures["expirations"]
    assert Job.objects.filter(id__in=[job.id for job in rated], state="done").count() == 240
    for tenant in ("r0", "r1", "r2"):
        starts = sorted(
            Span.objects.filter(key=f"rated-{tenant}").values_list("started_at", flat=True)
        )
        assert len(starts) >= 80  # a killed run may start again: at least once each
        origin = starts[0]
        for count, moment in enumerate(starts, start=1):
            # 20 at once (a full bucket), then 20 a second; +1: clock granularity; a run
            # lost to a kill spent its token too, so runs never pass the bucket.
            allowed = 20 + 20 * (moment - origin).total_seconds() + 1
            assert count <= allowed, (tenant, count, (moment - origin).total_seconds())
    # Strict order through the kills: each account's n-th job first started after the
    # (n-1)-th last ended (a killed run's job runs again, after its lease, before the next).
    assert Job.objects.filter(id__in=[job.id for job in ordered], state="done").count() == 80
    for account in ("o1", "o2"):
        runs = Span.objects.filter(key__startswith=f"order-{account}:")
        first_start = dict.fromkeys(range(40))
        last_end = dict.fromkeys(range(40))
        for key, started, ended in runs.values_list("key", "started_at", "ended_at"):
            n = int(key.rsplit(":", 1)[1])
            if first_start[n] is None or started < first_start[n]:
                first_start[n] = started
            if ended is not None and (last_end[n] is None or ended > last_end[n]):
                last_end[n] = ended
        for n in range(1, 40):
            assert last_end[n - 1] <= first_start[n], (account, n)
    assert supervisor.kills >= 7
