"""Helpers for tests against the real RabbitMQ (relayed queues; see
docs/howto/outgrowing-one-postgresql.md).

The broker is SKIPQUEUE_TEST_AMQP_URL (default: guest on 127.0.0.1:5672). When it cannot
be reached the tests that need it are skipped, saying so, unless
SKIPQUEUE_TEST_REQUIRE_RABBITMQ=1 (as in .ci/run): then they fail.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import pika
import pytest

AMQP_URL = os.environ.get("SKIPQUEUE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def broker_unreachable() -> str:
    """Why RabbitMQ cannot be reached ("" when it can); raises instead when CI requires it."""
    try:
        pika.BlockingConnection(pika.URLParameters(AMQP_URL)).close()
    except pika.exceptions.AMQPError as error:
        if os.environ.get("SKIPQUEUE_TEST_REQUIRE_RABBITMQ") == "1":
            raise
        return f"RabbitMQ is not reachable at {AMQP_URL}: {error!r}"
    return ""


def broker_or_skip() -> None:
    if reason := broker_unreachable():
        pytest.skip(reason)


def relay_settings(queue: str, **extra: Any) -> dict[str, Any]:
    return {"RELAY": {"QUEUES": [queue], "URL": AMQP_URL, **extra}}


def fresh_queue_name() -> str:
    return f"relay-{uuid.uuid4().hex[:10]}"


def delete_broker_queues(queue: str) -> None:
    """Every broker queue of relayed queue `queue` (job, dead-letter and retry queues)."""
    from django_skipqueue.broker import MAX_RETRY_EXPONENT, broker_queue, dead_queue, retry_queue

    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        names = [broker_queue(queue), dead_queue(queue)]
        names += [retry_queue(queue, exponent) for exponent in range(MAX_RETRY_EXPONENT + 1)]
        for name in names:
            channel = connection.channel()
            channel.queue_delete(name)
            channel.close()
    finally:
        connection.close()


def drain(name: str) -> list[tuple[Any, Any, bytes]]:
    """Every message now in broker queue `name`, taken off it: (method, properties, body)."""
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    taken = []
    try:
        channel = connection.channel()
        while True:
            method, properties, body = channel.basic_get(name, auto_ack=True)
            if method is None:
                return taken
            taken.append((method, properties, body))
    finally:
        connection.close()


def depth(name: str) -> int:
    """Messages ready in broker queue `name` (0 if it is not declared yet)."""
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        return connection.channel().queue_declare(name, passive=True).method.message_count
    except pika.exceptions.ChannelClosedByBroker as error:
        if error.reply_code == 404:
            return 0
        raise
    finally:
        connection.close()
