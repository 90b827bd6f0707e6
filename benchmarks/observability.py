#!/usr/bin/env python
"""The observability pages at size (issue 28): the admin's overview, a Prometheus scrape
of the web view and the worker's queue sample, with 10 million job rows.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench_obs python benchmarks/observability.py
    python benchmarks/observability.py --rows 1000000   # a smaller table

Fills the job table once (rows kept between runs: `--rows` is only added up to), as a
busy site has it: mostly done jobs, 20 queues, a backlog of 10,000 pending jobs, 200
running; a day of per-minute rows for every queue. Then times each page five times and
prints the median and the worst, in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The test settings: the admin, its sessions and templates, and the metrics URL.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

from django.contrib.auth.models import User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402
from django.urls import reverse  # noqa: E402

from django_skipqueue.runtime.prometheus import read_queue_sample  # noqa: E402

QUEUES = 20


def fill(rows: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM skipqueue_job")
        have = cursor.fetchone()[0]
        print(f"job rows: {have:,}; wanted {rows:,}", flush=True)
        step = 1_000_000
        while have < rows:
            n = min(step, rows - have)
            cursor.execute(
                "INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, "
                "run_at, lease, attempts, max_attempts, expirations, releases, last_error, "
                "errors, created_at, started_at, first_started_at, finished_at, result, "
                "cancelled_by) "
                "SELECT 'app.tasks.work', '[]', '{}', 'q' || (i %% %s), 0, 'done', "
                "now() - make_interval(secs => i %% 86400), interval '5 minutes', 1, 5, 0, 0, "
                "'', '[]', now() - make_interval(secs => i %% 86400), now(), now(), "
                "now() - make_interval(secs => i %% 86400), 'null', '' "
                "FROM generate_series(1, %s) AS i",
                [QUEUES, n],
            )
            have += n
            print(f"  {have:,}", flush=True)
        cursor.execute("SELECT count(*) FROM skipqueue_job WHERE state <> 'done'")
        if not cursor.fetchone()[0]:
            for state, count in (("pending", 10_000), ("running", 200)):
                cursor.execute(
                    "INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, "
                    "state, run_at, lease, leased_until, attempts, max_attempts, expirations, "
                    "releases, last_error, errors, cancelled_by) "
                    "SELECT 'app.tasks.work', '[]', '{}', 'q' || (i %% %s), 0, %s, "
                    "now() - interval '1 minute', interval '5 minutes', "
                    "CASE WHEN %s = 'running' THEN now() + interval '5 minutes' END, "
                    "CASE WHEN %s = 'running' THEN 1 ELSE 0 END, 5, 0, 0, '', '[]', '' "
                    "FROM generate_series(1, %s) AS i",
                    [QUEUES, state, state, state, count],
                )
        cursor.execute("DELETE FROM skipqueue_queueminute")
        cursor.execute(
            "INSERT INTO skipqueue_queueminute (queue_name, minute, succeeded, retried, "
            "failed, cancelled, lost, unknown, pickups, pickup_seconds, pickup_buckets, runs, "
            "run_seconds, oldest_due_seconds) "
            "SELECT 'q' || q, date_trunc('minute', now()) - make_interval(mins => m), "
            "100 + m %% 50, m %% 7, m %% 3, 0, 0, 0, 110, 0.5, "
            "'[10, 20, 30, 20, 10, 10, 5, 3, 1, 1, 0, 0, 0, 0, 0, 0]', 110, 3.0, m %% 60 "
            "FROM generate_series(0, %s) AS q, generate_series(0, 1439) AS m",
            [QUEUES - 1],
        )
        cursor.execute("ANALYZE skipqueue_job")
        cursor.execute("ANALYZE skipqueue_queueminute")


def timed(label: str, call, repeat: int = 5) -> None:
    call()  # warm: the first one pays connections and imports
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    print(f"{label:<44} median {statistics.median(times):7.1f} ms   worst {max(times):7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000_000)
    options = parser.parse_args()
    call_command("migrate", verbosity=0)
    fill(options.rows)
    setup_test_environment()
    User.objects.filter(username="bench").delete()
    admin = User.objects.create_superuser("bench", "bench@example.com", "x")
    client = Client()
    client.force_login(admin)

    def page(url: str):
        def get() -> None:
            response = client.get(url)
            assert response.status_code == 200, response.status_code

        return get

    overview = reverse("admin:skipqueue_overview")
    timed("admin overview, last hour", page(overview))
    timed("admin overview, last day", page(overview + "?window=day"))
    timed("worker's queue sample (4 queries)", lambda: read_queue_sample("default"))

    from django_skipqueue import views

    def scrape() -> None:
        views._registry = None  # a cold sample on every scrape: the worst case
        page("/skipqueue/metrics")()

    timed("web scrape, sampled now (worst case)", scrape)
    timed("web scrape, within the sample interval", page("/skipqueue/metrics"))


if __name__ == "__main__":
    main()
