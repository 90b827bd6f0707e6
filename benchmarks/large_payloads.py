#!/usr/bin/env python
"""What a job's large arguments cost each write of its row: the claim, a lease renewal,
the ack (issue 29), and a worker's drain of such jobs.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_payloads \\
        python benchmarks/large_payloads.py --kib 250 --rounds 40

Each round enqueues 10 jobs whose one argument is `--kib` KiB of text, claims them in one
statement, renews each lease once, and acks them in one statement, timing each of the
three calls (wall, milliseconds, the statement's round trip included). Prints the medians.
Then drains `--drain` such jobs with `runworker --concurrency 4 --burst` and prints its
jobs a second and the database server's CPU a job (`benchmarks/run.py
server_cpu_seconds`: the whole server's, where it runs on this machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402

from benchmarks.benchapp.tasks import sink  # noqa: E402
from benchmarks.run import server_cpu_seconds  # noqa: E402
from django_skipqueue.models import Job  # noqa: E402


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def writes(kib: int, rounds: int) -> dict[str, float]:
    blob = "x" * (kib * 1024 - 64)
    timings: dict[str, list[float]] = {"claim 10": [], "renew 1": [], "ack 10": []}
    for _ in range(rounds):
        sink.enqueue_many([((blob,), {}) for _ in range(10)], ids_only=True)
        started = time.perf_counter()
        claimed = Job.objects.claim(queues=["default"], limit=10)
        timings["claim 10"].append(_ms(started))
        for job in claimed:
            started = time.perf_counter()
            assert Job.objects.renew(job.id, job.attempts)
            timings["renew 1"].append(_ms(started))
        started = time.perf_counter()
        done = Job.objects.ack_many([(job.id, job.attempts, None) for job in claimed])
        timings["ack 10"].append(_ms(started))
        assert len(done) == len(claimed) == 10
    return {name: statistics.median(values) for name, values in timings.items()}


def drain(kib: int, jobs: int) -> tuple[float, float]:
    blob = "x" * (kib * 1024 - 64)
    Job.objects.all().delete()
    for start in range(0, jobs, 500):
        sink.enqueue_many([((blob,), {}) for _ in range(min(500, jobs - start))], ids_only=True)
    cpu_before = server_cpu_seconds()[0]
    started = time.perf_counter()
    worker = subprocess.Popen(
        [sys.executable, "-m", "django", "runworker", "--concurrency", "4", "--burst"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
    )
    worker.wait()
    elapsed = time.perf_counter() - started
    cpu = server_cpu_seconds()[0] - cpu_before
    assert Job.objects.filter(state="done").count() == jobs
    return jobs / elapsed, cpu / jobs * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kib", type=int, default=250, help="each job's argument, KiB")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--drain", type=int, default=2000, help="jobs; 0 to skip")
    parser.add_argument(
        "--no-migrate", action="store_true", help="keep the schema as it is (to compare two)"
    )
    opts = parser.parse_args()
    if not opts.no_migrate:
        call_command("migrate", verbosity=0)
    Job.objects.all().delete()
    for name, value in writes(opts.kib, opts.rounds).items():
        print(f"{opts.kib} KiB arguments: {name}: {value:.2f} ms (median of the calls)")
    if opts.drain:
        rate, cpu = drain(opts.kib, opts.drain)
        print(
            f"{opts.kib} KiB arguments: runworker --concurrency 4 --burst, {opts.drain} jobs:"
            f" {rate:,.0f} jobs/s, database CPU {cpu:.2f} ms a job"
        )


if __name__ == "__main__":
    main()
