"""The housekeeper: a worker's maintenance thread.

It renews the leases of the jobs the worker holds (every third of a lease), hands the
jobs past their hard time limit to the worker's HardLimits (timelimits.py), records the
worker's heartbeat, and reaps expired leases and prunes dead workers every
REAP_INTERVAL_SECONDS. Every pass catches its own errors and backs off: the thread must
not die, or renewals would stop (see docs/explanation/protocol.md, "Faults").
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from django.db import DatabaseError, connections
from django.db.models.functions import Now

from django_skipqueue.faults import is_transient, sqlstate
from django_skipqueue.maintenance.reaper import MINUTES_KEPT, HousekeepingResult, Reaper
from django_skipqueue.models import Job, WorkerProcess
from django_skipqueue.queue.base import Renewal
from django_skipqueue.queue.connections import (
    LOCK_NOT_AVAILABLE,
    SIDE_WRITE_LOCK_SECONDS,
    Backoff,
    bounded,
    discard_connection,
)
from django_skipqueue.queue.managers import JobManager
from django_skipqueue.runtime.executor import shown_ids
from django_skipqueue.runtime.inflight import Flight, InFlight
from django_skipqueue.runtime.meter import FLUSH_SECONDS, Meter
from django_skipqueue.tasks.context import PROGRESS_WRITE_SECONDS

if TYPE_CHECKING:
    from django_skipqueue.runtime.flow import FlowView
    from django_skipqueue.runtime.progress import ProgressLog, WorkerStats
    from django_skipqueue.runtime.waiting import Waiting

logger = logging.getLogger(__name__)

#: The longest the housekeeper sleeps between passes. Renewals and time limits are
#: planned for to the millisecond: a job claimed whose first renewal, or started whose
#: time limit, falls before the planned pass wakes the housekeeper (InFlight.add and
#: start), and so does one claimed during the back-off after a failed pass.
MAX_WAIT = 1.0

#: The most leases one renewal statement renews (`JobManager.renew_many`); a pass with
#: more due sends several.
RENEW_BATCH = 1000
#: How soon a renewal is tried again whose row another session had locked (the renewal
#: skips it rather than wait, see `sql.RENEW_MANY`).
RENEW_AGAIN_SECONDS = 0.05
#: Leases a pass finds lost that still get a line each; more (a frozen worker's
#: buffer) get one line for all (`leases_lost`).
LOST_LINES_MAX = 10

#: How soon a side write skipped for a lock (SIDE_WRITE_LOCK_SECONDS) is tried again:
#: the heartbeat and the meter's flush; the prune waits for the next reap.
SIDE_WRITE_RETRY_SECONDS = 1.0


class Housekeeper:
    """Maintenance for one worker; `run()` loops until `halted` is set."""

    def __init__(
        self,
        *,
        database: str,
        held: InFlight,
        stats: WorkerStats,
        halted: threading.Event,
        past_limit: Callable[..., None],
        heartbeat_interval: float,
        reap_interval: float,
        prune_workers_after: timedelta,
        progress: ProgressLog | None = None,
        flow: FlowView | None = None,
        wake_dispatcher: Callable[[], None] | None = None,
        meter: Meter | None = None,
        waiting: Waiting | None = None,
    ) -> None:
        self.database = database
        self.held = held
        self.stats = stats
        self.halted = halted
        #: The worker's `HardLimits.look`: a running job due a look for its time limit.
        self.past_limit = past_limit
        self.heartbeat_interval = heartbeat_interval
        self.reap_interval = reap_interval
        self.prune_workers_after = prune_workers_after
        self.progress = progress  # the periodic INFO line of what ran
        self.flow = flow  # the worker's view of flow control: keyed jobs to look for
        self.wake_dispatcher = wake_dispatcher
        self.meter = meter  # the worker's counts, flushed to QueueMinute rows
        self.waiting = waiting  # whether it waits for a NOTIFY: the heartbeat writes it
        #: Renew the leases of jobs in flight. Only fault tests turn it off (the lease
        #: boundary race, case T3 of docs/explanation/failure-model.md).
        self.renew_leases = True
        self.reaper = Reaper(database=database)
        self.process: WorkerProcess | None = None  # set once the worker is registered
        self.wake = threading.Event()  # new jobs to schedule, or halted
        held.wakes(self.wake)  # a renewal or a time limit before the planned pass

    def run(self) -> None:
        now = time.monotonic()
        next_beat = now + self.heartbeat_interval
        first_reap = self.reap_interval * random.uniform(0.1, 1.0) if self.reap_interval else 0
        next_reap = now + first_reap
        next_flush = now + FLUSH_SECONDS
        backoff = Backoff()
        try:
            while not self.halted.is_set():
                try:
                    self.renew_due_leases()
                    self.write_progress()
                    now = time.monotonic()
                    if now >= next_beat:
                        beaten = self.side_write(self.heartbeat, "the heartbeat")
                        next_beat = now + (
                            self.heartbeat_interval if beaten else SIDE_WRITE_RETRY_SECONDS
                        )
                    if self.reap_interval and now >= next_reap:
                        self.side_write(self.reap_and_prune, "the reap", "at the next reap")
                        next_reap = now + self.reap_interval * random.uniform(0.9, 1.1)
                    if self.progress is not None and now >= self.progress.next_at:
                        self.progress.emit(now)
                    if self.meter is not None and now >= next_flush:
                        flushed = self.side_write(self.flush_meter, "the meter's flush")
                        next_flush = now + (FLUSH_SECONDS if flushed else SIDE_WRITE_RETRY_SECONDS)
                    self.probe_keyed()
                    backoff.reset()
                    soonest = self.held.plan_pass(  # renewals and time limits too
                        next_beat,
                        next_reap if self.reap_interval else next_beat,
                        self.progress.next_at if self.progress is not None else next_beat,
                        next_flush,
                    )
                    wait = min(soonest - time.monotonic(), MAX_WAIT)
                except Exception as error:  # noqa: BLE001  (this thread must not die)
                    wait = backoff.next()
                    if is_transient(error):
                        logger.warning("housekeeping failed, retrying in %.2fs: %s", wait, error)
                    else:
                        logger.exception("housekeeping failed, retrying in %.2fs", wait)
                    discard_connection(self.database)
                    # No pass was planned: until the back-off ends, any renewal or time
                    # limit that falls before its end must wake this thread.
                    self.held.sleeps_until(time.monotonic() + wait)
                self.wake.wait(max(wait, 0.01))
                self.wake.clear()
        finally:
            connections.close_all()

    def renew_due_leases(self) -> None:
        """Look at the jobs due for their time limit, then renew the leases that are due
        (those past their limit too: they stay this attempt's until it ends)."""
        now = time.monotonic()
        for flight in self.held.timed_out(now):
            self.past_limit(flight, now=now)
        if not self.renew_leases:
            return
        jobs = Job.objects.db_manager(self.database)
        due = self.held.due_renewals(now)
        if not due:
            return
        # One statement renews them all (in chunks), one read sorts out the rest: lost,
        # asked to stop, or locked by another session (tried again shortly).
        renewed: set[int] = set()
        for start in range(0, len(due), RENEW_BATCH):
            chunk = due[start : start + RENEW_BATCH]
            renewed |= jobs.renew_many([(flight.job.id, flight.attempt) for flight in chunk])
        rest = [flight for flight in due if flight.job.id not in renewed]
        holding = jobs.holding_many([(flight.job.id, flight.attempt) for flight in rest])
        lost: list[Flight] = []
        for flight in due:
            if flight.job.id in renewed:
                self.held.renewed(flight, now=time.monotonic())
                self.stats.renewed += 1
            elif flight.job.id not in holding:
                lost.append(flight)
            elif not holding[flight.job.id]:  # locked elsewhere: not renewed, not lost
                self.held.renew_soon(flight, at=time.monotonic() + RENEW_AGAIN_SECONDS)
            else:
                self.cancel_requested(flight, jobs)
        if len(lost) > LOST_LINES_MAX:
            self.leases_lost(lost)
        else:
            for flight in lost:
                self.lease_lost(flight)

    def cancel_requested(self, flight: Flight, jobs: JobManager) -> None:
        """A renewal found a cancel request: tell the task. A job holding a concurrency
        slot keeps its lease while its code still runs (H23): the slot is freed when its
        thread ends. A job not started yet (buffered) keeps it too, so that it can still
        end cancelled when its turn comes or at a stop: renewed no more, a buffered
        job's lease ran out, its end was refused, and a graceful stop left it running
        for the reaper, 30 times of 30 (tests/runtime/test_worker.py,
        `test_a_stop_ends_cancelled_the_buffered_jobs_...`). Any other is renewed no more."""
        slot = self.flow is not None and self.flow.holds_slot(flight.job)
        keep = slot or not self.held.started(flight)
        if keep:
            renewal = jobs.renewal(flight.job.id, flight.attempt, keep_if_cancelled=True)
            if renewal is Renewal.LOST:
                self.lease_lost(flight)
                return
        first = not flight.cancel.is_set()
        self.held.cancel_requested(flight, keep_renewing_at=time.monotonic() if keep else None)
        if first:
            logger.info(
                "job cancel requested id=%s task=%s attempt=%d: told the task; %s",
                flight.job.id,
                flight.job.task,
                flight.attempt,
                "its lease is kept while its thread runs (a concurrency limit holds its slot)"
                if slot
                else "not started: its lease is kept until it ends cancelled, unrun"
                if keep
                else "its lease is no longer renewed",
            )

    def leases_lost(self, flights: list[Flight]) -> None:
        """`lease_lost` for many at once (a frozen worker's buffer), in one line: after
        a freeze, one line a job wrote 1,668 lines (tests/runtime/test_worker.py,
        `test_a_pass_that_finds_many_leases_lost_says_so_in_one_line`)."""
        ids = [flight.job.id for flight in flights if self.held.renewal_refused(flight)]
        if not ids:
            return
        self.stats.renew_refused += len(ids)
        logger.warning(
            "job leases lost count=%d ids=%s: renewals refused; their outcomes will be refused too",
            len(ids),
            shown_ids(ids),
        )

    def lease_lost(self, flight: Flight) -> None:
        """The fence refused a renewal: never renew this attempt again, and say so,
        unless its outcome came in meanwhile (an ack that committed first)."""
        if not self.held.renewal_refused(flight):
            return
        self.stats.renew_refused += 1
        logger.warning(
            "job lease lost id=%s task=%s attempt=%d: renewal refused; its outcome "
            "will be refused too",
            flight.job.id,
            flight.job.task,
            flight.attempt,
        )

    def write_progress(self) -> None:
        """Write the progress tasks reported (`context.set_progress`) since the last
        pass, through the fence, at most once per PROGRESS_WRITE_SECONDS per job."""
        due = self.held.progress_due(time.monotonic(), PROGRESS_WRITE_SECONDS)
        if not due:
            return
        jobs = Job.objects.db_manager(self.database)
        for flight, report in due:
            if not jobs.report_progress(flight.job.id, flight.attempt, report):
                logger.debug(
                    "job progress refused id=%s: attempt no longer holds it", flight.job.id
                )

    def probe_keyed(self) -> None:
        """Once a KEYED_PROBE_SECONDS, look for due keyed jobs that no NOTIFY announced
        (a schedule's, a run_after's, those a limit held back) and tell the dispatcher:
        off its path, so that plain claims never wait for this probe."""
        if self.flow is None or self.flow.keyed_waiting() or not self.flow.keyed_probe_due():
            return
        fast, _limited = self.flow.plan()
        if Job.objects.db_manager(self.database).keyed_due(fast):
            self.flow.note_keyed(True)
            if self.wake_dispatcher is not None:
                self.wake_dispatcher()

    def side_write(self, write: Callable[[], None], what: str, again: str = "") -> bool:
        """`write` (the heartbeat, the meter's flush, the prune), which waits at most
        SIDE_WRITE_LOCK_SECONDS for a lock; False, logged, where it was not had."""
        try:
            write()
        except DatabaseError as error:
            if sqlstate(error) != LOCK_NOT_AVAILABLE:
                raise
            logger.warning(
                "%s skipped: a lock it needs was held for more than %.1fs; tried again %s "
                "(lease renewals go on)",
                what,
                SIDE_WRITE_LOCK_SECONDS,
                again or f"in {SIDE_WRITE_RETRY_SECONDS:.0f}s",
            )
            return False
        return True

    def reap(self) -> HousekeepingResult:
        """One reap, counted (the worker's stats and the metrics). Its UPDATE to pending
        fires the NOTIFY trigger, which reads skipqueue_workerprocess: a lock there
        holds it up too, for at most SIDE_WRITE_LOCK_SECONDS."""
        result = self.reaper.reap(lock_seconds=SIDE_WRITE_LOCK_SECONDS)
        self.stats.reaped += result.requeued + result.failed + result.cancelled
        self.stats.expired += result.expired
        if self.meter is not None:
            self.meter.leases_expired(result.lease_expirations)
        return result

    def reap_and_prune(self) -> None:
        """The reap, then the prune."""
        result = self.reap()
        if not result.locked_out:
            self.side_write(
                self.prune_side_tables,
                "the prune of dead workers and old minutes",
                "at the next reap",
            )

    def prune_side_tables(self) -> None:
        with bounded(self.database, lock_seconds=SIDE_WRITE_LOCK_SECONDS):
            self.reaper.prune(
                workers_dead_for=self.prune_workers_after, minutes_older_than=MINUTES_KEPT
            )

    def flush_meter(self) -> None:
        if self.meter is not None:
            self.meter.flush(self.database, lock_seconds=SIDE_WRITE_LOCK_SECONDS)

    def heartbeat(self) -> None:
        if self.process is None:
            return
        beat = WorkerProcess.objects.using(self.database).filter(id=self.process.id)
        flag = self.waiting.columns() if self.waiting is not None else {}
        with bounded(self.database, lock_seconds=SIDE_WRITE_LOCK_SECONDS):
            if not beat.update(heartbeat_at=Now(), **flag):
                # pruned as dead: back
                self.process.save(using=self.database, force_insert=True)
