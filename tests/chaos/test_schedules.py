"""Periodic schedules under real workers: each occurrence one job, however many workers
tick it, and with workers SIGKILLed while they tick (docs/howto/periodic-schedules.md)."""

from __future__ import annotations

import math
import random
import time
from datetime import timedelta

import pytest
from django.db import connection

from django_skipqueue.models import Job
from tests.processes import wait_until
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)

SETTINGS = {
    "SCHEDULES": {"every-second": {"task": tasks.add.name, "cron": "* * * * * *", "args": [1, 2]}}
}
WORKERS, RUN_SECONDS = 4, 30.0


def database_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


@pytest.mark.timeout(180)
def test_four_workers_enqueue_each_occurrence_once_through_sigkills(supervisor):
    for _ in range(WORKERS):
        supervisor.start("--concurrency", "2", settings=SETTINGS)
    for worker in supervisor.workers:
        worker.wait_for_output("worker started", timeout=30)
    wait_until(lambda: Job.objects.filter(schedule="every-second").exists(), timeout=15)
    started = database_now()
    kills_at = {10.0, 20.0}
    began = time.monotonic()
    while (elapsed := time.monotonic() - began) < RUN_SECONDS:
        if kills_at and elapsed >= min(kills_at):
            kills_at.remove(min(kills_at))
            supervisor.kill_random(random.Random(int(elapsed)))
            supervisor.start("--concurrency", "2", settings=SETTINGS)
        time.sleep(0.1)  # the test's pace, not a synchronisation
    ended = database_now()
    # Every occurrence in [started, ended - 2 s]: the last two may still be ticking.
    first = math.ceil(started.timestamp())
    last = math.floor((ended - timedelta(seconds=2)).timestamp())
    jobs = Job.objects.filter(schedule="every-second")
    seconds = [moment.timestamp() for moment in jobs.values_list("scheduled_for", flat=True)]
    window = [second for second in seconds if first <= second <= last]
    missing = sorted(set(range(first, last + 1)) - {int(second) for second in window})
    print(
        f"\nschedules kills={supervisor.kills} occurrences={last - first + 1} "
        f"jobs={len(window)} missing={len(missing)} duplicates={len(window) - len(set(window))}"
    )
    assert supervisor.kills == 2
    assert missing == []  # no gap while a worker lives
    assert len(window) == len(set(window)) == last - first + 1  # no duplicate
    assert all(second == int(second) for second in window)  # on the second, as declared
    wait_until(
        lambda: not jobs.exclude(state="done").filter(scheduled_for__lte=ended).exists(),
        timeout=30,
        message="scheduled jobs left unfinished",
    )
