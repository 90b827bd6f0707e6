"""The broker consumer: `runworker --broker` runs relayed queues' jobs from RabbitMQ.

One connection, a consuming channel with manual acks and a bounded prefetch, and a
publishing channel in confirm mode. Each delivery becomes an unsaved Job and runs in a
thread of the pool through `executor.run_brokered` (the same task call, context,
idempotency key, signals and logs as a PostgreSQL job). By its verdict:

- succeeded: acked (with RESULTS, once its outcome is written back to its row);
- retrying (or released by `Retry`): published to the retry queue of its backoff
  (`broker.retry_queue`, a TTL that dead-letters it back), confirmed, then acked;
- failed for good: published to `skipqueue.Q.dead` with its error, confirmed, acked
  (with RESULTS, its row ends failed with the error).

A message is acked only after what replaces it is confirmed by the broker, so a
consumer killed at any point causes a redelivery, never a loss. There is no fence:
a consumer that loses its connection while a task runs cannot ack it, and RabbitMQ
delivers the message again (the job id, the message id, lets the task deduplicate).
A lost connection is retried with backoff.

What counts against DELIVERY_LIMIT is every return of a message to its queue: a dead
consumer's unacked deliveries, a channel RabbitMQ closes for its consumer timeout, a
delivery pika returns because it arrived during a cancel. So: a redelivered message (or
a given-up attempt's retry) runs in a process of its own (`isolation.py`), whose crash
is counted against it alone; what is not started is given back as a fresh copy keeping
its count (`_hand_back`), never returned; the consumers are cancelled only to stop
(`_stop_consuming`, after taking in what was sent); and the consumer acts before the broker's
consumer timeout (`_overdue`), during a stop too.

Over 600 lines: these rules hold together in the one thread that talks to the broker
(pika's connection is not thread-safe); what it shares with the pool is `handoff.py`'s,
what it replies about a delivery `verdicts.py`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, connections

from django_skipqueue.broker.handoff import Done, Handoff, Held
from django_skipqueue.broker.isolation import Crashed, job_of, run_isolated
from django_skipqueue.broker.message import Message
from django_skipqueue.broker.topology import (
    BROKER_DELIVERIES_HEADER,
    DELIVERIES_HEADER,
    ERROR_HEADER,
    broker_queue,
    connect,
    dead_queue,
    declare,
    declare_retry,
    retry_exponent,
    retry_queue,
)
from django_skipqueue.broker.verdicts import (
    FINAL,
    ack,
    delivery_count,
    log_channel_closed,
    properties_with_error,
    write_back_params,
)
from django_skipqueue.conf import get_settings
from django_skipqueue.conf.relay import RelayConfig
from django_skipqueue.core.compat import pika_channel_impl
from django_skipqueue.exceptions import InvalidJobError
from django_skipqueue.models import Job, WorkerKind
from django_skipqueue.queue.connections import Backoff, discard_connection
from django_skipqueue.runtime.executor import Outcome, Verdict, describe_error, run_brokered
from django_skipqueue.runtime.meter import FLUSH_SECONDS, Meter
from django_skipqueue.runtime.presence import Presence
from django_skipqueue.runtime.runner import retry_delay
from django_skipqueue.runtime.timelimits import GRACE_SECONDS
from django_skipqueue.tasks.registry import registry

logger = logging.getLogger(__name__)

#: With RESULTS: the most outcomes written back in one statement, and how long one waits.
WRITE_BACK_BATCH = 200
WRITE_BACK_SECONDS = 0.2
#: Shares of the broker's consumer timeout (RELAY CONSUMER_TIMEOUT), counted from each
#: delivery as the broker counts it, after which the consumer acts itself
#: (`Consumer._overdue`): a delivery not started by half of it is handed back, never
#: started (so that a task starts with at least 0.4 of the timeout to run, and a large
#: prefetch is handed back long before the broker's close); one running at nine tenths
#: is timed out. The broker checks its timeout on its channel's tick, so it closes the
#: channel at that timeout or a little later, never before.
HAND_BACK_SHARE = 0.5
GIVE_UP_SHARE = 0.9
#: How long a stopping consumer whose thread is stuck in a task it gave up on waits for
#: its other running jobs before it closes its connection (they come again).
STUCK_STOP_SECONDS = 10.0
#: A job run in a process of its own (`isolation.py`) still running this long after its
#: attempt was timed out is killed (the consuming thread settles it first); below
#: GRACE_SECONDS, so the consumer never stops for such a job.
KILL_SECONDS = 0.5
#: Before a stopping consumer cancels its consumers (`Consumer._stop_consuming`), it
#: takes in what the broker sent until nothing came for this long (a round trip to the
#: broker, and then some), for at most TAKE_IN_SECONDS.
QUIET_SECONDS = 0.1
TAKE_IN_SECONDS = 1.0


@dataclass
class ConsumerStats:
    succeeded: int = 0
    retried: int = 0
    dead: int = 0
    reconnects: int = 0
    handed_back: int = 0  # deliveries published again unrun, keeping their count


class Consumer:
    """Consumes `queues` (relayed ones) with `concurrency` threads until `stop` is set."""

    def __init__(
        self,
        config: RelayConfig,
        *,
        queues: list[str] | None = None,
        concurrency: int = 4,
        database: str | None = None,
        meter: Meter | None = None,
    ) -> None:
        self.config = config
        #: Per-queue counts for the admin's charts (and Prometheus, if attached).
        self.meter = meter or Meter()
        self._flush_due = time.monotonic() + FLUSH_SECONDS
        self.queues = list(queues or config.queues)
        self.concurrency = concurrency
        self.prefetch = config.prefetch or 2 * concurrency
        self.database = database or get_settings().DATABASE_ALIAS
        self.stop = threading.Event()
        self.stats = ConsumerStats()
        #: What this thread and the pool's threads share (the deliveries held and their
        #: deadlines, finished ones, the pending wake-up): its own owner, with one lock.
        self._handoff = Handoff()
        self._generation = 0
        self._pending_write: list[Done] = []
        self._write_due = 0.0
        self._retry_declared: set[str] = set()
        self._running = 0  # deliveries handed to the pool and not acked yet
        #: After how long from its delivery a delivery waiting for a thread is handed
        #: back, and a running one is timed out (`_overdue`).
        self.hand_back_seconds = HAND_BACK_SHARE * config.consumer_timeout
        self.give_up_seconds = GIVE_UP_SHARE * config.consumer_timeout
        #: A task it gave up on still ran GRACE_SECONDS later: it stopped, to be replaced
        #: (`runworker --broker` exits with EXIT_TIME_LIMIT).
        self.stuck = False
        #: Its consumers' tags while it consumes; none once it stops (`_stop_consuming`).
        self._consumer_tags: list[str] = []
        self._taking_in = False  # `_stop_consuming` takes in what was sent: nothing is acked
        self._arrivals = 0  # deliveries so far (`_take_in` waits for none to come)
        #: Deliveries that came while stopping (tag, message, deliveries without an ack):
        #: given back, unstarted.
        self._unrun: list[tuple[int, Message, int]] = []
        #: Its row in the worker registry (kind consumer): written at start, beaten from
        #: the consuming loop, marked stopped at a clean stop.
        self.presence = Presence(
            kind=WorkerKind.CONSUMER,
            queues=self.queues,
            concurrency=concurrency,
            database=self.database,
        )

    # -- the loop ------------------------------------------------------------------

    def run(self) -> None:
        self.presence.register(self.stop)
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="skipqueue-broker")
        backoff = Backoff()
        logger.info(
            "broker consumer started queues=%s concurrency=%d prefetch=%d",
            ",".join(self.queues),
            self.concurrency,
            self.prefetch,
        )
        try:
            while not self.stop.is_set():
                try:
                    self._consume(pool, backoff)
                except Exception as error:  # noqa: BLE001  (the broker went away)
                    self.stats.reconnects += 1
                    self._pending_write.clear()  # their tags died with the channel
                    self._unrun.clear()
                    self._handoff.lost()
                    self._running = 0
                    delay = backoff.next()
                    logger.warning("broker consumer lost, retrying in %.2fs: %r", delay, error)
                    self.presence.beat()  # alive, if not connected: not "lost"
                    self.stop.wait(delay)
        finally:
            pool.shutdown(wait=not self.stuck)
            self._flush_counts(now=True)

            self.presence.stopped()
            connections[self.database].close()
            logger.info("broker consumer stopped")

    def _consume(self, pool: ThreadPoolExecutor, backoff: Backoff) -> None:
        connection = connect(self.config)
        self._generation += 1
        generation = self._generation
        try:
            channel = connection.channel()
            publisher = connection.channel()
            publisher.confirm_delivery()
            self._retry_declared.clear()
            for name in self.queues:
                declare(channel, name, self.config)
            pika_channel_impl(channel).add_on_close_callback(log_channel_closed)

            def deliver(ch: Any, method: Any, properties: Any, body: bytes) -> None:
                self._arrivals += 1
                try:
                    message = Message.decode(body, properties.headers)
                except InvalidJobError as error:
                    logger.error("broker message dropped to the dead queue: %s", error)
                    queue_name = method.routing_key.removeprefix("skipqueue.")
                    publisher.basic_publish(
                        "",
                        dead_queue(queue_name),
                        body,
                        properties_with_error(properties, str(error)),
                    )
                    ch.basic_ack(method.delivery_tag)
                    return
                headers = properties.headers or {}
                earlier = delivery_count(headers.get(DELIVERIES_HEADER))
                deliveries, isolated = 0, False
                if method.redelivered or earlier or message.alone:
                    # A consumer died or lost its connection holding it, or gave up on its
                    # last attempt while it ran: perhaps this message killed it. It runs
                    # in a process of its own (`isolation.py`), so that a crash on it
                    # holds no other message: the delivery limit counts every unacked
                    # delivery of a dead consumer, and innocent neighbours must not reach
                    # it with the poison.
                    deliveries = earlier + delivery_count(headers.get(BROKER_DELIVERIES_HEADER))
                    if method.redelivered and not headers.get(BROKER_DELIVERIES_HEADER):
                        deliveries += 1  # a classic queue does not count for us
                    if deliveries >= self.config.delivery_limit:
                        self._dead_letter_undelivered(
                            ch, publisher, method.delivery_tag, message, deliveries, generation
                        )
                        return
                    isolated = True
                if self._taking_in or not self._consuming or self.stop.is_set():
                    # Sent before the consumers were cancelled: not started, given back.
                    self._unrun.append((method.delivery_tag, message, deliveries))
                    return
                if isolated:
                    logger.info(
                        "job delivered again id=%s task=%s deliveries=%d: run in a process "
                        "of its own",
                        message.job_id,
                        message.task,
                        deliveries,
                    )
                self._submit(
                    pool,
                    generation,
                    method.delivery_tag,
                    message,
                    deliveries,
                    time.monotonic(),
                    isolated=isolated,
                )

            def turn() -> None:  # in this thread, from process_data_events
                if self._taking_in:
                    return  # nothing acked before the consumers are cancelled (`_stop_consuming`)
                self._overdue(channel, publisher, generation)
                self._settle(channel, publisher, generation)
                self._abandoned()
                self._flush_counts()

            # A finished job wakes this thread at once (the acks free prefetch room).
            self._handoff.connected(lambda: connection.add_callback_threadsafe(turn))
            self._resume(channel, deliver)
            backoff.reset()
            logger.info("broker consumer connected queues=%s", ",".join(self.queues))
            while not self.stop.is_set():
                connection.process_data_events(time_limit=0.2)
                turn()
                self.presence.beat()
            # Stopping: the consumers cancelled (`_stop_consuming`), then those not started are
            # given back, keeping their count (a return to the queue by the close would
            # add one against each, at every restart); those running finish and are
            # settled, the connection served meanwhile (the consumer timeout's rules
            # apply to them as before), within STUCK_STOP_SECONDS once a task it gave
            # up on did not return.
            self._stop_consuming(connection, channel)
            self._give_back_unstarted(channel, publisher, generation)
            until = None
            while self._running > 0:
                if self.stuck:
                    until = until or time.monotonic() + STUCK_STOP_SECONDS
                    if time.monotonic() >= until:
                        break
                connection.process_data_events(time_limit=0.1)
                turn()
            if self._handoff.abandoned_since() is not None:
                self.stuck = True  # a thread still in a task given up on: not waited for
            self._settle(channel, publisher, generation, final=True)
        finally:
            self._consumer_tags = []
            if connection.is_open:
                try:
                    connection.close()
                except Exception as error:  # noqa: BLE001
                    logger.debug("closing the broker connection failed: %r", error)

    # -- consuming, then stopping -------------------------------------------------------

    def _resume(self, channel: Any, deliver: Any) -> None:
        """Consume every queue, at `prefetch` unacked deliveries each (a per-consumer
        limit applies to the consumers made after it)."""
        channel.basic_qos(prefetch_count=self.prefetch)
        self._consumer_tags = [
            channel.basic_consume(broker_queue(name), deliver, auto_ack=False)
            for name in self.queues
        ]

    def _stop_consuming(self, connection: Any, channel: Any) -> None:
        """Stopping: no more deliveries, the consumers cancelled with as little in
        flight as can be.

        Nothing is acknowledged from here until the cancel is done, and first what the
        broker already sent is taken in (`_take_in`): a delivery that arrives during a
        cancel is returned to the queue by pika, and RabbitMQ counts the return as a
        delivery (T59 in tests/broker/test_relay.py). The window stays open to a message
        published meanwhile, so the consumers are cancelled only to stop, never to
        pause: redelivered jobs run in processes of their own instead (`isolation.py`)."""
        self._taking_in = True
        try:
            self._take_in(connection)
            for consumer_tag in self._consumer_tags:
                channel.basic_cancel(consumer_tag)
        finally:
            self._taking_in = False
        self._consumer_tags = []

    @property
    def _consuming(self) -> bool:
        return bool(self._consumer_tags)

    def _take_in(self, connection: Any) -> None:
        """Dispatch what the broker sent, until nothing came for QUIET_SECONDS (at most
        TAKE_IN_SECONDS): `deliver` keeps what comes now, unstarted."""
        until = time.monotonic() + TAKE_IN_SECONDS
        while time.monotonic() < until:
            arrivals = self._arrivals
            connection.process_data_events(time_limit=QUIET_SECONDS)
            if self._arrivals == arrivals:
                return

    def _give_back_unstarted(self, channel: Any, publisher: Any, generation: int) -> None:
        """What a stopping consumer holds and has not started, given back as fresh
        copies keeping their counts: those waiting for a thread, and those taken in
        while it stopped."""
        for tag, held in self._handoff.unstarted(generation):
            self._running -= 1
            self._hand_back(channel, publisher, tag, held.message, held.deliveries)
        for tag, message, deliveries in self._unrun:
            self._hand_back(channel, publisher, tag, message, deliveries)
        self._unrun.clear()

    def _submit(
        self,
        pool: ThreadPoolExecutor,
        generation: int,
        tag: int,
        message: Message,
        deliveries: int,
        came: float,
        *,
        isolated: bool = False,
    ) -> None:
        """Hand a delivery to the pool, held from `came` (`_overdue` says how long);
        `isolated`: run in a process of its own (`isolation.py`)."""
        self._running += 1
        held = Held(
            message,
            deliveries,
            came=came,
            hand_back_at=came + self.hand_back_seconds,
            give_up_at=came + self.give_up_seconds,
            isolated=isolated,
        )
        self._handoff.hold((generation, tag), held)
        pool.submit(self._run, generation, tag, held)

    def _abandoned(self) -> bool:
        """Whether a thread still runs a task given up on (`_overdue`). If it still runs
        GRACE_SECONDS later, the consumer stops, giving back what did not start, as a
        worker does for a task past its hard time limit (`runtime.timelimits`), and
        `runworker --broker` exits with EXIT_TIME_LIMIT for its supervisor to start
        another: the thread cannot be stopped, and the task may yet crash the process
        and take every delivery then unacked with it."""
        since = self._handoff.abandoned_since()
        if since is None:
            return False
        if not self.stuck and time.monotonic() - since >= GRACE_SECONDS:
            logger.error(
                "broker consumer: a task it gave up on still runs %gs later; stopping, "
                "to be replaced (its thread cannot be stopped)",
                GRACE_SECONDS,
            )
            self.stuck = True
            self.stop.set()
        return True

    def _hand_back(
        self, channel: Any, publisher: Any, tag: int, message: Message, deliveries: int
    ) -> None:
        """Publish a delivery that did not run again as a fresh copy that carries its count
        of deliveries so far (a return to the queue would add one), then ack it, sent at
        once: a job beside it may end the process, and an ack still in the client's
        buffer then is lost, the original returned and counted again
        beside its copy (1 innocent job of 150 dead-lettered, 1 run in 4 of T60's shape;
        tests/chaos/test_relay.py)."""
        headers = {DELIVERIES_HEADER: deliveries} if deliveries else {}
        publisher.basic_publish(
            "",
            broker_queue(message.queue),
            message.body(),
            message.properties(**headers),
            mandatory=True,
        )
        channel.basic_ack(tag)
        self.stats.handed_back += 1

    def _dead_letter_undelivered(
        self,
        channel: Any,
        publisher: Any,
        tag: int,
        message: Message,
        deliveries: int,
        generation: int,
    ) -> None:
        """A message delivered `deliveries` times to consumers that died holding it (the
        broker's own limit counts the copies of this one only): to the dead queue, then
        acked, as RabbitMQ does at the limit; with RESULTS, once its row is written back
        failed."""
        raised = DeliveryLimitError(
            f"delivered {deliveries} times without an ack (each consumer holding it died or "
            "lost its connection, or the process running it died); DELIVERY_LIMIT is "
            f"{self.config.delivery_limit}"
        )
        text = f"{DeliveryLimitError.__module__}.{DeliveryLimitError.__name__}: {raised}"
        logger.error("job dead-lettered id=%s task=%s: %s", message.job_id, message.task, text)
        publisher.basic_publish(
            "",
            dead_queue(message.queue),
            message.body(),
            message.properties(**{ERROR_HEADER: text}),
            mandatory=True,
        )
        self.stats.dead += 1
        if self.config.results:
            verdict = Verdict(Outcome.FAILED, 0.0, error=describe_error(raised))
            if not self._pending_write:
                self._write_due = time.monotonic() + WRITE_BACK_SECONDS
            self._pending_write.append(Done(generation, tag, message, verdict))
            return
        channel.basic_ack(tag)

    def _overdue(self, channel: Any, publisher: Any, generation: int) -> None:
        """Deliveries past their time (`Handoff.overdue`), counted from each delivery as
        RabbitMQ counts its consumer timeout:
        - one not started by half that timeout (it waited for a thread, behind long
          tasks): handed back, as a fresh copy keeping its count, never started late
          with little of the timeout left to run;
        - one running past its task's timeout, or at nine tenths of the broker's:
          settled as a failed attempt (retried through the broker, or dead-lettered
          after the last), as a worker gives up on it.
        The broker would otherwise close the channel, and count a delivery against every
        message unacked on it: innocent neighbours reached DELIVERY_LIMIT that way
        (tests/chaos/test_relay.py, T55). A running task's thread cannot be stopped:
        what it returns is dropped, and if it has not returned GRACE_SECONDS later the
        consumer stops (`_abandoned`)."""
        now = time.monotonic()
        found = self._handoff.overdue(generation, now)
        if found.unstarted:
            logger.warning(
                "broker consumer: %d job(s) waited %.0fs for a thread, half the broker's "
                "consumer timeout (RELAY CONSUMER_TIMEOUT %gs): handed back to the queue",
                len(found.unstarted),
                self.hand_back_seconds,
                self.config.consumer_timeout,
            )
        for tag, held in found.unstarted:
            self._running -= 1
            self._hand_back(channel, publisher, tag, held.message, held.deliveries)
        for tag, held, by_broker in found.running:
            verdict = self._timed_out(held, now, by_broker=by_broker)
            self._handoff.settle_here(Done(generation, tag, held.message, verdict, given_up=True))

    def _timed_out(self, held: Held, now: float, *, by_broker: bool) -> Verdict:
        """The verdict on a running delivery past its time (`_overdue`): a timed-out
        attempt, retried by its task's policy, as the runner does."""
        message = held.message
        task = registry.get(message.task) if message.task in registry else None
        started = held.started_at if held.started_at is not None else held.came
        seconds = now - started
        if by_broker:
            raised = TimeoutError(
                f"the job waited {started - held.came:.1f}s for a thread and ran "
                f"{seconds:.1f}s: nine tenths of the broker's consumer timeout (RELAY "
                f"CONSUMER_TIMEOUT {self.config.consumer_timeout:g}s), counted from its "
                "delivery; past it the broker would close the channel and count a "
                "delivery against every job unacked on it"
            )
        else:
            limit = task.timeout.total_seconds() if task and task.timeout else 0.0
            raised = TimeoutError(f"the task ran past its timeout of {limit}s")
        error = describe_error(raised)
        logger.error(
            "job timed out id=%s task=%s attempt=%d ran=%.3fs: its %s is given up on",
            message.job_id,
            message.task,
            message.attempt,
            seconds,
            "process" if held.isolated else "thread",
        )
        retry_in = retry_delay(task, raised, message.attempt)  # the runner's rule
        if retry_in is not None and message.attempt < message.max_attempts:
            return Verdict(Outcome.RETRYING, seconds, error=error, retry_in=retry_in)
        return Verdict(Outcome.FAILED, seconds, error=error)

    def _run(self, generation: int, tag: int, held: Held) -> None:
        message = held.message
        task = registry.get(message.task) if message.task in registry else None
        timeout = task.timeout.total_seconds() if task and task.timeout else None
        now = time.monotonic()
        if self.stop.is_set() or not self._handoff.start((generation, tag), timeout, now):
            return  # handed back while it waited, or its connection is gone
        crashed, given_up = None, False
        if held.isolated:
            # Killed a little after the consuming thread settles it as timed out.
            ran = run_isolated(message, database=self.database, deadline=held.due + KILL_SECONDS)
            if isinstance(ran, Crashed):
                verdict, crashed = Verdict(Outcome.FAILED, time.monotonic() - now), ran
            elif ran is None and not self._handoff.holds((generation, tag)):
                verdict = Verdict(Outcome.FAILED, 0.0)  # settled as timed out: dropped
            elif ran is None:  # killed at its deadline, before the consuming thread saw it
                given_up = True
                verdict = self._timed_out(held, time.monotonic(), by_broker=held.by_broker)
            else:
                verdict = ran
        else:
            try:
                verdict = run_brokered(job_of(message), database=self.database)
            except Exception as error:  # noqa: BLE001  (a signal receiver, say): settle it
                logger.exception("broker consumer: job id=%s could not run", message.job_id)
                verdict = Verdict(Outcome.FAILED, 0.0, error=describe_error(error))
            finally:
                connections[self.database].close_if_unusable_or_obsolete()
        # A delivery settled already as timed out (_overdue): this late outcome is dropped.
        self._handoff.finish(
            Done(
                generation,
                tag,
                message,
                verdict,
                given_up=given_up,
                deliveries=held.deliveries,
                crashed=crashed,
            )
        )

    # -- acting on verdicts ------------------------------------------------------------

    def _settle(
        self, channel: Any, publisher: Any, generation: int, *, final: bool = False
    ) -> None:
        for done in self._handoff.drain():
            if done.generation != generation:
                continue  # its channel is gone: RabbitMQ delivers it again
            self._running -= 1
            if done.crashed is not None:
                self._crashed(channel, publisher, done)
                continue
            outcome = done.verdict.outcome
            self.meter.finished(
                done.message.queue,
                done.message.task,
                outcome,
                done.verdict.duration,
                done.verdict.error,
                done.message.job_id,
            )
            if outcome in (Outcome.RETRYING, Outcome.RELEASED):
                self._publish_retry(publisher, done)
                self.stats.retried += 1
            elif outcome is Outcome.FAILED:
                error = done.verdict.error
                text = f"{error.type}: {error.message}" if error else "failed"
                publisher.basic_publish(
                    "",
                    dead_queue(done.message.queue),
                    done.message.body(),
                    done.message.properties(**{ERROR_HEADER: text[:1000]}),
                    mandatory=True,
                )
                self.stats.dead += 1
            else:
                self.stats.succeeded += 1
            if self.config.results:
                if not self._pending_write:
                    self._write_due = time.monotonic() + WRITE_BACK_SECONDS
                self._pending_write.append(done)
            else:
                ack(channel, done.tag)
        if self._pending_write and (
            final
            or len(self._pending_write) >= WRITE_BACK_BATCH
            or time.monotonic() >= self._write_due
        ):
            self._write_back(channel)

    def _crashed(self, channel: Any, publisher: Any, done: Done) -> None:
        """The process of a job run in a process of its own ended without a verdict: one
        more delivery without an ack, counted against this job alone, as RabbitMQ counts
        a consumer's death against what it held. At DELIVERY_LIMIT, the dead queue;
        else a fresh copy carrying the count, run in a process of its own again."""
        assert done.crashed is not None  # noqa: S101  (only crashed deliveries come here)
        deliveries = done.deliveries + 1
        message = done.message
        logger.error(
            "job's process died id=%s task=%s attempt=%d (%s): delivery %d of %d",
            message.job_id,
            message.task,
            message.attempt,
            done.crashed.reason,
            deliveries,
            self.config.delivery_limit,
        )
        if deliveries >= self.config.delivery_limit:
            self._dead_letter_undelivered(
                channel, publisher, done.tag, message, deliveries, done.generation
            )
        else:
            self._hand_back(channel, publisher, done.tag, message, deliveries)

    def _flush_counts(self, *, now: bool = False) -> None:
        """Every FLUSH_SECONDS, the counts since the last flush into the minute rows."""
        if not now and time.monotonic() < self._flush_due:
            return
        self._flush_due = time.monotonic() + FLUSH_SECONDS
        try:
            self.meter.flush(self.database)
        except DatabaseError as error:  # kept for the next flush
            logger.warning("broker consumer: counts not written: %s", error)

    def _publish_retry(self, publisher: Any, done: Done) -> None:
        delay = done.verdict.retry_in or timedelta(seconds=1)
        exponent = retry_exponent(delay)
        name = f"{done.message.queue}:{exponent}"
        if name not in self._retry_declared:
            declare_retry(publisher, done.message.queue, exponent)
            self._retry_declared.add(name)
        released = done.verdict.outcome is Outcome.RELEASED
        following = done.message.next_attempt(released=released, alone=done.given_up)
        publisher.basic_publish(
            "",
            retry_queue(done.message.queue, exponent),
            following.body(),
            following.properties(),
            mandatory=True,
        )

    def _write_back(self, channel: Any) -> None:
        """RESULTS: the outcomes of finished deliveries, in one statement; then their acks."""
        finals = [d for d in self._pending_write if d.verdict.outcome in FINAL]
        try:
            if finals:
                Job.objects.db_manager(self.database).write_back(write_back_params(finals))
        except DatabaseError as error:
            discard_connection(self.database)
            logger.warning(
                "broker consumer: writing %d outcomes back failed: %r", len(finals), error
            )
            return  # kept: the next turn tries again, and the acks wait for it
        for done in self._pending_write:
            ack(channel, done.tag)
        self._pending_write.clear()


class DeliveryLimitError(Exception):
    """The error a consumer records on a message it dead-letters at the delivery limit."""
