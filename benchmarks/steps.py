#!/usr/bin/env python
"""What durable steps cost (issue 55): round trips and steps a second.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_steps python benchmarks/steps.py

Runs jobs of no-op steps in this process (`run_jobs`, one thread, one connection) and
prints, for plain and atomic steps: the statements each step sent (from Django's query
log: a plain step is one INSERT; an atomic one is its transaction's BEGIN, its bounds,
the INSERT and the COMMIT), and steps a second. Then a job that failed after 1,000
recorded steps is resumed: the statements its replay sent, and how long it took.
Compare DBOS's published sizing, about 1,000 workflow actions a second per 4 vCPU.

With `--parked N` (10,000, say), also: N jobs that park at once (N/2 on a sleep of an
hour, N/2 on a wait for a signal) are run by a worker of 4 threads in this process, and
it prints how long they took to park, the threads of the process and the connections
of the database before and while they are parked (a parked job is a row, no more),
then how long N/2 signals took to send (one transaction) and the waiting jobs to finish.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402

from benchmarks.benchapp.tasks import parked, stepped  # noqa: E402
from django_skipqueue.models import Job  # noqa: E402
from django_skipqueue.testing import run_jobs  # noqa: E402


def run_one(steps: int, atomic: bool) -> tuple[float, int]:
    """One job of `steps` steps: seconds, and the statements it sent."""
    job = stepped.enqueue(steps, atomic)
    with CaptureQueriesContext(connection) as queries:
        started = time.perf_counter()
        run_jobs()
        seconds = time.perf_counter() - started
    assert Job.objects.get(id=job.id).state == "done"
    return seconds, len(queries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--parked", type=int, default=0, help="jobs to park (0: none)")
    opts = parser.parse_args()
    call_command("migrate", verbosity=0)
    if opts.parked:
        park(opts.parked)
    base_seconds, base_queries = run_one(0, False)  # the job's own claim, ack, ...
    for atomic in (False, True):
        seconds, queries = run_one(opts.steps, atomic)
        per_step = (queries - base_queries) / opts.steps
        rate = opts.steps / (seconds - base_seconds)
        kind = "atomic" if atomic else "plain"
        print(f"{kind:6} steps: {per_step:.2f} statements a step, {rate:,.0f} steps/s")
    job = stepped.enqueue(1001, False, 1001)  # fails at its last step, once
    run_jobs(limit=1)
    Job.objects.filter(id=job.id).update(run_at="2000-01-01T00:00:00Z")
    with CaptureQueriesContext(connection) as queries:
        started = time.perf_counter()
        run_jobs()
        seconds = time.perf_counter() - started
    job.refresh_from_db()
    assert job.state == "done" and job.attempts == 2, (job.state, job.attempts, job.last_error)
    reads = [q["sql"] for q in queries if "FROM skipqueue_step" in q["sql"]]
    inserts = [q["sql"] for q in queries if "INSERT INTO skipqueue_step" in q["sql"]]
    print(
        f"resume after 1,000 recorded steps: {len(reads)} read of the steps, "
        f"{len(inserts)} step written, {seconds * 1000:.0f} ms for the attempt"
    )


def connections_now() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def wait_for_count(query: object, count: int, limit: float = 600.0) -> float:
    started = time.perf_counter()
    while query.count() < count:  # type: ignore[attr-defined]
        if time.perf_counter() - started > limit:
            raise SystemExit(f"gave up after {limit:.0f} s")
        time.sleep(0.1)
    return time.perf_counter() - started


def park(count: int) -> None:
    """`count` jobs parked at once by a worker: what they hold, and their wake-up."""
    import threading

    from django.db import transaction

    from django_skipqueue import send_signal
    from django_skipqueue.runtime.worker import Worker

    Job.objects.all().delete()
    half = count // 2
    parked.enqueue_many([(("sleep",), {})] * half)
    waiting = parked.enqueue_many([(("signal",), {})] * (count - half))
    threads, conns = threading.active_count(), connections_now()
    worker = Worker(concurrency=4, poll_interval=0.05)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        took = wait_for_count(Job.objects.filter(state="pending").exclude(parked=""), count)
        time.sleep(1.0)  # the worker idle again, all parked
        busy_threads, busy_conns = threading.active_count(), connections_now()
        again = time.perf_counter()
        time.sleep(2.0)
        still = Job.objects.filter(state="pending").exclude(parked="").count()
        print(
            f"{count:,} jobs parked in {took:.1f} s ({count / took:,.0f}/s): "
            f"threads {threads} -> {busy_threads} (the worker's own), database "
            f"connections {conns} -> {busy_conns}; still parked {time.perf_counter() - again:.0f}"
            f" s later: {still:,}"
        )
        started = time.perf_counter()
        with transaction.atomic():
            for job in waiting:
                send_signal(job.id, "go", {"n": job.id})
        sent = time.perf_counter() - started
        done = wait_for_count(Job.objects.filter(state="done"), len(waiting))
        print(
            f"{len(waiting):,} signals sent in {sent:.1f} s ({len(waiting) / sent:,.0f}/s, one "
            f"transaction); their jobs all done {done:.1f} s after the commit"
        )
    finally:
        worker.stop()
        thread.join(60)


if __name__ == "__main__":
    main()
