from __future__ import annotations

import random
from datetime import timedelta

import pytest

from django_skipqueue import Retry, RetryPolicy


def test_delays_double_from_the_base_until_the_cap():
    policy = RetryPolicy(base=1, cap=10, jitter=0)
    assert [policy.delay(n).total_seconds() for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]


def test_jitter_spreads_each_delay_inside_its_band():
    policy = RetryPolicy(base=2, cap=1000, jitter=0.1)
    rng = random.Random(7)
    delays = [policy.delay(3, rng).total_seconds() for _ in range(2000)]
    assert all(7.2 <= delay <= 8.8 for delay in delays)
    assert max(delays) - min(delays) > 1.2  # really spread, not constant


def test_a_huge_attempt_number_stays_at_the_cap():
    assert RetryPolicy(base=1, cap=60, jitter=0).delay(10_000).total_seconds() == 60


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base": -1}, "base must be >= 0"),
        ({"base": 10, "cap": 5}, "cap must be >= base"),
        ({"jitter": 1.5}, "jitter must be in"),
    ],
)
def test_bad_policies_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**kwargs)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "raised",
    [
        lambda: Retry(delay=timedelta(days=999999999)),
        lambda: Retry(1e13),
    ],
)
def test_a_huge_retry_delay_is_clamped_and_written(raised):
    from django.db.models.functions import Now

    from django_skipqueue.conf import get_settings
    from django_skipqueue.models import Job
    from tests.testapp import tasks

    tasks.add.enqueue(1, 2)
    (claimed,) = Job.objects.claim(queues=["default"], limit=1)
    assert Job.objects.release(claimed.id, claimed.attempts, delay=raised().delay)
    ceiling = timedelta(seconds=get_settings().MAX_DELAY_SECONDS)
    row = Job.objects.annotate(now=Now()).get(id=claimed.id)
    assert row.state == "pending"
    assert row.run_at - row.now <= ceiling + timedelta(seconds=5)


@pytest.mark.django_db(transaction=True)
def test_a_huge_policy_delay_keeps_the_real_error():
    from django_skipqueue.models import Job
    from django_skipqueue.queue.base import ErrorInfo
    from tests.testapp import tasks

    tasks.add.enqueue(1, 2)
    (claimed,) = Job.objects.claim(queues=["default"], limit=1)
    state = Job.objects.fail(
        claimed.id,
        claimed.attempts,
        error=ErrorInfo("builtins.RuntimeError", "the real error"),
        retry_in=RetryPolicy(base=1e13, cap=1e13).delay(1),
    )
    assert state == "pending"
    assert Job.objects.get(id=claimed.id).last_error == "builtins.RuntimeError: the real error"


@pytest.mark.parametrize(
    "policy",
    [RetryPolicy(base=1e14, cap=1e14), RetryPolicy(base=1e14, cap=float("inf"))],
    ids=["past timedelta", "no cap"],
)
def test_a_policy_past_what_a_timedelta_holds_gives_the_longest_delay(policy):
    """Accepted at definition (it is a policy, not an error), and held to what a timedelta
    holds, so the fenced write can clamp it and keep the attempt's real error."""
    assert policy.delay(1) <= timedelta.max
    assert policy.delay(80) <= timedelta.max
