"""T38: claim latency as history grows (RELIABILITY.md), at CI size."""

from __future__ import annotations

import re
import threading
import time

import pytest
from django.db import connection, connections

from django_skipqueue import sql
from django_skipqueue.models import Job

pytestmark = pytest.mark.django_db(transaction=True)

CLAIMERS = 8
CLAIMS_EACH = 150


def fill(count: int, state: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, "
            "run_at, lease, attempts, max_attempts, expirations, releases, last_error, "
            "errors, created_at, finished_at) "
            "SELECT 'tests.testapp.tasks.add', '[1, 1]', '{}', 'default', 0, %s, now(), "
            "interval '30 seconds', %s, 5, 0, 0, '', '[]', now(), "
            "CASE WHEN %s = 'done' THEN now() END FROM generate_series(1, %s)",
            [state, 1 if state == "done" else 0, state, count],
        )
        cursor.execute("ANALYZE skipqueue_job")


def claim_latencies() -> list[float]:
    """CLAIMERS threads each claim one job CLAIMS_EACH times; every claim's latency."""
    latencies: list[float] = []
    lock = threading.Lock()

    def claimer() -> None:
        mine = []
        try:
            for _ in range(CLAIMS_EACH):
                started = time.perf_counter()
                [job] = Job.objects.claim(queues=["default"], limit=1)
                mine.append(time.perf_counter() - started)
        finally:
            connections.close_all()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=claimer) for _ in range(CLAIMERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


def claim_plan() -> tuple[str, int]:
    """EXPLAIN (ANALYZE, BUFFERS) of one claim, rolled back: the plan and buffers touched."""
    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
        cursor.execute(
            "EXPLAIN (ANALYZE, BUFFERS) " + sql.CLAIM_ONE_QUEUE,
            {"queues": "default", "limit": 1, "worker": None, "lease": None},
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("ROLLBACK")
    top = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
    return plan, int(top[1]) + int(top[2] or 0) if top else 0


@pytest.mark.timeout(600)
def test_t38_claims_cost_the_same_with_a_million_done_rows():
    fill(10_000, "pending")
    baseline_plan, baseline_buffers = claim_plan()
    baseline = min(p99(claim_latencies()) for _ in range(2))  # the better of two rounds

    fill(1_000_000, "done")
    fill(100_000, "pending")
    plan, buffers = claim_plan()
    history = min(p99(claim_latencies()) for _ in range(2))

    print(
        f"\nT38 claim p99 at 8 claimers: {baseline * 1000:.2f} ms at 10,000 pending, "
        f"{history * 1000:.2f} ms with 1,000,000 done + 100,000 pending "
        f"= {history / baseline:.2f}x; buffers per claim {baseline_buffers} -> {buffers}"
    )
    for text in (baseline_plan, plan):
        assert "skipqueue_job_claim_idx" in text
        assert "Seq Scan" not in text
    assert history <= 1.5 * baseline
    assert buffers <= 2 * max(baseline_buffers, 1)
