"""python manage.py runworker: run jobs until stopped."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.checks.registry import registry as checks_registry
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from django_skipqueue.conf.relay import relay_config
from django_skipqueue.core.compat import run_exit_handlers
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.faults import is_transient
from django_skipqueue.management.arguments import (
    configure_logging,
    megabytes,
    port_number,
    positive_int,
    positive_seconds,
    queue_name,
    seconds,
    zero_or_more_int,
)
from django_skipqueue.management.preflight import queue_warnings, require_migrated
from django_skipqueue.models import Job
from django_skipqueue.queue.connections import Backoff, discard_connection
from django_skipqueue.runtime.executor import Outcome
from django_skipqueue.runtime.meter import Meter
from django_skipqueue.runtime.pool import WorkerPool
from django_skipqueue.runtime.stopsignals import StopSignals
from django_skipqueue.runtime.timelimits import EXIT_TIME_LIMIT
from django_skipqueue.runtime.worker import Worker

if TYPE_CHECKING:
    from django_skipqueue.broker.relay import Relay

logger = logging.getLogger("django_skipqueue")


class Command(BaseCommand):
    help = (
        "Run background jobs. Claims due jobs from the given queues, runs them on "
        "threads, and stops gracefully on SIGTERM or SIGINT (a second signal exits at once)."
    )

    def check(self, *args: Any, **kwargs: Any) -> None:
        """Django's system checks, as every command runs them, but for those tagged
        `commands` only: they are about other commands (Django's own checks that
        `migrate` and `makemigrations` use one autodetector, and imports both commands to
        do so, 6.6 ms of a worker's start-up of about 300), and `migrate` runs them
        itself. Every other check, yours untagged included, still stops the worker.

        Only on the main thread (the command line's start-up): the registry is the
        process's, and a check run by another thread meanwhile would miss them too
        (`call_command('runworker', skip_checks=False)` on a thread hid them from the
        main thread's `run_checks`; tests/integration/test_commands.py,
        `test_runworker_on_another_thread_runs_every_system_check`)."""
        on_main = threading.current_thread() is threading.main_thread()
        # Tags.commands, from Django 5.2
        with _checks_hidden(tagged="commands") if on_main else contextlib.nullcontext():
            super().check(*args, **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--queue",
            "-q",
            dest="queues",
            action="append",
            type=queue_name,
            metavar="NAME",
            help="Queue to take jobs from; repeat for several. Default: the 'default' queue.",
        )
        parser.add_argument(
            "--concurrency",
            "-c",
            type=positive_int,
            default=1,
            metavar="N",
            help="Threads running jobs, each with its own database connection. Default: 1.",
        )
        parser.add_argument(
            "--processes",
            "-p",
            type=positive_int,
            default=1,
            metavar="N",
            help="Worker processes under this one, each with --concurrency threads, its "
            "own connections and its own worker row (one process uses one core). SIGTERM "
            "drains them all; a child that exits is replaced. Default: 1 (no children).",
        )
        parser.add_argument(
            "--prefetch",
            type=zero_or_more_int,
            metavar="N",
            help="Jobs claimed ahead of free threads, so that claims and acks come in "
            "batches; 0 never. Default: SKIPQUEUE['PREFETCH'] (adapted to the jobs' run time).",
        )
        parser.add_argument(
            "--burst",
            action="store_true",
            help="Run until no due job is left, then exit 0 (after a last look: a reap of "
            "expired leases unless --reap-interval is 0, keyed jobs, rate limits' refills).",
        )
        parser.add_argument(
            "--max-jobs",
            type=positive_int,
            metavar="N",
            help="Exit cleanly after claiming N jobs (a supervisor starts a fresh process).",
        )
        parser.add_argument(
            "--max-memory",
            type=megabytes,
            metavar="MB",
            help="Exit cleanly once the process uses more than MB megabytes of memory.",
        )
        parser.add_argument(
            "--grace",
            type=seconds,
            metavar="SECONDS",
            help="After SIGTERM, seconds jobs in flight get to finish before they are "
            "released back to pending. Default: SKIPQUEUE['GRACE_SECONDS'] (30).",
        )
        parser.add_argument(
            "--poll-interval",
            type=positive_seconds,
            metavar="SECONDS",
            help="Longest wait between claims when no notification arrives. "
            "Default: SKIPQUEUE['POLL_INTERVAL_SECONDS'] (5).",
        )
        parser.add_argument(
            "--no-listen",
            action="store_true",
            help="Do not LISTEN for new jobs; poll only (for example behind PgBouncer in "
            "transaction mode).",
        )
        parser.add_argument(
            "--reap-interval",
            type=seconds,
            metavar="SECONDS",
            help="How often this worker reaps expired leases; 0 leaves it to 'reapjobs'. "
            "Default: SKIPQUEUE['REAP_INTERVAL_SECONDS'] (10).",
        )

        parser.add_argument(
            "--broker",
            action="store_true",
            help="Run the relayed queues' jobs from RabbitMQ (SKIPQUEUE['RELAY']) instead "
            "of claiming rows: manual acks, a bounded prefetch, --concurrency threads. "
            "-q picks among the relayed queues (default: all of them).",
        )
        parser.add_argument(
            "--relay",
            action="store_true",
            help="Also publish the relayed queues' jobs to RabbitMQ from this process (a "
            "relay thread, as 'manage.py relayjobs' runs; SKIPQUEUE['RELAY']).",
        )
        parser.add_argument(
            "--metrics-port",
            type=port_number,
            metavar="PORT",
            help="Serve Prometheus metrics on http://ADDRESS:PORT/metrics (the [metrics] "
            "extra). With --processes, one endpoint for the whole pool.",
        )
        parser.add_argument(
            "--metrics-address",
            default="127.0.0.1",
            metavar="ADDRESS",
            help="The address --metrics-port listens on. Default: 127.0.0.1 (this host "
            "only); 0.0.0.0 for a scraper elsewhere.",
        )
        parser.add_argument(
            "--no-schedules",
            action="store_true",
            help="Do not enqueue the periodic schedules' occurrences from this worker "
            "(every worker does by default, except with --burst).",
        )

    def run_from_argv(self, argv: list[str]) -> None:
        """From the command line (not call_command): after the worker stops, run the exit
        handlers (yours, logging's) and end the process without the interpreter's
        teardown, which spent about 80 ms freeing objects after an idle stop."""
        super().run_from_argv(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        run_exit_handlers()
        os._exit(0)

    def make_worker(self, options: dict[str, Any]) -> Worker:
        """The Worker these options describe (a subclass may adjust it)."""
        meter = None
        if options.get("metrics_port") is not None:
            from django_skipqueue.runtime.prometheus import worker_series

            meter = Meter(prometheus=worker_series())
        try:
            return Worker(
                meter=meter,
                queues=options["queues"] or ["default"],
                concurrency=options["concurrency"],
                burst=options["burst"],
                max_jobs=options["max_jobs"],
                max_memory_mb=options["max_memory"],
                grace=options["grace"],
                poll_interval=options["poll_interval"],
                listen=False if options["no_listen"] else None,
                reap_interval=options["reap_interval"],
                prefetch=options["prefetch"],
                schedules=False if options["no_schedules"] else None,
            )
        except (ValueError, ConfigurationError) as error:
            raise CommandError(str(error)) from error

    def handle(self, *args: Any, **options: Any) -> None:
        # What start-up made (Django, the apps, psycopg: no garbage) goes to the
        # collector's permanent generation, so that no full collection walks it again,
        # and the children of --processes share its pages instead of copying them (as
        # the documentation of gc.freeze describes). The collector itself is untouched.
        gc.freeze()
        configure_logging(self, options["verbosity"])
        if options["metrics_port"] is not None and not importlib.util.find_spec(
            "prometheus_client"
        ):
            raise CommandError(
                "--metrics-port needs prometheus_client: pip install 'django-skipqueue[metrics]'"
            )
        if options["broker"]:
            self.run_consumer(options)
            return
        worker = self.make_worker(options)
        require_migrated(worker.database)
        for warning in start_up_warnings(worker.queues, worker.database):
            logger.warning(warning)
        if options["processes"] > 1:
            if threading.current_thread() is not threading.main_thread():
                raise CommandError("--processes needs the main thread (it handles signals)")
            with self.pool_metrics(options, worker.database) as helper:
                in_child: Callable[[int], None] | None = None
                if helper is not None:
                    from django_skipqueue.runtime.prometheus import count_as_slot

                    in_child = count_as_slot
                pool = WorkerPool(
                    options["processes"],
                    lambda: self.run_worker(self.make_worker(options), options),
                    replace=not options["burst"],
                    helper=helper,
                    in_child=in_child,
                )
                code = pool.run()
            if code:
                sys.exit(code)
            return
        server = self.serve_metrics(options, worker.database)
        try:
            code = self.run_worker(worker, options)
        finally:
            if server is not None:
                server.shutdown()
        if code:
            sys.exit(code)

    def serve_metrics(self, options: dict[str, Any], database: str) -> Any:
        """--metrics-port, one process: the endpoint, served by a thread of this one."""
        if options["metrics_port"] is None:
            return None
        from django_skipqueue.runtime.prometheus import serve_worker

        try:
            server = serve_worker(options["metrics_port"], options["metrics_address"], database)
        except OSError as error:
            raise CommandError(
                f"--metrics-port {options['metrics_port']}: cannot listen on "
                f"{options['metrics_address']}: {error}"
            ) from error
        logger.info(
            "metrics served on http://%s:%d/metrics",
            options["metrics_address"],
            options["metrics_port"],
        )
        return server

    @contextlib.contextmanager
    def pool_metrics(
        self, options: dict[str, Any], database: str
    ) -> Iterator[Callable[[], int] | None]:
        """--metrics-port with --processes: the children write their series to a
        directory of this pool's (prometheus_client's multiprocess mode), and one more
        child serves them, added up, with the queue gauges: one port for the pool."""
        if options["metrics_port"] is None:
            yield None
            return
        from django_skipqueue.runtime.prometheus import (
            pool_directory,
            prepare_multiprocess,
            serve_pool,
        )

        port, address = options["metrics_port"], options["metrics_address"]
        try:  # here, so that a port in use stops the pool now, not its helper forever
            with socket.create_server((address, port)):
                pass
        except OSError as error:
            raise CommandError(
                f"--metrics-port {port}: cannot listen on {address}: {error}"
            ) from error
        directory = pool_directory()
        try:
            prepare_multiprocess(directory)
            yield lambda: serve_pool(port, address, database, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def run_consumer(self, options: dict[str, Any]) -> None:
        """--broker: consume the relayed queues from RabbitMQ until SIGTERM or SIGINT."""
        try:
            config = relay_config()
        except ConfigurationError as error:
            raise CommandError(str(error)) from error
        queues = options["queues"] or list(config.queues)
        strangers = [name for name in queues if name not in config.queues]
        if strangers:
            raise CommandError(
                f"--broker runs relayed queues only; not relayed: {', '.join(strangers)} "
                f"(SKIPQUEUE['RELAY']['QUEUES'] is {list(config.queues)})"
            )
        # The broker's modules are imported by the modes that use them only: a plain
        # worker's start-up, before its first job, does not pay for them.
        from django_skipqueue.broker.consumer import Consumer

        meter = None
        if options["metrics_port"] is not None:
            from django_skipqueue.runtime.prometheus import worker_series

            meter = Meter(prometheus=worker_series())
        consumer = Consumer(config, queues=queues, concurrency=options["concurrency"], meter=meter)
        server = self.serve_metrics(options, consumer.database)
        try:
            with StopSignals(lambda signum: consumer.stop.set()).handling():
                consumer.run()
        finally:
            if server is not None:
                server.shutdown()
        stats = consumer.stats
        self.stdout.write(
            f"broker consumer stopped: {stats.succeeded} succeeded, {stats.retried} retried, "
            f"{stats.dead} dead-lettered, {stats.reconnects} reconnects"
        )
        if consumer.stuck:
            # A thread still runs a task the consumer gave up on: end the process now,
            # for its supervisor to start another (timelimits.EXIT_TIME_LIMIT).
            self.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(EXIT_TIME_LIMIT)

    def start_relay(self, options: dict[str, Any]) -> Relay | None:
        """--relay: a relay thread beside the worker, stopped when the worker stops."""
        if not options["relay"]:
            return None
        try:
            config = relay_config()
        except ConfigurationError as error:
            raise CommandError(str(error)) from error
        if not config.enabled:
            raise CommandError("--relay: no relayed queue (SKIPQUEUE['RELAY']['QUEUES'])")
        from django_skipqueue.broker.relay import Relay  # see run_consumer

        relay = Relay(config, listen=not options["no_listen"])
        relay.thread = threading.Thread(target=relay.run, name="skipqueue-relay", daemon=True)
        relay.thread.start()
        return relay

    def run_worker(self, worker: Worker, options: dict[str, Any]) -> int:
        """Run one worker in this process until it stops; returns its exit code."""
        if settings.DEBUG:
            logger.warning(
                "DEBUG=True: every query is kept in memory and slows the worker; run "
                "workers with DEBUG=False"
            )
        if threading.current_thread() is threading.main_thread():
            worker.install_signal_handlers()
        progress = None
        if options["burst"] and self.stdout.isatty() and options["processes"] == 1:
            progress = BurstProgress(worker, self)
            progress.start()
        relay = self.start_relay(options)
        try:
            code = worker.run()
        finally:
            if relay is not None:
                relay.stop.set()
                relay.wake.set()
        if worker.stuck_threads:
            # A task's code still runs past its time limit, and its attempt's failure was
            # the worker's last write: end the process now (timelimits.py), not after
            # the relay's join and the summary.
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(code)
        if relay is not None and relay.thread is not None:
            relay.thread.join(timeout=30)
        if progress is not None:
            progress.finish()
        stats = worker.stats
        # The worker's own "worker stopped" log line says it all where our INFO lines
        # are shown (-v 1, the default); below that, one summary line still ends the run.
        summary = (
            f"worker stopped ({worker.stop_reason}): {stats.claimed} claimed, "
            f"{stats.count(Outcome.SUCCEEDED)} succeeded, {stats.count(Outcome.RETRYING)} "
            f"retried, {stats.count(Outcome.FAILED)} failed, {stats.timed_out} timed out "
            f"(past their time limit), {stats.count(Outcome.LOST)} lost, "
            f"{stats.released_on_shutdown} released"
        )
        if not logger.isEnabledFor(logging.INFO):
            self.stdout.write(self.style.SUCCESS(summary))
        end_leaked_children()
        if worker.stuck_threads:
            # Threads still inside a task after the grace: their jobs were released;
            # end the process without waiting for them.
            self.stdout.flush()
            logging.shutdown()
            os._exit(code)
        return code


@contextlib.contextmanager
def _checks_hidden(tagged: str) -> Iterator[None]:
    """Django's check registry without the checks whose only tag is `tagged`, for the
    time of the block (the command line's start-up, on the main thread, before this
    process starts a thread of its own)."""
    hidden = {
        check
        for check in checks_registry.registered_checks
        if set(getattr(check, "tags", ())) == {tagged}
    }
    checks_registry.registered_checks -= hidden
    try:
        yield
    finally:
        checks_registry.registered_checks |= hidden


def start_up_warnings(queues: list[str], database: str, tries: int = 4) -> list[str]:
    """`queue_warnings`, tried again after a passing error (a statement timeout on a
    large table, a restarting server) with backoff; advice only, so if the database
    does not answer in time, or answers with another error, the worker starts without
    it (saying so) rather than exit."""
    backoff = Backoff(first=0.2, cap=2.0)
    for attempt in range(tries):
        try:
            return queue_warnings(queues, database)
        except DatabaseError as error:
            discard_connection(database)
            if not is_transient(error) or attempt == tries - 1:
                return [f"start-up check of the queues skipped: {error}"]
            time.sleep(backoff.next())
    return []


def end_leaked_children(grace: float = 2.0) -> None:
    """Kill the multiprocessing children a task started and left running: a non-daemon
    one would make the interpreter's exit wait for it (SIGTERM would hang, and the child
    outlive the worker). SIGKILL, not SIGTERM: a forked child inherited this worker's
    stop handlers, and its SIGTERM would reach this process as a second signal."""
    import multiprocessing

    leaked = multiprocessing.active_children()
    for child in leaked:
        logger.warning("ending a process a task left running pid=%s name=%s", child.pid, child.name)
        child.kill()
    for child in leaked:
        child.join(timeout=grace)


class BurstProgress:
    """A live line on a terminal: done, failed, rate, remaining."""

    def __init__(self, worker: Worker, command: BaseCommand) -> None:
        self.worker, self.command = worker, command
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="skipqueue-progress", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.done.set()
        self.thread.join(timeout=2)
        self.command.stdout.write("")

    def _loop(self) -> None:
        import time

        from django.db import connections

        try:
            while not self.done.wait(0.5):
                stats = self.worker.stats
                elapsed = max(time.monotonic() - stats.started, 1e-6)
                remaining = (
                    Job.objects.using(self.worker.database)
                    .due()
                    .for_queues(self.worker.queues)
                    .count()
                )
                line = (
                    f"\rdone {stats.count(Outcome.SUCCEEDED)}  failed "
                    f"{stats.count(Outcome.FAILED)}  rate {stats.finished / elapsed:.0f}/s  "
                    f"remaining {remaining}   "
                )
                self.command.stdout.write(line, ending="")
                self.command.stdout.flush()
        finally:
            connections.close_all()
