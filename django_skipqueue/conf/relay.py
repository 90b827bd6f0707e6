"""SKIPQUEUE['RELAY']: which queues go through RabbitMQ, and how to reach it.

Parsed here, with the other settings, so that the worker, the checks and the stats learn
of relayed queues without importing the broker layer (or pika).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django_skipqueue.conf import check_entry, get_settings
from django_skipqueue.conf.validators import validate_queue_name
from django_skipqueue.exceptions import ConfigurationError, InvalidJobError

#: The keys SKIPQUEUE['RELAY'] may have.
RELAY_KEYS = frozenset(
    {"QUEUES", "URL", "BATCH_SIZE", "PREFETCH", "RESULTS", "DELIVERY_LIMIT", "CONSUMER_TIMEOUT"}
)
DEFAULT_BATCH_SIZE = 200
DEFAULT_DELIVERY_LIMIT = 5
#: RabbitMQ's own default `consumer_timeout` (30 minutes), in seconds.
DEFAULT_CONSUMER_TIMEOUT = 1800.0


@dataclass(frozen=True)
class RelayConfig:
    """The relayed queues and how to reach and use the broker.

    - `queues`: the queues whose jobs go through RabbitMQ (their rows are the outbox).
    - `url`: the AMQP URL, e.g. "amqp://user:password@host:5672/vhost".
    - `batch_size`: rows the relay publishes per transaction (and per confirm wait).
    - `prefetch`: unacked messages a consumer holds (None: twice its concurrency).
    - `results`: keep the rows and write outcomes back (`get_result()` works); off,
      the relay deletes each row once the broker confirmed it.
    - `delivery_limit`: deliveries without an ack before RabbitMQ dead-letters a
      message (a poison message that kills consumers).
    - `consumer_timeout`: the broker's `consumer_timeout`, in seconds. A consumer acts
      before it: a delivery that waited that long for a thread is handed back, one
      that ran that long is timed out (`consumer.Consumer._overdue`).
    """

    queues: tuple[str, ...] = ()
    url: str = ""
    batch_size: int = DEFAULT_BATCH_SIZE
    prefetch: int | None = None
    results: bool = False
    delivery_limit: int = DEFAULT_DELIVERY_LIMIT
    consumer_timeout: float = DEFAULT_CONSUMER_TIMEOUT

    @property
    def enabled(self) -> bool:
        return bool(self.queues)


def _positive_int(where: str, value: object, *, none: bool = False) -> Any:
    if none and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{where} must be a positive integer, got {value!r}")
    return value


def _positive_seconds(where: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigurationError(f"{where} must be a positive number of seconds, got {value!r}")
    return float(value)


def relay_config() -> RelayConfig:
    """SKIPQUEUE['RELAY'] as a RelayConfig (ConfigurationError naming a bad entry; the
    system check skipqueue.E012 reports the same). Empty: no relayed queue."""
    entry = get_settings().RELAY
    if not entry:
        return RelayConfig()
    where = "SKIPQUEUE['RELAY']"
    entry = check_entry(where, entry, RELAY_KEYS)
    queues = entry.get("QUEUES")
    if not isinstance(queues, (list, tuple)) or not queues:
        raise ConfigurationError(f"{where}['QUEUES'] must be a non-empty list of queue names")
    for name in queues:
        try:
            validate_queue_name(name)
        except InvalidJobError as error:
            raise ConfigurationError(f"{where}['QUEUES']: {error}") from None
    url = entry.get("URL")
    if not isinstance(url, str) or not url.startswith(("amqp://", "amqps://")):
        raise ConfigurationError(f"{where}['URL'] must be an amqp:// or amqps:// URL")
    results = entry.get("RESULTS", False)
    if not isinstance(results, bool):
        raise ConfigurationError(f"{where}['RESULTS'] must be True or False, got {results!r}")
    return RelayConfig(
        queues=tuple(dict.fromkeys(queues)),
        url=url,
        batch_size=_positive_int(
            f"{where}['BATCH_SIZE']", entry.get("BATCH_SIZE", DEFAULT_BATCH_SIZE)
        ),
        prefetch=_positive_int(f"{where}['PREFETCH']", entry.get("PREFETCH"), none=True),
        results=results,
        delivery_limit=_positive_int(
            f"{where}['DELIVERY_LIMIT']", entry.get("DELIVERY_LIMIT", DEFAULT_DELIVERY_LIMIT)
        ),
        consumer_timeout=_positive_seconds(
            f"{where}['CONSUMER_TIMEOUT']",
            entry.get("CONSUMER_TIMEOUT", DEFAULT_CONSUMER_TIMEOUT),
        ),
    )


def relayed_queues() -> frozenset[str]:
    """The queues whose jobs go through the broker ({} when the relay is off or unreadable:
    the check reports the latter)."""
    try:
        return frozenset(relay_config().queues)
    except ConfigurationError:
        return frozenset()
