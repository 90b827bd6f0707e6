"""The overview's trends (issue 28): per-minute counts the workers add (QueueMinute),
read back as bars of 5 minutes over an hour or of an hour over a day."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.urls import reverse

from django_skipqueue.models import PICKUP_BUCKETS, QueueMinute
from django_skipqueue.stats import Bucket, queue_trends

pytestmark = [pytest.mark.django_db]


def buckets(**counts: int) -> list[int]:
    """A pickup histogram: {'0.01': 3} puts 3 pickups in the bucket of bound 0.01."""
    histogram = [0] * len(PICKUP_BUCKETS)
    for bound, count in counts.items():
        histogram[PICKUP_BUCKETS.index(float(bound.replace("_", ".")))] += count
    return histogram


def add_minutes_ago(minutes: int, queue: str = "default", **counts) -> None:
    """Counts for the minute `minutes` before the current one (database clock)."""
    QueueMinute.objects.add({queue: counts})
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE skipqueue_queueminute SET minute = minute - make_interval(mins => %s) "
            "WHERE minute = date_trunc('minute', now()) AND queue_name = %s",
            [minutes, queue],
        )


def test_counts_from_several_workers_add_up_in_one_row_per_queue_and_minute():
    QueueMinute.objects.add({"default": {"succeeded": 2, "pickup_buckets": buckets(**{"0_01": 2})}})
    QueueMinute.objects.add(
        {
            "default": {
                "succeeded": 3,
                "failed": 1,
                "pickup_buckets": buckets(**{"0_01": 1, "1_0": 4}),
            }
        }
    )
    QueueMinute.objects.add({"default": {"oldest_due_seconds": 7.0}})
    QueueMinute.objects.add({"default": {"oldest_due_seconds": 3.0}})
    [row] = QueueMinute.objects.all()
    assert (row.succeeded, row.failed) == (5, 1)
    assert row.pickup_buckets == buckets(**{"0_01": 3, "1_0": 4})
    assert row.oldest_due_seconds == 7.0  # the largest sample of the minute


def test_the_last_bar_of_the_hour_is_this_minute_and_the_four_before():
    add_minutes_ago(0, succeeded=1)
    add_minutes_ago(4, succeeded=10)
    add_minutes_ago(5, succeeded=100)  # the bar before
    add_minutes_ago(59, succeeded=1000)  # the first bar
    add_minutes_ago(60, succeeded=10000)  # out of the hour
    series = queue_trends("hour")["default"]
    assert len(series) == 12 and series[-1].minutes_ago == 0
    assert [b.succeeded for b in series][-2:] == [100, 11]
    assert series[0].succeeded == 1000
    day = queue_trends("day")["default"]
    assert len(day) == 24 and day[-1].succeeded == 1111 and day[-2].succeeded == 10000


def test_pickup_quantiles_come_from_the_histogram():
    bucket = Bucket(minutes_ago=0, pickup_buckets=buckets(**{"0_005": 50, "0_1": 45, "5_0": 5}))
    assert bucket.pickup_quantile(0.5) == 0.005 and bucket.pickup_quantile(0.51) == 0.1
    assert bucket.pickup_quantile(0.95) == 0.1
    assert bucket.pickup_quantile(0.96) == 5.0
    assert Bucket(minutes_ago=0).pickup_quantile(0.5) is None
    assert Bucket(minutes_ago=0, succeeded=3, retried=1).failure_rate == 0.25


def test_the_overview_shows_four_charts_per_queue_and_its_done_columns_match_the_bars(
    admin_client,
):
    add_minutes_ago(0, succeeded=4, failed=1, pickups=5, pickup_buckets=buckets(**{"0_05": 5}))
    add_minutes_ago(3, succeeded=6)
    add_minutes_ago(30, succeeded=20, retried=2)
    add_minutes_ago(0, queue="mail", succeeded=1)
    from django_skipqueue.models import Job

    Job.objects.create(task="t", queue_name="default", lease="00:05:00", max_attempts=1)
    page = admin_client.get(reverse("admin:skipqueue_overview")).content.decode()
    assert page.count('class="skipqueue-chart"') == 8  # two queues, four charts each
    row = re.search(r"default</a></td>(.*?)</tr>", page, re.S).group(1)
    cells = re.findall(r"<td>(\d+)</td>", row)
    assert "10" in cells and "30" in cells  # done 5 min = the last bar; done 1 h = all
    assert "Ended per 5 min" in page and "Pickup delay" in page and "Oldest due job" in page
    day = admin_client.get(reverse("admin:skipqueue_overview") + "?window=day").content.decode()
    assert "Ended per hour" in day and "-23 h" not in page


def test_the_minute_rows_are_pruned_after_a_day():
    from datetime import timedelta

    add_minutes_ago(26 * 60, succeeded=1)
    add_minutes_ago(0, succeeded=1)
    assert QueueMinute.objects.prune(timedelta(hours=25)) == 1
    assert QueueMinute.objects.count() == 1


def test_the_oldest_due_age_is_sampled_once_a_minute_by_whichever_reaper_comes_first():
    from django_skipqueue.maintenance.reaper import Reaper
    from django_skipqueue.models import Job

    Job.objects.create(task="t", queue_name="mail", lease="00:05:00", max_attempts=1)
    Reaper().reap()
    [row] = QueueMinute.objects.filter(queue_name="mail")
    assert row.oldest_due_seconds is not None and row.oldest_due_seconds >= 0
    QueueMinute.objects.filter(id=row.id).update(oldest_due_seconds=-1.0)  # a marker
    Reaper().reap()  # the same minute: nothing read again
    assert QueueMinute.objects.get(id=row.id).oldest_due_seconds == -1.0


def test_a_queue_with_running_jobs_and_none_due_has_no_lag():
    from django_skipqueue.models import Job
    from django_skipqueue.stats import queue_stats

    Job.objects.create(
        task="t",
        state="running",
        attempts=1,
        max_attempts=1,
        lease="00:05:00",
        leased_until="2999-01-01T00:00:00Z",
    )
    [row] = queue_stats(broker=False)
    assert (row.running, row.pending_due, row.lag_seconds) == (1, 0, 0.0)
    gauges = Job.objects.queue_gauges()["default"]
    assert gauges["oldest_due_seconds"] == 0.0


def test_the_overview_lists_a_queue_idle_now_that_ran_jobs_this_hour(admin_client):
    add_minutes_ago(2, queue="nightly", succeeded=7)
    page = admin_client.get(reverse("admin:skipqueue_overview")).content.decode()
    row = re.search(r"nightly</a></td>(.*?)</tr>", page, re.S).group(1)
    assert re.findall(r"<td>(\d+)</td>", row).count("7") == 2  # done 5 min and done 1 h
