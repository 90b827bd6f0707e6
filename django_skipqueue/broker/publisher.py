"""Publishing to RabbitMQ with confirms, many messages per wait (the relay's batches)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from django_skipqueue.core.compat import pika_channel_impl

if TYPE_CHECKING:
    import pika

    from django_skipqueue.broker.message import Message


class PublishRefusedError(Exception):
    """The broker did not take every message of a batch (a negative confirm, a message
    it could not route, or no confirm within the timeout): publish the batch again."""


class BatchPublisher:
    """Publishes a batch of persistent messages, then waits once for all the broker's
    publisher confirms (a quorum queue confirms after a majority wrote the message).

    pika's BlockingChannel in confirm mode waits for each confirm in turn, one round
    trip and one quorum write per message; this takes the channel's confirms
    asynchronously (pika's own Channel.confirm_delivery, under the blocking adapter) so
    that a batch costs about one. pika is pinned below 2 (pyproject.toml).
    """

    def __init__(self, connection: pika.BlockingConnection, timeout: float = 30.0) -> None:
        self.connection = connection
        self.timeout = timeout
        self.channel = connection.channel()
        self._sent = 0  # the channel's last publish sequence number
        self._confirmed = 0  # every number up to this one is confirmed (or refused)
        self._unconfirmed: set[int] = set()
        self._refused: list[str] = []
        selected: list[bool] = []
        impl = pika_channel_impl(self.channel)
        impl.add_on_return_callback(self._on_return)
        impl.confirm_delivery(
            ack_nack_callback=self._on_confirm, callback=lambda frame: selected.append(True)
        )
        self._wait_until(lambda: bool(selected), "confirm mode")

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tags = (
            {tag for tag in self._unconfirmed if tag <= method.delivery_tag}
            if method.multiple
            else {method.delivery_tag}
        )
        self._unconfirmed -= tags
        if method.NAME == "Basic.Nack":
            self._refused.append(f"negative confirm for {len(tags)} message(s)")

    def _on_return(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        self._refused.append(
            f"message {properties.message_id} returned: {method.reply_code} {method.reply_text}"
        )

    def _wait_until(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise PublishRefusedError(
                    f"no answer from the broker within {self.timeout}s ({what})"
                )
            self.connection.process_data_events(time_limit=min(left, 0.05))

    def publish(self, routing_key: str, message: Message) -> None:
        # Counted before the call: basic_publish flushes the socket, and the broker's
        # confirm may be read (and handled) before it returns.
        self._sent += 1
        self._unconfirmed.add(self._sent)
        # The underlying channel's publish only queues the frames; confirm() sends
        # them in one go (BlockingChannel.basic_publish would flush each one).
        pika_channel_impl(self.channel).basic_publish(
            "", routing_key, message.body(), message.properties(), mandatory=True
        )

    def confirm(self) -> None:
        """Wait until every message published so far is confirmed; PublishRefusedError
        if one was refused or returned, or the broker did not answer in time."""
        self._wait_until(lambda: not self._unconfirmed, "publisher confirms")
        if self._refused:
            refused, self._refused = self._refused, []
            raise PublishRefusedError("; ".join(refused[:3]))
