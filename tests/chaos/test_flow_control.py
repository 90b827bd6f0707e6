"""Flow control across four worker processes at concurrency 4 (docs/howto/flow-control.md):
the limits hold as measured from the tasks themselves (their Spans, on the database
clock), and every job still runs."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from django_skipqueue.models import Job
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import Span

pytestmark = pytest.mark.django_db(transaction=True)

WORKERS = 4


def peak_overlap(spans) -> int:
    """The most spans running at one instant (ends before starts at a tie)."""
    events = []
    for started, ended in spans:
        events += [(started, 1), (ended, -1)]
    peak = running = 0
    for _, step in sorted(events, key=lambda event: (event[0], event[1])):
        running += step
        peak = max(peak, running)
    return peak


@pytest.mark.timeout(180)
def test_a_queue_limit_and_a_key_limit_hold_across_four_workers(supervisor):
    settings = {"QUEUE_LIMITS": {"reports": {"concurrency": 3}}}
    reports = tasks.occupy.using(queue_name="reports").enqueue_many([((), {"seconds": 0.05})] * 150)
    accounts = tasks.per_account.enqueue_many(
        [((f"account-{n % 3}",), {"seconds": 0.03}) for n in range(90)]
    )
    plain = tasks.occupy.enqueue_many([((), {"seconds": 0.01})] * 200)
    for _ in range(WORKERS):
        supervisor.start("--concurrency", "4", "-q", "default", "-q", "reports", settings=settings)
    ids = [job.id for job in [*reports, *accounts, *plain]]
    wait_until(
        lambda: not Job.objects.filter(id__in=ids).exclude(state="done").exists(),
        timeout=120,
        message="jobs left unfinished under the limits",
    )
    report_ids = {job.id for job in reports}
    report_spans = Span.objects.filter(job_id__in=report_ids).values_list("started_at", "ended_at")
    per_key = {
        key: peak_overlap(Span.objects.filter(key=key).values_list("started_at", "ended_at"))
        for key in ("account-0", "account-1", "account-2")
    }
    all_spans = Span.objects.filter(job_id__in=ids).values_list("started_at", "ended_at")
    print(
        f"\nlimits reports_peak={peak_overlap(report_spans)} per_key_peaks={per_key} "
        f"overall_peak={peak_overlap(all_spans)}"
    )
    assert peak_overlap(report_spans) <= 3
    assert set(per_key.values()) == {1}
    assert Span.objects.filter(job_id__in=ids).count() == len(ids)  # each ran, once
    assert peak_overlap(all_spans) > 3  # the plain jobs were not held to the limits


@pytest.mark.timeout(180)
def test_a_rate_limit_holds_over_20_seconds_across_four_workers(supervisor):
    rate, seconds = 10, 20.0
    settings = {"QUEUE_LIMITS": {"webhooks": {"rate": f"{rate}/s"}}}
    jobs = tasks.occupy.using(queue_name="webhooks").enqueue_many([((), {"seconds": 0.01})] * 400)
    ids = [job.id for job in jobs]
    for _ in range(WORKERS):
        supervisor.start("--concurrency", "4", "-q", "webhooks", settings=settings)
    wait_until(lambda: Span.objects.filter(job_id__in=ids).exists(), timeout=30)
    first = Span.objects.filter(job_id__in=ids).earliest("started_at").started_at
    time.sleep(seconds + 2)
    started = Span.objects.filter(
        job_id__in=ids, started_at__lte=first + timedelta(seconds=seconds)
    ).count()
    batch = 16  # the most one claim takes: concurrency 4 and its prefetch
    print(f"\nrate limit={rate}/s window={seconds}s started={started} allowed={rate * seconds:.0f}")
    # The bucket starts full (one period's starts), then refills at the rate.
    assert started <= rate * seconds + rate + batch
    assert started >= rate * seconds * 0.8  # and the limit is not a stall
