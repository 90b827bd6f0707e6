"""The task overview (issue 54, point 5): per task, runs, failures, retries, p50 and p95
run time over the last hour and day, and its newest error, from the per-minute rows
the workers write (TaskMinute), never the job table."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_skipqueue.models import DURATION_BUCKETS, TaskMinute
from django_skipqueue.stats import TaskWindow, task_stats
from tests.admin.test_admin import staff

pytestmark = [pytest.mark.django_db]

PAGE = "admin:skipqueue_taskoverview_changelist"


def durations(**counts: int) -> list[int]:
    """A run-time histogram: {'0_5': 3} puts 3 runs in the bucket of bound 0.5."""
    histogram = [0] * len(DURATION_BUCKETS)
    for bound, count in counts.items():
        histogram[DURATION_BUCKETS.index(float(bound.replace("_", ".")))] += count
    return histogram


def add_minutes_ago(minutes: int, task: str, **counts) -> None:
    """Counts for the minute `minutes` before the current one (database clock)."""
    TaskMinute.objects.add({task: counts})
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE skipqueue_taskminute SET minute = minute - make_interval(mins => %s), "
            "last_error_at = last_error_at - make_interval(mins => %s) "
            "WHERE minute = date_trunc('minute', now()) AND task = %s",
            [minutes, minutes, task],
        )


def test_counts_from_several_workers_add_up_and_the_newer_error_replaces_the_older():
    TaskMinute.objects.add(
        {"t": {"runs": 2, "succeeded": 2, "run_buckets": durations(**{"0_5": 2})}}
    )
    TaskMinute.objects.add(
        {
            "t": {
                "runs": 1,
                "failed": 1,
                "run_buckets": durations(**{"10": 1}),
                "last_error": (7, "E: a"),
            }
        }
    )
    TaskMinute.objects.add({"t": {"runs": 1, "succeeded": 1}})  # no error: the last one stays
    [row] = TaskMinute.objects.all()
    assert (row.runs, row.succeeded, row.failed) == (4, 3, 1)
    assert row.run_buckets == durations(**{"0_5": 2, "10": 1})
    assert (row.last_error, row.last_error_job) == ("E: a", 7)
    TaskMinute.objects.add({"t": {"runs": 1, "retried": 1, "last_error": (8, "E: b")}})
    row.refresh_from_db()
    assert (row.last_error, row.last_error_job, row.retried) == ("E: b", 8, 1)


def test_the_hour_is_the_last_sixty_minutes_and_the_day_all_of_them():
    add_minutes_ago(0, "t", runs=1, succeeded=1)
    add_minutes_ago(59, "t", runs=10, retried=10)
    add_minutes_ago(60, "t", runs=100, failed=100)  # the day only
    add_minutes_ago(24 * 60 - 1, "t", runs=1000, succeeded=1000)
    add_minutes_ago(24 * 60, "t", runs=10000, succeeded=10000)  # outside the day
    [row] = task_stats()
    assert (row.hour.runs, row.hour.retried, row.hour.failed) == (11, 10, 0)
    assert (row.day.runs, row.day.failed, row.day.succeeded) == (1111, 100, 1001)


def test_run_time_quantiles_are_estimated_within_the_histograms_buckets():
    window = TaskWindow(buckets=durations(**{"0_5": 50, "1_0": 40, "10": 10}))
    assert window.duration(0.5) == pytest.approx(0.5)  # the 50th of 100 ends bucket 0.5
    assert window.duration(0.9) == pytest.approx(1.0)
    assert 5.0 < window.duration(0.95) < 10.0  # halfway into (5, 10]: 7.5
    assert window.duration(0.95) == pytest.approx(7.5)
    assert TaskWindow().duration(0.5) is None
    slow = TaskWindow(buckets=durations(**{"inf": 3}))
    assert slow.duration(0.95) == DURATION_BUCKETS[-2]  # open-ended: its lower bound


def test_the_newest_error_of_the_day_is_shown_with_its_job_and_age():
    add_minutes_ago(30, "t", runs=1, failed=1, last_error=(5, "builtins.ValueError: older"))
    add_minutes_ago(3, "t", runs=1, retried=1, last_error=(6, "builtins.KeyError: newer"))
    add_minutes_ago(0, "t", runs=1, succeeded=1)
    [row] = task_stats()
    assert (row.last_error, row.last_error_job) == ("builtins.KeyError: newer", 6)
    assert timedelta(minutes=3) <= row.last_error_age < timedelta(minutes=4)


@pytest.mark.django_db(transaction=True)
def test_a_worker_counts_each_task_and_the_page_shows_them(client):
    """End to end: a real worker runs the jobs and flushes its counts as it stops; the
    page lists the tasks it ran, and a registered task that ran nothing, with zeros."""
    from django_skipqueue.runtime.worker import Worker
    from tests.testapp.tasks import add, always_fails

    for n in range(3):
        add.enqueue(n, n)
    failing = always_fails.using(max_attempts=1).enqueue("card declined by issuer 9f")
    Worker(concurrency=1, burst=True, listen=False, reap_interval=0).run()
    by_task = {row.task: row for row in task_stats()}
    assert (by_task[add.name].day.runs, by_task[add.name].day.succeeded) == (3, 3)
    failed = by_task[always_fails.name]
    assert (failed.hour.runs, failed.hour.failed, failed.last_error_job) == (1, 1, failing.id)
    assert failed.last_error.endswith("RuntimeError: card declined by issuer 9f")

    with CaptureQueriesContext(connection) as queries:
        page = staff(client, "view_job_payload").get(reverse(PAGE)).content.decode()
    assert not [q["sql"] for q in queries if "skipqueue_job" in q["sql"]]  # 10M rows: untouched
    assert "card declined by issuer 9f" in page
    assert f"/admin/skipqueue/job/{failing.id}/change/" in page
    assert f"?task={always_fails.name}&amp;state=failed" in page
    assert "tests.testapp.tasks.three_a_minute" in page  # registered, idle: zeros


def test_a_view_only_user_sees_the_errors_class_not_its_message(client):
    add_minutes_ago(
        1, "t", runs=1, failed=1, last_error=(5, "builtins.ValueError: password=hunter2")
    )
    page = staff(client).get(reverse(PAGE)).content.decode()
    assert "ValueError" in page and "hunter2" not in page


def test_the_page_orders_by_failures_runs_or_p95_and_refuses_other_users(client):
    add_minutes_ago(0, "a.calm", runs=50, succeeded=50, run_buckets=durations(**{"0_1": 50}))
    add_minutes_ago(0, "b.failing", runs=5, failed=5, run_buckets=durations(**{"0_01": 5}))
    add_minutes_ago(0, "c.slow", runs=2, succeeded=2, run_buckets=durations(**{"300": 2}))
    viewer = staff(client)

    def order(o: str) -> list[str]:
        page = viewer.get(reverse(PAGE), {"o": o}).content.decode()
        names = ("a.calm", "b.failing", "c.slow")
        return sorted(names, key=page.index)

    assert order("task") == ["a.calm", "b.failing", "c.slow"]
    assert order("failed") == ["b.failing", "a.calm", "c.slow"]
    assert order("runs") == ["a.calm", "b.failing", "c.slow"]
    assert order("p95") == ["c.slow", "a.calm", "b.failing"]
    assert order("nonsense") == ["a.calm", "b.failing", "c.slow"]
    client.logout()
    assert client.get(reverse(PAGE)).status_code == 302  # to the login page


def test_the_minute_rows_of_tasks_are_pruned_with_the_queues(db):
    from django_skipqueue.maintenance.reaper import Reaper

    add_minutes_ago(26 * 60, "t", runs=1)
    add_minutes_ago(0, "t", runs=1)
    result = Reaper().prune(minutes_older_than=timedelta(hours=25))
    assert result.pruned_minutes == 1
    assert TaskMinute.objects.count() == 1
