"""RabbitMQ for relayed queues: the topology, its names and the headers.

The settings are `conf.relay`. Shared by the relay (`relay.py`: job rows to the
broker) and the consumer (`consumer.py`: the broker to the executor). The AMQP client
is pika, from the optional extra `django-skipqueue[rabbitmq]`; it is imported only
when a broker is used.

Topology, per relayed queue Q (all durable, declared idempotently by both sides):
- `skipqueue.Q`: a quorum queue, the jobs to run. Its `x-delivery-limit` dead-letters a
  message that was delivered that many times without an ack (a poison message that
  kills its consumers) to `skipqueue.Q.dead`, at least once.
- `skipqueue.Q.dead`: a quorum queue, the jobs that failed for good or were poison;
  `relayjobs --redrive Q` publishes them to `skipqueue.Q` again.
- `skipqueue.Q.retry.N`: a classic queue whose messages expire after N seconds (a power
  of two) and are then dead-lettered back to `skipqueue.Q`: the backoff of a retry.
  One TTL per queue, so that no message waits behind a longer one.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django_skipqueue.conf.relay import RelayConfig
from django_skipqueue.exceptions import ConfigurationError

if TYPE_CHECKING:
    import pika
    from pika.adapters.blocking_connection import BlockingChannel

#: The longest backoff a retry waits in the broker (2**16 s, about 18 hours).
MAX_RETRY_EXPONENT = 16
#: The message header that carries the attempt number a delivery is.
ATTEMPT_HEADER = "x-skipqueue-attempt"
ERROR_HEADER = "x-skipqueue-error"
#: The header of a redelivered message a consumer published again as a fresh copy (it
#: did not start it, or the process it ran in died): how many deliveries it had already
#: had without an ack. Fresh copies keep counting against the delivery limit with it,
#: and run in a process of their own (`broker/isolation.py`).
DELIVERIES_HEADER = "x-skipqueue-deliveries"
#: What a quorum queue adds to a message delivered again: its earlier deliveries.
BROKER_DELIVERIES_HEADER = "x-delivery-count"
#: The header of a job's next attempt after its consumer gave up on a running one (a
#: timeout): that attempt runs in a process of its own, as a redelivered message does,
#: so that a task that kills its process only after the timeout takes no other message
#: with it.
ALONE_HEADER = "x-skipqueue-alone"


# -- names -------------------------------------------------------------------------


def broker_queue(queue: str) -> str:
    return f"skipqueue.{queue}"


def dead_queue(queue: str) -> str:
    return f"skipqueue.{queue}.dead"


def retry_exponent(delay: timedelta) -> int:
    """The retry queue for `delay`: the smallest power of two seconds at least as long."""
    seconds = max(delay.total_seconds(), 1.0)
    return min(math.ceil(math.log2(seconds)), MAX_RETRY_EXPONENT)


def retry_queue(queue: str, exponent: int) -> str:
    return f"skipqueue.{queue}.retry.{2**exponent}"


# -- the client --------------------------------------------------------------------


def pika_module() -> Any:
    try:
        import pika
    except ImportError:
        raise ConfigurationError(
            "relayed queues need the AMQP client pika: install the rabbitmq extra "
            "(pip install -e '/path/to/django-skipqueue[rabbitmq]') or pip install pika"
        ) from None
    return pika


def connect(config: RelayConfig) -> pika.BlockingConnection:
    pika = pika_module()
    parameters = pika.URLParameters(config.url)
    parameters.heartbeat = 30
    parameters.blocked_connection_timeout = 60
    parameters.connection_attempts = 1
    return pika.BlockingConnection(parameters)


def declare(channel: BlockingChannel, queue: str, config: RelayConfig) -> None:
    """Declare a relayed queue's job queue and dead-letter queue (idempotent)."""
    channel.queue_declare(dead_queue(queue), durable=True, arguments={"x-queue-type": "quorum"})
    channel.queue_declare(
        broker_queue(queue),
        durable=True,
        arguments={
            "x-queue-type": "quorum",
            "x-delivery-limit": config.delivery_limit,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dead_queue(queue),
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        },
    )


def declare_retry(channel: BlockingChannel, queue: str, exponent: int) -> str:
    name = retry_queue(queue, exponent)
    channel.queue_declare(
        name,
        durable=True,
        arguments={
            "x-message-ttl": (2**exponent) * 1000,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": broker_queue(queue),
        },
    )
    return name


def broker_depths(config: RelayConfig, timeout: float = 2.0) -> dict[str, tuple[int, int]]:
    """Per relayed queue, the messages ready in its broker queue and its dead-letter
    queue; {} when the broker cannot be reached within `timeout` (the overview says so).
    Passive declares: nothing is created."""
    pika = pika_module()
    parameters = pika.URLParameters(config.url)
    parameters.socket_timeout = parameters.blocked_connection_timeout = timeout
    parameters.connection_attempts = 1
    with quiet_pika():
        return _probe(pika, parameters, config)


def _probe(pika: Any, parameters: Any, config: RelayConfig) -> dict[str, tuple[int, int]]:
    depths: dict[str, tuple[int, int]] = {}
    try:
        connection = pika.BlockingConnection(parameters)
    except pika.exceptions.AMQPError:
        return {}
    try:
        for queue in config.queues:
            counts = []
            for name in (broker_queue(queue), dead_queue(queue)):
                channel = connection.channel()
                try:
                    counts.append(channel.queue_declare(name, passive=True).method.message_count)
                    channel.close()
                except pika.exceptions.ChannelClosedByBroker:  # not declared yet
                    counts.append(0)
            depths[queue] = (counts[0], counts[1])
    except pika.exceptions.AMQPError:
        return {}
    finally:
        if connection.is_open:
            connection.close()
    return depths


class _ThisThread(logging.Filter):
    """Drops the records of one thread: the probe's, and no other's."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextmanager
def quiet_pika() -> Iterator[None]:
    """Silence pika's own loggers for what this thread does inside the block.

    A passive declare of a queue not declared yet is how the probe learns it is empty,
    and pika logs that channel close ("404 NOT_FOUND - no queue ...") and its
    connection steps at INFO and WARNING, which under a root logger at INFO reads like
    an error in `queuestats`. A filter on each of pika's loggers drops this thread's
    records and is removed afterwards: no level is changed, and pika's logging from
    other threads, before and after, goes where the project sends it.
    """
    quiet = _ThisThread()
    manager = logging.Logger.manager
    names = [
        name for name in list(manager.loggerDict) if name == "pika" or name.startswith("pika.")
    ]
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
