from __future__ import annotations

import random

import pytest

from django_skipqueue import RetryPolicy


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
