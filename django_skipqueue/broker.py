"""RabbitMQ for relayed queues: the settings, the topology and the message format.

Read from SKIPQUEUE['RELAY'] (`conf` is the sole reader of settings). Shared by the
relay (`relay.py`: job rows to the broker) and the consumer (`consumer.py`: the broker
to the executor). The AMQP client is pika, from the optional extra
`django-skipqueue[rabbitmq]`; it is imported only when a broker is used.

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

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django_skipqueue.conf import check_entry, get_settings
from django_skipqueue.exceptions import ConfigurationError, InvalidJobError
from django_skipqueue.states import validate_queue_name

if TYPE_CHECKING:
    import pika
    from pika.adapters.blocking_connection import BlockingChannel

#: The keys SKIPQUEUE['RELAY'] may have.
RELAY_KEYS = frozenset({"QUEUES", "URL", "BATCH_SIZE", "PREFETCH", "RESULTS", "DELIVERY_LIMIT"})
DEFAULT_BATCH_SIZE = 200
DEFAULT_DELIVERY_LIMIT = 5
#: The longest backoff a retry waits in the broker (2**16 s, about 18 hours).
MAX_RETRY_EXPONENT = 16
#: The message header that carries the attempt number a delivery is.
ATTEMPT_HEADER = "x-skipqueue-attempt"
ERROR_HEADER = "x-skipqueue-error"
#: The header of a redelivered message a consumer published again as a fresh copy (to
#: run it alone, `consumer.Consumer._isolate`): how many deliveries it had already had
#: without an ack. Fresh copies keep counting against the delivery limit with it, and
#: are run alone again.
DELIVERIES_HEADER = "x-skipqueue-deliveries"
#: What a quorum queue adds to a message delivered again: its earlier deliveries.
BROKER_DELIVERIES_HEADER = "x-delivery-count"


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
    """

    queues: tuple[str, ...] = ()
    url: str = ""
    batch_size: int = DEFAULT_BATCH_SIZE
    prefetch: int | None = None
    results: bool = False
    delivery_limit: int = DEFAULT_DELIVERY_LIMIT

    @property
    def enabled(self) -> bool:
        return bool(self.queues)


def _positive_int(where: str, value: object, *, none: bool = False) -> Any:
    if none and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{where} must be a positive integer, got {value!r}")
    return value


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
    )


def relayed_queues() -> frozenset[str]:
    """The queues whose jobs go through the broker ({} when the relay is off or unreadable:
    the check reports the latter)."""
    try:
        return frozenset(relay_config().queues)
    except ConfigurationError:
        return frozenset()


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
            "relayed queues need the AMQP client pika: pip install 'django-skipqueue[rabbitmq]'"
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
        impl = self.channel._impl
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
        self.channel._impl.basic_publish(
            "", routing_key, message.body(), message.properties(), mandatory=True
        )

    def confirm(self) -> None:
        """Wait until every message published so far is confirmed; PublishRefusedError
        if one was refused or returned, or the broker did not answer in time."""
        self._wait_until(lambda: not self._unconfirmed, "publisher confirms")
        if self._refused:
            refused, self._refused = self._refused, []
            raise PublishRefusedError("; ".join(refused[:3]))


# -- messages ----------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One job as it travels through the broker (the body is JSON; the job's id is
    the message id too, the consumers' deduplication key)."""

    job_id: int
    task: str
    queue: str
    args: list[Any]
    kwargs: dict[str, Any]
    attempt: int  # the attempt this delivery is, from 1
    max_attempts: int
    lease_seconds: float

    def body(self) -> bytes:
        return json.dumps(
            {
                "id": self.job_id,
                "task": self.task,
                "queue": self.queue,
                "args": self.args,
                "kwargs": self.kwargs,
                "max_attempts": self.max_attempts,
                "lease_seconds": self.lease_seconds,
            },
            separators=(",", ":"),
        ).encode()

    def properties(self, **headers: Any) -> pika.BasicProperties:
        pika = pika_module()
        return pika.BasicProperties(
            message_id=str(self.job_id),
            delivery_mode=2,  # persistent
            content_type="application/json",
            headers={ATTEMPT_HEADER: self.attempt, **headers},
        )

    def next_attempt(self, *, released: bool = False) -> Message:
        """The message of the next attempt. `released` (the task raised Retry): the
        attempt is given back, as in the table, by one more allowed attempt."""
        return dataclasses.replace(
            self,
            attempt=self.attempt + 1,
            max_attempts=self.max_attempts + (1 if released else 0),
        )

    @classmethod
    def decode(cls, body: bytes, headers: dict[str, Any] | None) -> Message:
        """The message of `body`; InvalidJobError saying what is wrong with it."""
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                raise TypeError(f"the body is a JSON {_json_kind(data)}, not an object")
            if not isinstance(data["args"], list):
                raise TypeError(f"'args' is a JSON {_json_kind(data['args'])}, not an array")
            if not isinstance(data["kwargs"], dict):
                raise TypeError(f"'kwargs' is a JSON {_json_kind(data['kwargs'])}, not an object")
            return cls(
                job_id=int(data["id"]),
                task=str(data["task"]),
                queue=str(data["queue"]),
                args=list(data["args"]),
                kwargs=dict(data["kwargs"]),
                attempt=int((headers or {}).get(ATTEMPT_HEADER, 1)),
                max_attempts=int(data["max_attempts"]),
                lease_seconds=float(data["lease_seconds"]),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise InvalidJobError(f"a broker message is not a job: {error!r}") from None


def _json_kind(value: object) -> str:
    """What JSON calls the type of a decoded `value`."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")
