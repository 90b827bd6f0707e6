"""How a worker starts its threads and stops: the second half of `worker.Worker`.

A mixin, so that the worker's module holds its dispatch loop and this one its life's
two ends: the executor and helper threads (housekeeper, scheduler, listener) started
after the registration, and the stop's order (release what was claimed ahead, give the
running jobs the grace period, release the rest, end the threads, fail last the attempts
past their hard time limit whose code still runs). Its methods use the worker's state,
declared below for the type checker; `Worker.__init__` sets it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import TYPE_CHECKING

from django.db import DatabaseError, connections

from django_skipqueue.maintenance.scheduler import Scheduler
from django_skipqueue.models import Job, WorkerProcess
from django_skipqueue.queue.connections import bounded, retry_transient
from django_skipqueue.runtime.executor import Execution, release_on_shutdown
from django_skipqueue.runtime.flow import FlowView
from django_skipqueue.runtime.housekeeper import Housekeeper
from django_skipqueue.runtime.inflight import Buffer, Flight, InFlight
from django_skipqueue.runtime.meter import Meter
from django_skipqueue.runtime.notifier import Notifier
from django_skipqueue.runtime.progress import WorkerStats
from django_skipqueue.runtime.threads import Supervisor
from django_skipqueue.runtime.timelimits import HardLimits
from django_skipqueue.runtime.waiting import Waiting

if TYPE_CHECKING:
    from django_skipqueue.core.cron import Cron

logger = logging.getLogger("django_skipqueue.runtime.worker")

#: How long the helpers (housekeeper, scheduler, listener) wait for the first claim to
#: return before they start their work anyway (`WorkerLifecycle._start_threads`).
HELPERS_HEAD_START_SECONDS = 1.0
#: At shutdown, how long past its lease a job still running in a concurrency slot keeps
#: it: the process ends within the thread join (a second) of that moment.
KEEP_MARGIN_SECONDS = 2.0


class WorkerLifecycle:
    """The worker's threads and its stop (see the module doc)."""

    if TYPE_CHECKING:
        concurrency: int
        database: str
        queues: list[str]
        grace: float
        listen: bool
        poll_interval: float
        syncs_schedules: bool
        schedules: dict[str, Cron]
        stats: WorkerStats
        meter: Meter
        process: WorkerProcess | None
        stop_reason: str
        flow: FlowView
        held: InFlight
        threads: Supervisor
        waiting: Waiting
        time_limits: HardLimits
        housekeeper: Housekeeper
        _work: Buffer
        _wake: threading.Event
        _stopping: threading.Event
        _halted: threading.Event
        _first_claim: threading.Event
        _notifier: Notifier | None
        _release_prefetched: bool

        def _execute_loop(self) -> None: ...
        def _ack_finished(self) -> None: ...
        def _finished(self, job: Job, execution: Execution | None) -> None: ...

    # -- threads ----------------------------------------------------------------------

    def _spawn_executor(self) -> None:
        name = f"skipqueue-executor-{len(self.threads.group('executors'))}"
        self.threads.start("executors", name, self._execute_loop)

    def _thread_died(self, thread: threading.Thread) -> None:
        """A supervised thread died (it is being restarted): drop the job it ran, if any,
        so that its lease is no longer renewed and the reaper takes it back."""
        job_id = self.held.thread_died(thread)
        self.stats.thread_restarts += 1
        logger.error("worker thread died thread=%s job=%s; restarting it", thread.name, job_id)
        self._wake.set()

    # -- start and stop ---------------------------------------------------------------

    def _register(self) -> None:
        """Record this worker's row; a passing error (no server yet, a read-only one) is
        retried with backoff until it goes through or the worker is stopped."""
        workers = WorkerProcess.objects.db_manager(self.database)
        self.process = retry_transient(
            lambda: workers.register(queues=self.queues, concurrency=self.concurrency),
            what="worker registration",
            alias=self.database,
            stopping=self._stopping,
        )

    def _start_threads(self) -> None:
        """The executors, then the helpers (housekeeper, scheduler, listener). The helpers
        start their work once the first claim has returned, or after
        HELPERS_HEAD_START_SECONDS if it has not: at start-up, their three connections
        and first statements (a backend forked for each, the catalogue read for each
        table) took the machine's time while the first claim waited for it, 3-4 ms of
        the first job's start. Nothing is missed meanwhile: the first claim's leases
        are far from their renewal, and the listener, once it listens, wakes the
        dispatcher for anything enqueued before (`Notifier._listen`)."""
        for _ in range(self.concurrency):
            self._spawn_executor()
        self.housekeeper.process = self.process
        self.waiting.worker_id = self.process.id if self.process is not None else None
        # The housekeeper runs even once a stop came: it renews the leases of the jobs
        # that finish within the grace period.
        self._start_helper("skipqueue-housekeeper", self.housekeeper.run, when_stopping=True)
        if self.syncs_schedules:
            scheduler = Scheduler(
                schedules=self.schedules, database=self.database, halted=self._halted
            )
            self._start_helper("skipqueue-scheduler", scheduler.run)
        if self.listen:
            notifier = Notifier(
                database=self.database,
                queues=self.queues,
                wake=self._wake,
                halted=self._halted,
                poll_interval=self.poll_interval,
                on_control=self.flow.changed,
                on_listening=self._listening,
                on_keyed=self.flow.keyed_arrived,
                stopping=self._stopping,
            )
            self._start_helper("skipqueue-listener", notifier.run)
            self._notifier = notifier

    def _start_helper(
        self, name: str, run: Callable[[], None], *, when_stopping: bool = False
    ) -> None:
        """Start a helper's thread, which runs `run` once the first claim has returned
        (at once when restarted). One that is not needed `when_stopping` does not start
        its work after a stop came (a signal during the start-up): the listener would
        open a connection and LISTEN for a worker that claims no more (3 of 11 signals
        around the first claim; tests/runtime/test_worker.py,
        `test_a_stop_before_the_first_claim_returned_starts_no_listener`)."""

        def after_first_claim() -> None:
            self._first_claim.wait(HELPERS_HEAD_START_SECONDS)
            if self._halted.is_set() or (self._stopping.is_set() and not when_stopping):
                return
            run()

        self.threads.start("helpers", name, after_first_claim)

    def _listening(self, works: bool) -> None:
        """The notifier's LISTEN works, or stopped working (the notifier's thread)."""
        self.flow.listening(works)
        self.waiting.listening(works)

    def _shutdown(self) -> None:
        """Release the jobs claimed ahead at once, give the running ones the grace
        period, release the rest, end every thread, and last fail the attempts past
        their hard time limit whose code still runs (timelimits.py)."""
        # Jobs claimed ahead and never started: out of the buffer, and released now,
        # before the grace period. Released after it (as they were), they stayed
        # `running` for up to the whole grace period where another worker could have
        # run them, and their leases, no longer renewed once out of the held set, ran
        # out meanwhile: a short lease's job was reaped by this worker's own
        # housekeeper, and failed without ever running on its last attempt (50 of 50
        # buffered jobs with a 1 s lease behind a 6 s task; tests/runtime/test_worker.py,
        # `test_on_stop_prefetched_jobs_are_released_before_the_grace_period_not_reaped`).
        if self._release_prefetched:
            self._release(self.held.unstarted(self._work.drain()))
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline:
            self._wake.clear()
            self._ack_finished()
            # Those past their time limit had their grace: the others are waited for.
            if len(self.held) == len(self.held.past_their_limit()):
                break
            self._wake.wait(min(0.05, max(deadline - time.monotonic(), 0)))
        self._ack_finished()
        # A job whose code still runs and that holds a concurrency slot is not released:
        # released, its slot would let the key's next job start beside it while this
        # process lives (H15, C7). Its lease, no longer renewed, ends once the process
        # has, and the reaper takes it back.
        running = self.held.running_ids()
        flights: list[Flight] = []
        kept: list[Flight] = []
        for flight in self.held.remaining():
            if flight.cancel.exceeded is not None:
                continue  # failed last, below: its lease is renewed until then
            holds = flight.job.id in running and self.flow.holds_slot(flight.job)
            (kept if holds else flights).append(flight)
        jobs = Job.objects.db_manager(self.database)
        for flight in kept:
            # Its lease must outlive this process (the renewals stop with the threads,
            # which are waited for up to a second before the process ends): once more,
            # a lease and KEEP_MARGIN_SECONDS from now.
            lease = timedelta(seconds=flight.lease_seconds + KEEP_MARGIN_SECONDS)
            try:
                jobs.renewal(flight.job.id, flight.attempt, lease, keep_if_cancelled=True)
            except DatabaseError as error:
                logger.warning("job lease not extended id=%s: %s", flight.job.id, error)
            logger.warning(
                "job not released id=%s task=%s: its code still runs and holds a concurrency "
                "slot; the reaper takes it back when its lease ends, after this process",
                flight.job.id,
                flight.job.task,
            )
        self._release(flights)
        # The attempts past their limit are failed last, below, while they own their
        # jobs: their leases are extended past the rest of the stop first, and no thread
        # still inside a job is waited for (a second each, while no lease is renewed).
        self.time_limits.keep_leases(KEEP_MARGIN_SECONDS)
        self._end_threads(skip=self.held.running_threads())
        self._flush_counts()
        self._mark_stopped()  # dead at once, for the admin and the pruner
        logger.info("worker stopped reason=%s %s", self.stop_reason or "-", self.stats.summary())
        # Last, the failures of the attempts past their limit whose code still runs: a
        # key's slot is free once one is written, and the process ends right after
        # (`runworker` exits as `run()` returns, EXIT_TIME_LIMIT), so that the key's
        # next job does not start while the stuck code can still run. Their counts
        # follow, in one more statement.
        written = self.time_limits.fail_stuck()
        for job, execution in written:
            self._finished(job, execution)
        if written:
            self._flush_counts()
        connections.close_all()

    def _flush_counts(self) -> None:
        try:
            self.meter.flush(self.database)  # the last seconds' counts
        except DatabaseError as error:
            logger.warning("worker counts not written: %s", error)

    def _release(self, flights: list[Flight]) -> None:
        """Give these attempts back at a stop (executor.release_on_shutdown), counted."""
        attempts = [(flight.job, flight.attempt) for flight in flights]
        self.stats.released_on_shutdown += release_on_shutdown(attempts, self.database)

    def _mark_stopped(self) -> None:
        """This worker's row says it stopped (a row locked by another session waits at
        most LOCK_TIMEOUT_SECONDS; the pruner ends it later if this fails)."""
        if self.process is None:
            return
        try:
            with bounded(self.database):
                WorkerProcess.objects.db_manager(self.database).mark_stopped(self.process.id)
        except DatabaseError as error:
            logger.warning("worker row not marked stopped: %s", error)

    def _end_threads(self, skip: Collection[threading.Thread] = ()) -> None:
        self._halted.set()
        self._first_claim.set()  # a helper still waiting for it ends now
        self.housekeeper.wake.set()
        if self._notifier is not None:
            self._notifier.interrupt()  # else its join waits up to HALT_CHECK_SECONDS
        self._work.close(len(self.threads.group("executors")))
        # One shared deadline: threads still inside a task (past the grace, their jobs
        # released) are not waited for one by one.
        self.threads.join_all(within=1.0, skip=skip)
