"""RabbitMQ for relayed queues (docs/howto/outgrowing-one-postgresql.md).

- `topology`: the queues per relayed queue, their names, connecting and declaring;
- `message`: one job as it travels (body and headers);
- `publisher`: publishing with confirms;
- `relay`: job rows to the broker (the outbox);
- `consumer`: the broker to the executor (`runworker --broker`).

The settings are `django_skipqueue.conf.relay`. Only this layer imports pika, and only
when a broker is used (the optional extra `django-skipqueue[rabbitmq]`).
"""

from __future__ import annotations

from django_skipqueue.broker.message import Message
from django_skipqueue.broker.publisher import BatchPublisher, PublishRefusedError
from django_skipqueue.broker.topology import (
    ALONE_HEADER,
    ATTEMPT_HEADER,
    BROKER_DELIVERIES_HEADER,
    DELIVERIES_HEADER,
    ERROR_HEADER,
    MAX_RETRY_EXPONENT,
    broker_depths,
    broker_queue,
    connect,
    dead_queue,
    declare,
    declare_retry,
    pika_module,
    retry_exponent,
    retry_queue,
)
from django_skipqueue.conf.relay import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DELIVERY_LIMIT,
    RELAY_KEYS,
    RelayConfig,
    relay_config,
    relayed_queues,
)

__all__ = [
    "ALONE_HEADER",
    "ATTEMPT_HEADER",
    "BROKER_DELIVERIES_HEADER",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_DELIVERY_LIMIT",
    "DELIVERIES_HEADER",
    "ERROR_HEADER",
    "MAX_RETRY_EXPONENT",
    "RELAY_KEYS",
    "BatchPublisher",
    "Message",
    "PublishRefusedError",
    "RelayConfig",
    "broker_depths",
    "broker_queue",
    "connect",
    "dead_queue",
    "declare",
    "declare_retry",
    "pika_module",
    "relay_config",
    "relayed_queues",
    "retry_exponent",
    "retry_queue",
]
