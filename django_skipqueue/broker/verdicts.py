"""What a broker consumer sends back about a delivery, and reads from one: its ack, the
error header of a dead-lettered copy, the rows its outcomes write back (RESULTS), the
delivery count a header holds, and why the broker closed the channel.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from django_skipqueue.broker.handoff import Done
from django_skipqueue.broker.topology import (
    ERROR_HEADER,
    pika_module,
)
from django_skipqueue.core.compat import pika_channel_impl
from django_skipqueue.core.redaction import redact_text
from django_skipqueue.core.states import JobState
from django_skipqueue.runtime.executor import Outcome

logger = logging.getLogger("django_skipqueue.broker.consumer")


FINAL = (Outcome.SUCCEEDED, Outcome.FAILED)


def delivery_count(value: object) -> int:
    """A delivery count from a header: 0 unless a non-negative integer."""
    return value if isinstance(value, int) and value > 0 else 0


def log_channel_closed(channel: Any, reason: Exception) -> None:
    """Say why the broker closed the consuming channel: the deliveries it held are
    delivered again, and each such close counts against their delivery limit."""
    text = str(reason)
    if "timed out" in text or "consumer_timeout" in text:
        logger.error(
            "broker channel closed by RabbitMQ's consumer timeout: a delivery stayed "
            "unacked longer than the broker's consumer_timeout (its deliveries come "
            "again, counted against DELIVERY_LIMIT); give long tasks a timeout below it, "
            "or raise it: %s",
            text,
        )
    elif getattr(reason, "reply_code", None) == 200:  # ours: a clean close or a stop
        logger.debug("broker channel closed: %s", text)
    else:
        logger.warning("broker channel closed: %s", text)


def ack(channel: Any, tag: int) -> None:
    """Acknowledge one delivery without flushing the socket at once: the frames of a
    turn's acks leave together at the next I/O of the connection's loop (pika's
    BlockingChannel.basic_ack would send and poll once for each)."""
    pika_channel_impl(channel).basic_ack(tag)


def properties_with_error(properties: Any, text: str) -> Any:
    pika = pika_module()
    headers = dict(properties.headers or {})
    headers[ERROR_HEADER] = redact_text(text)[:1000]
    return pika.BasicProperties(
        message_id=properties.message_id,
        delivery_mode=2,
        content_type=properties.content_type,
        headers=headers,
    )


def write_back_params(finals: list[Done]) -> list[Any]:
    ids, states, results, errors, attempts = [], [], [], [], []
    for done in finals:
        succeeded = done.verdict.outcome is Outcome.SUCCEEDED
        ids.append(done.message.job_id)
        states.append(JobState.DONE if succeeded else JobState.FAILED)
        results.append(json.dumps(done.verdict.result) if succeeded else None)
        error = done.verdict.error
        errors.append("" if error is None else f"{error.type}: {error.message}\n{error.traceback}")
        attempts.append(done.message.attempt)
    return [ids, states, results, errors, attempts]
