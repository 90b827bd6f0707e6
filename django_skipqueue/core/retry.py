"""Retry policy: exponential backoff with jitter. Pure functions, no database."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta

#: The longest delay a timedelta holds (about 2.7 million years), in seconds: a policy
#: asking for more is held to it, and the fenced write then clamps it to
#: SKIPQUEUE['MAX_DELAY_SECONDS'], so the attempt's real error is still recorded.
LONGEST_SECONDS = timedelta.max.total_seconds() - 1


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Wait `base * 2**(attempt - 1)` seconds, at most `cap`, spread by +/- `jitter`.

    `jitter` is a fraction: 0.1 spreads each delay uniformly over 90 % to 110 % so that
    jobs that failed together do not retry together.

    An attempt that ran past its time limit (TimeLimitExceeded, or SoftTimeLimitExceeded
    left out of the task) is not retried, as in Celery, unless `retry_time_limits`: a
    task that took too long once usually takes too long again, and each attempt holds a
    thread (or a whole worker, for one that does not stop) for the whole limit.
    """

    base: float = 1.0
    cap: float = 3600.0
    jitter: float = 0.1
    retry_time_limits: bool = False

    def __post_init__(self) -> None:
        if not self.base >= 0:
            raise ValueError(f"RetryPolicy.base must be >= 0 seconds, got {self.base!r}")
        if not self.cap >= self.base:
            raise ValueError(f"RetryPolicy.cap must be >= base ({self.base}), got {self.cap!r}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1), got {self.jitter!r}")

    def nominal_delay(self, attempt: int) -> float:
        """The delay in seconds after failed attempt `attempt` (1-based), before jitter."""
        exponent = min(max(attempt, 1) - 1, 64)  # 2**64 already exceeds any cap
        return min(self.cap, self.base * 2.0**exponent)

    def delay(self, attempt: int, rng: random.Random | None = None) -> timedelta:
        """The jittered delay before the attempt after `attempt`."""
        spread = (rng or random).uniform(1 - self.jitter, 1 + self.jitter)
        seconds = min(self.cap, self.nominal_delay(attempt) * spread, LONGEST_SECONDS)
        return timedelta(seconds=seconds)
