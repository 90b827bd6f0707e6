"""manage.py relayjobs: publish the relayed queues' jobs to RabbitMQ.

See docs/howto/outgrowing-one-postgresql.md.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_skipqueue.broker import (
    Message,
    RelayConfig,
    broker_queue,
    connect,
    dead_queue,
    declare,
    relay_config,
)
from django_skipqueue.broker.relay import Relay
from django_skipqueue.exceptions import ConfigurationError, InvalidJobError
from django_skipqueue.management.arguments import configure_logging
from django_skipqueue.management.preflight import require_migrated
from django_skipqueue.runtime.stopsignals import StopSignals


class Command(BaseCommand):
    help = (
        "Publish the jobs of the relayed queues (SKIPQUEUE['RELAY']) to RabbitMQ: the job "
        "table is their transactional outbox. Runs until SIGTERM or SIGINT; run one or "
        "more next to 'runworker --broker'."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--once",
            action="store_true",
            help="Publish what is due now, in batches, then exit.",
        )
        parser.add_argument(
            "--no-listen",
            action="store_true",
            help="Do not LISTEN for new jobs; poll only (behind PgBouncer in transaction mode).",
        )
        parser.add_argument(
            "--redrive",
            metavar="QUEUE",
            help="Move the messages of QUEUE's dead-letter queue back to QUEUE, each with "
            "a fresh attempt budget, then exit.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(self, options["verbosity"])
        try:
            config = relay_config()
        except ConfigurationError as error:
            raise CommandError(str(error)) from error
        if not config.enabled:
            raise CommandError(
                "no relayed queue: set SKIPQUEUE['RELAY'] = {'QUEUES': [...], 'URL': 'amqp://...'}"
            )
        if options["redrive"]:
            name = options["redrive"]
            moved = redrive(config, name)
            noun = "message" if moved == 1 else "messages"
            self.stdout.write(
                f"{moved} {noun} moved from {dead_queue(name)} to {broker_queue(name)}"
            )
            return
        relay = Relay(config, listen=not options["no_listen"])
        require_migrated(relay.database)
        if options["once"]:
            relay.relay_due()
            self.stdout.write(f"{relay.stats.published} jobs published")
            return

        def stop(signum: int) -> None:
            relay.stop.set()
            relay.wake.set()

        with StopSignals(stop).handling():
            relay.run()


def redrive(config: RelayConfig, queue: str) -> int:
    """Move every message of `queue`'s dead-letter queue back to it (attempt 1)."""
    if queue not in config.queues:
        raise CommandError(f"queue {queue!r} is not relayed (SKIPQUEUE['RELAY']['QUEUES'])")
    connection = connect(config)
    moved = 0
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        declare(channel, queue, config)
        while True:
            method, properties, body = channel.basic_get(dead_queue(queue), auto_ack=False)
            if method is None:
                return moved
            try:
                message = Message.decode(body, {})  # attempt 1 again
            except InvalidJobError:
                channel.basic_nack(method.delivery_tag, requeue=True)
                raise CommandError(
                    f"{dead_queue(queue)} holds a message that is not a job"
                ) from None
            channel.basic_publish(
                "", broker_queue(queue), message.body(), message.properties(), mandatory=True
            )
            channel.basic_ack(method.delivery_tag)
            moved += 1
    finally:
        connection.close()
