"""The relay: job rows of relayed queues, published to RabbitMQ (a transactional outbox).

Enqueue does not change: an INSERT in the caller's transaction, so a job exists if and
only if the business write committed, and only committed rows are ever seen here. Each
pass is one short transaction:

1. select up to BATCH_SIZE due pending rows of the relayed queues, `FOR NO KEY UPDATE
   SKIP LOCKED` (several relays share the work; none waits on another);
2. publish each as a persistent message to its quorum queue, the job id as message id,
   and wait for the broker's publisher confirm;
3. delete the rows (or, with RESULTS, mark them `relayed`), and commit.

A relay killed between the broker's confirm and the commit leaves the rows pending
(its transaction dies with its connection), and the next pass publishes them again:
a duplicate, never a loss, and at most one batch per kill. Consumers deduplicate on
the message id (the job id) when a task must not run twice.

The relay wakes on the queues' NOTIFY (the notifier, as workers do) and polls every
POLL_INTERVAL_SECONDS otherwise; a lost broker or database connection is retried with
backoff, so a restarted RabbitMQ is picked up again on its own.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, connections

from django_skipqueue.broker.message import Message
from django_skipqueue.broker.publisher import BatchPublisher
from django_skipqueue.broker.topology import broker_queue, connect, declare
from django_skipqueue.conf import get_settings
from django_skipqueue.conf.relay import RelayConfig
from django_skipqueue.models import Job, WorkerKind
from django_skipqueue.queue.connections import Backoff, bounded, discard_connection
from django_skipqueue.runtime.notifier import Notifier
from django_skipqueue.runtime.presence import Presence
from django_skipqueue.runtime.waiting import Waiting

logger = logging.getLogger(__name__)


@dataclass
class RelayStats:
    published: int = 0
    passes: int = 0
    reconnects: int = 0
    errors: list[str] = field(default_factory=list)


class Relay:
    """Publishes the relayed queues' pending rows to RabbitMQ until `stop` is set."""

    def __init__(
        self, config: RelayConfig, *, database: str | None = None, listen: bool = True
    ) -> None:
        self.config = config
        self.database = database or get_settings().DATABASE_ALIAS
        self.listen = listen
        self.stats = RelayStats()
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None  # when run in a thread of a worker
        self._connection: Any = None
        self._publishing: BatchPublisher | None = None
        #: Its row in the worker registry (kind relay, the relayed queues) while `run()`
        #: runs: beaten from its loop, marked stopped at a clean stop.
        self.presence = Presence(
            kind=WorkerKind.RELAY, queues=config.queues, concurrency=1, database=self.database
        )
        #: Whether it waits for its queues' NOTIFY, as a worker does (runtime/waiting.py).
        self.waiting = Waiting(database=self.database)
        self.presence.waiting = self.waiting

    # -- the broker ------------------------------------------------------------------

    def _publisher(self) -> BatchPublisher:
        if self._publishing is not None and self._publishing.channel.is_open:
            return self._publishing
        self.close()
        self._connection = connect(self.config)
        setup = self._connection.channel()
        for queue in self.config.queues:
            declare(setup, queue, self.config)
        setup.close()
        self._publishing = BatchPublisher(self._connection)
        logger.info("relay connected to the broker queues=%s", ",".join(self.config.queues))
        return self._publishing

    def close(self) -> None:
        connection, self._connection, self._publishing = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception as error:  # noqa: BLE001  (closing a broken connection)
                logger.debug("relay: closing the broker connection failed: %r", error)

    # -- one pass ------------------------------------------------------------------

    def relay_once(self) -> int:
        """Publish one batch; the number of rows it handled: published (then deleted or
        marked), or failed in the table when their arguments cannot travel."""
        publisher = self._publisher()
        jobs = Job.objects.db_manager(self.database)
        with bounded(self.database):
            batch = jobs.relayable(self.config.queues, self.config.batch_size)
            if not batch:
                return 0
            unfit = [job for job in batch if not fits_a_message(job)]
            if unfit:  # a row another client wrote: it fails here, and the batch goes on
                batch = [job for job in batch if fits_a_message(job)]
                fail_unfit(jobs, unfit)
            for job in batch:
                publisher.publish(broker_queue(job.queue_name), message_of(job))
            # Every message stored by the broker, or PublishRefusedError: the transaction
            # rolls back, the rows stay pending, and the next pass publishes them again.
            publisher.confirm()
            ids = [job.id for job in batch]
            if not ids:
                return len(unfit)  # rows handled: relay_due goes on to the next batch
            if self.config.results:
                jobs.mark_relayed(ids)
            else:
                jobs.delete_relayed(ids)
        self.stats.published += len(batch)
        return len(batch) + len(unfit)

    def relay_due(self) -> int:
        """Publish every due job, batch after batch, then close the broker connection;
        the number published (`relayjobs --once`)."""
        total = 0
        try:
            while published := self.relay_once():
                total += published
        finally:
            self.close()
        return total

    # -- the loop ------------------------------------------------------------------

    def run(self) -> None:
        """Relay until `stop` is set: wake on NOTIFY, poll otherwise, retry failures."""
        settings = get_settings()
        self.presence.register(self.stop)
        if self.presence.process is not None:
            self.waiting.worker_id = self.presence.process.id
        listener = notifier = None
        if self.listen and settings.LISTEN:
            notifier = Notifier(
                database=self.database,
                queues=self.config.queues,
                wake=self.wake,
                halted=self.stop,
                poll_interval=settings.POLL_INTERVAL_SECONDS,
                on_listening=self.waiting.listening,
            )
            listener = threading.Thread(
                target=notifier.run, name="skipqueue-relay-notifier", daemon=True
            )
            listener.start()
        backoff = Backoff()
        logger.info(
            "relay started queues=%s results=%s", ",".join(self.config.queues), self.config.results
        )
        try:
            while not self.stop.is_set():
                self.wake.clear()
                self.presence.beat()
                try:
                    published = self.relay_once()
                    if published < self.config.batch_size and self._connection is not None:
                        self._connection.process_data_events(0)  # heartbeats, a close
                except Exception as error:  # noqa: BLE001  (the broker or the database)
                    delay = backoff.next()
                    self.stats.errors.append(repr(error))
                    self.stats.reconnects += 1
                    logger.warning("relay failed, retrying in %.2fs: %r", delay, error)
                    self.close()
                    if isinstance(error, DatabaseError):
                        discard_connection(self.database)
                    self.stop.wait(delay)
                    continue
                backoff.reset()
                self.stats.passes += 1
                linger = self.waiting.after_claim(published)
                if linger == 0.0:
                    continue  # waiting from now: look once more before sleeping
                if published < self.config.batch_size:  # else there may be more: go on
                    self.wake.wait(settings.POLL_INTERVAL_SECONDS if linger is None else linger)
        finally:
            self.stop.set()  # the listener too
            if notifier is not None:
                notifier.interrupt()
            self.close()
            if listener is not None:
                listener.join(timeout=5)
            self.presence.stopped()
            connections[self.database].close()
            logger.info("relay stopped published=%d", self.stats.published)


def fits_a_message(job: Job) -> bool:
    """Whether a row's arguments can travel: a JSON array and object that Python loaded
    (not `payload.Undecodable`, the text of a value another writer stored)."""
    return type(job.args) is list and type(job.kwargs) is dict


def fail_unfit(jobs: Any, unfit: list[Job]) -> None:
    for job in unfit:
        reason = getattr(job.args, "reason", None) or getattr(job.kwargs, "reason", None)
        error = (
            f"InvalidJobError: job {job.id} cannot be relayed: its arguments are not a JSON "
            f"array and object that Python can load ({reason or 'malformed'})"
        )
        logger.error("relay: %s", error)
        jobs.fail_unrelayable(job.id, error)


def message_of(job: Job) -> Message:
    return Message(
        job_id=job.id,
        task=job.task,
        queue=job.queue_name,
        args=list(job.args),
        kwargs=dict(job.kwargs),
        attempt=job.attempts + 1,
        max_attempts=job.max_attempts,
        lease_seconds=job.lease.total_seconds(),
        trace=job.trace_context if isinstance(job.trace_context, dict) else None,
    )
