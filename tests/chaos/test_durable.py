"""D3: durable steps under a SIGKILL storm and a worker frozen past its lease.

30 jobs of 20 steps, every other one atomic (each step's body inserts a StepRun row and
sleeps 60 ms), on 3 workers of 2 threads with a 2 s lease, killed at random, and one
worker SIGSTOPped for 5 s (past its lease, while another attempt takes its jobs over)
and continued. Atomic rows must exist exactly once; plain rows may repeat, at most
once per lease expiry; every job ends done once.
"""

from __future__ import annotations

import random
import signal
import time

import pytest
from django.db.models import Count

from django_skipqueue.models import Job, Step
from tests.chaos.harness import check, deadlocks
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import StepRun

pytestmark = pytest.mark.django_db(transaction=True)

JOBS, STEPS = 30, 20


@pytest.mark.timeout(300)
def test_atomic_steps_happen_once_under_kills_and_a_freeze(supervisor):
    rng = random.Random(20261207)
    jobs = tasks.durable_storm.enqueue_many([((), {"steps": STEPS, "ms": 60})] * JOBS)
    ids = [job.id for job in jobs]
    deadlocks_before = deadlocks()
    worker_args = ("--concurrency", "2", "--reap-interval", "0.5")
    for _ in range(3):
        supervisor.start(*worker_args)

    wait_until(lambda: Step.objects.filter(job_id__in=ids).count() >= 40, timeout=60)
    frozen = supervisor.workers[0]
    frozen.signal(signal.SIGSTOP)  # inside a step, likely: frozen past its 2 s lease
    storm_ends = time.monotonic() + 12.0
    while time.monotonic() < storm_ends:
        time.sleep(rng.uniform(1.0, 2.0))  # the storm's pace, not a synchronisation
        victim = rng.choice([w for w in supervisor.workers if w is not frozen])
        victim.signal(signal.SIGKILL)
        victim.wait(timeout=10)
        supervisor.workers.remove(victim)
        supervisor.retired.append(victim)
        supervisor.kills += 1
        supervisor.start(*worker_args)
    frozen.signal(signal.SIGCONT)  # its attempts are stale now: their steps are refused

    wait_until(
        lambda: not Job.objects.filter(id__in=ids).exclude(state="done").exists(),
        timeout=180,
        message="durable jobs still unfinished after the storm",
    )
    report = check(ids, deadlocks_before)
    runs = StepRun.objects.filter(job_id__in=ids)
    atomic = runs.filter(step__startswith="atomic-").values("job_id", "step")
    twice = atomic.annotate(n=Count("id")).filter(n__gt=1)
    plain = runs.filter(step__startswith="plain-")
    plain_repeats = plain.count() - JOBS * STEPS // 2
    recorded = Step.objects.filter(job_id__in=ids).count()
    print(
        f"\nD3 kills={supervisor.kills} atomic={atomic.count()} twice={twice.count()} "
        f"plain_repeats={plain_repeats} recorded={recorded} {report}"
    )
    assert report.violations() == []
    assert report.figures["done"] == JOBS
    assert report.figures["acked_done_twice"] == 0
    assert list(twice) == []  # exactly once: no atomic step's row twice...
    assert atomic.count() == JOBS * STEPS // 2  # ...and none missing
    assert recorded == JOBS * STEPS
    assert 0 <= plain_repeats <= report.figures["expirations"]
    assert report.figures["expirations"] >= 1  # the freeze cost at least one lease
