"""Flow-control settings as values: each queue's concurrency and rate limit.

Read from SKIPQUEUE['QUEUE_LIMITS'] (`conf` is the sole reader of settings), e.g.
`{"reports": {"concurrency": 3}, "webhooks": {"rate": "10/s"}}`. Pure: no database.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeGuard

from django_skipqueue.conf import check_entry, get_settings
from django_skipqueue.exceptions import ConfigurationError

RATE_PATTERN = re.compile(
    r"\s*([0-9]{1,9})\s*/\s*([0-9]{1,6})?\s*(s|sec|second|m|min|minute|h|hour)\s*", re.ASCII
)
PERIODS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0}
PERIODS |= {"h": 3600.0, "hour": 3600.0}
#: The longest period of a rate ("1/24h"): a throttle's (queue/coalesce.py) at most.
MAX_RATE_PERIOD = 24 * 3600.0
#: The keys a SKIPQUEUE['QUEUE_LIMITS'] entry may have.
LIMIT_KEYS = frozenset({"concurrency", "rate"})
#: The most jobs that share a concurrency key may run at once, and a queue's too.
MAX_CONCURRENCY = 32767
#: The largest fair-share weight of a job (a smallint column, no CHECK: checked here).
MAX_FAIR_WEIGHT = 1000


def whole_number_from_1(value: object, most: int) -> TypeGuard[int]:
    """Whether `value` is an int (a bool is not) from 1 to `most`: a limit's, a weight's."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most


def check_fair_weight(weight: object, task_name: str) -> int:
    """`weight` if it is a fair-share weight, 1 to MAX_FAIR_WEIGHT; ConfigurationError."""
    if not whole_number_from_1(weight, MAX_FAIR_WEIGHT):
        raise ConfigurationError(
            f"fair_weight of {task_name} must be an integer from 1 to {MAX_FAIR_WEIGHT}, "
            f"got {weight!r}"
        )
    return weight


@dataclass(frozen=True)
class QueueLimit:
    """At most `concurrency` running jobs of the queue, and at most `rate` job starts
    per `period` seconds (a token bucket holding up to `rate` starts), across every
    worker, on the database clock. None: no such limit."""

    concurrency: int | None = None
    rate: int | None = None
    period: float = 1.0

    @property
    def refill_per_second(self) -> float:
        return (self.rate or 0) / self.period


def parse_rate(value: object, where: str = "rate") -> tuple[int, float]:
    """ "10/s", "100/m", "5000/h", or with a number of units ("1/30s", "1/5m"), as (starts,
    period in seconds, at most MAX_RATE_PERIOD); ConfigurationError else."""
    match = RATE_PATTERN.fullmatch(value) if isinstance(value, str) else None
    units = int(match.group(2)) if match is not None and match.group(2) else 1
    if match is None or int(match.group(1)) < 1 or units < 1:
        raise ConfigurationError(
            f"{where} must be a positive number of starts per second, minute or hour, "
            f"written like '10/s', '100/m', '5000/h' or '1/30s'; got {value!r}"
        )
    period = units * PERIODS[match.group(3)]
    if period > MAX_RATE_PERIOD:
        raise ConfigurationError(f"{where}: a period of at most 24 hours; got {value!r}")
    return int(match.group(1)), period


def canonical_rate(value: object, where: str = "rate") -> str:
    """A rate as it is stored in a job's row: "10/s", "100/m", "5000/h", or "1/30s" for a
    period of several seconds (parse_rate's ConfigurationError for one that is not a
    rate)."""
    starts, period = parse_rate(value, where)
    unit = {1.0: "s", 60.0: "m", 3600.0: "h"}.get(period)
    return f"{starts}/{unit}" if unit is not None else f"{starts}/{period:g}s"


def limit_from_setting(queue: str, entry: object) -> QueueLimit:
    where = f"SKIPQUEUE['QUEUE_LIMITS'][{queue!r}]"
    entry = check_entry(where, entry, LIMIT_KEYS)
    concurrency = entry.get("concurrency")
    if concurrency is not None and not whole_number_from_1(concurrency, MAX_CONCURRENCY):
        raise ConfigurationError(
            f"{where}['concurrency'] must be an integer from 1 to {MAX_CONCURRENCY}, "
            f"got {concurrency!r}"
        )
    rate, period = (None, 1.0)
    if entry.get("rate") is not None:
        rate, period = parse_rate(entry["rate"], f"{where}['rate']")
    return QueueLimit(concurrency=concurrency, rate=rate, period=period)


def queue_limits() -> dict[str, QueueLimit]:
    """Every queue's limits, by queue name (ConfigurationError for a bad entry; the
    system check skipqueue.E011 reports the same)."""
    entries = get_settings().QUEUE_LIMITS
    if not isinstance(entries, dict):  # a process that ran no system check (gunicorn)
        raise ConfigurationError(
            "SKIPQUEUE['QUEUE_LIMITS'] must be a dict of queue names to dicts, such as "
            f"{{'reports': {{'concurrency': 3}}}}; got {entries!r}"
        )
    return {queue: limit_from_setting(queue, entry) for queue, entry in entries.items()}


def fair_queue_problems() -> list[str]:
    """What keeps SKIPQUEUE['FAIR_QUEUES'] from working, each in words (the system check
    skipqueue.E014; a worker refuses to start on them): a fair queue with a queue-wide
    limit (its limited claim takes jobs in claim order, not by share: not built), or
    relayed to RabbitMQ (the broker keeps no key)."""
    conf = get_settings()
    problems = []
    limited = conf.QUEUE_LIMITS if isinstance(conf.QUEUE_LIMITS, dict) else {}
    relay = conf.RELAY.get("QUEUES", ()) if isinstance(conf.RELAY, dict) else ()
    for queue in conf.FAIR_QUEUES:
        if queue in limited:
            problems.append(
                f"queue {queue!r} is in SKIPQUEUE['FAIR_QUEUES'] and in "
                f"SKIPQUEUE['QUEUE_LIMITS']: a fair queue with a queue-wide limit is not "
                f"supported; limit its keys instead (concurrency_key, rate_key)"
            )
        if queue in relay:
            problems.append(
                f"queue {queue!r} is in SKIPQUEUE['FAIR_QUEUES'] and relayed to RabbitMQ, "
                f"which keeps no fair key"
            )
    return problems
