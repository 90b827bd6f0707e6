"""Worker: claim in batches, run jobs on threads, renew leases, housekeep, stop gracefully.

Threads and connections (N = concurrency, so N + 3 connections at most):
- the dispatcher (the thread that calls `run()`): acknowledges every job that finished
  since its last turn in one fenced statement, claims as many due jobs as there are free
  threads plus the prefetch buffer in one claim, then waits for a NOTIFY, a finished job
  or the poll timeout;
- N executor threads: each runs one job at a time on its own Django connection; a
  success is handed to the dispatcher to acknowledge, other outcomes are written at once;
- the housekeeper: renews the leases of jobs in flight (every third of a lease),
  records the heartbeat, and reaps expired leases every REAP_INTERVAL_SECONDS;
- the listener: LISTENs on the queues' channels on its own direct connection.

The process clock only schedules (when to renew, how long to wait); every decision on
a lease is made by the database in a fenced statement.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import signal
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections
from django.db.models.functions import Now

from django_skipqueue import sql
from django_skipqueue.conf import get_settings
from django_skipqueue.executor import (
    Answer,
    Execution,
    Outcome,
    committed_before,
    end_open_transactions,
    execute,
    persist,
    record_ack_error,
    record_success,
)
from django_skipqueue.faults import is_transient
from django_skipqueue.managers import dead_after
from django_skipqueue.models import Job, WorkerProcess
from django_skipqueue.reaper import Reaper
from django_skipqueue.registry import registry
from django_skipqueue.states import DEFAULT_QUEUE_NAME, validate_queue_name

if TYPE_CHECKING:
    from django_skipqueue.managers import dead_after

logger = logging.getLogger(__name__)

#: Adaptive prefetch: hold about this much work per thread claimed ahead...
PREFETCH_WINDOW_SECONDS = 0.05
#: ...and at most this many jobs per thread.
PREFETCH_PER_THREAD_MAX = 16

#: CONN_HEALTH_CHECKS: the least time between two pings of one thread's connection.
HEALTH_CHECK_SECONDS = 1.0


def refresh_connections() -> None:
    """Before and after each job: drop this thread's broken or expired connections.

    Django's close_old_connections() closes every connection when CONN_MAX_AGE is 0,
    which in a worker means a new connection for every job. Here CONN_MAX_AGE = 0 keeps
    a connection for the thread's life; a positive CONN_MAX_AGE still recycles it, and
    broken connections and ones left out of autocommit behave as in a request.
    CONN_HEALTH_CHECKS pings before a job's first query at most once a second per
    connection (measured: a ping per job cost a round trip per job at full speed); a
    connection that broke in a job is checked or closed after it in any case.
    """
    for connection in connections.all(initialized_only=True):
        if connection.connection is None:
            continue
        if connection.settings_dict["CONN_MAX_AGE"] != 0:
            connection.close_if_unusable_or_obsolete()
            continue
        now = time.monotonic()
        if now - getattr(connection, "skipqueue_checked_at", 0.0) >= HEALTH_CHECK_SECONDS:
            # Django's own flag (not in django-stubs): CONN_HEALTH_CHECKS pings before next use.
            connection.health_check_done = False  # type: ignore[attr-defined]
            connection.skipqueue_checked_at = now  # type: ignore[attr-defined]
        if connection.get_autocommit() != connection.settings_dict["AUTOCOMMIT"]:
            connection.close()
        elif connection.errors_occurred:
            if connection.is_usable():
                connection.errors_occurred = False
                connection.health_check_done = True  # type: ignore[attr-defined]
            else:
                connection.close()


def discard_connection(alias: str) -> None:
    """Drop this thread's connection to `alias` after an error; the next query reconnects."""
    try:
        connections[alias].close()
    except DatabaseError:
        pass


class Backoff:
    """Exponential delays with jitter for reconnecting: 0.1 s doubling up to `cap`."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self.current = first, cap, first

    def next(self) -> float:
        delay = self.current * random.uniform(0.8, 1.2)
        self.current = min(self.current * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.current = self.first


@dataclass
class _Flight:
    """A claimed job while this process holds it: buffered, running, or being acked."""

    job: Job
    attempt: int
    lease_seconds: float
    renew_at: float  # process clock: when to renew next (scheduling only)
    timeout: float | None = None  # the task's timeout in seconds, counted from its start
    timeout_at: float = float("inf")  # process clock: stop renewing after this


@dataclass
class _Finished:
    """A success waiting for the dispatcher's batched, fenced ack."""

    job: Job
    attempt: int
    result: Any
    duration: float


@dataclass
class WorkerStats:
    """Counters since start. Read them for progress; they decide nothing."""

    claimed: int = 0
    finished: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    acked_batches: int = 0
    renewed: int = 0
    renew_refused: int = 0
    released_on_shutdown: int = 0
    reaped: int = 0
    timed_out: int = 0
    thread_restarts: int = 0
    started: float = field(default_factory=time.monotonic)

    def count(self, outcome: Outcome) -> int:
        return self.outcomes.get(outcome.value, 0)


class Worker:
    """Runs jobs from `queues` on `concurrency` threads until stopped. See the module doc."""

    def __init__(
        self,
        *,
        queues: Sequence[str] = (DEFAULT_QUEUE_NAME,),
        concurrency: int = 1,
        burst: bool = False,
        max_jobs: int | None = None,
        max_memory_mb: float | None = None,
        grace: float | None = None,
        poll_interval: float | None = None,
        listen: bool | None = None,
        reap_interval: float | None = None,
        prefetch: int | None = None,
        database: str | None = None,
    ) -> None:
        conf = get_settings()
        self.queues = [validate_queue_name(name) for name in dict.fromkeys(queues)]
        if not self.queues:
            raise ValueError("a worker needs at least one queue")
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.concurrency = concurrency
        #: Jobs claimed ahead of free threads: a fixed number, or None to adapt it to
        #: how long jobs take (see `prefetch`).
        self.fixed_prefetch: int | None = conf.PREFETCH if prefetch is None else prefetch
        if self.fixed_prefetch is not None and self.fixed_prefetch < 0:
            raise ValueError(f"prefetch must be zero or more, got {self.fixed_prefetch}")
        self._mean_duration: float | None = None  # moving average of jobs' run time
        self.burst = burst
        self.max_jobs = max_jobs
        self.max_memory_mb = max_memory_mb
        self.grace = conf.GRACE_SECONDS if grace is None else grace
        self.poll_interval = conf.POLL_INTERVAL_SECONDS if poll_interval is None else poll_interval
        self.listen = conf.LISTEN if listen is None else listen
        self.reap_interval = conf.REAP_INTERVAL_SECONDS if reap_interval is None else reap_interval
        self.heartbeat_interval = conf.HEARTBEAT_SECONDS
        self.prune_workers_after = timedelta(seconds=conf.WORKER_PRUNE_AFTER_SECONDS)
        self.database = database or conf.DATABASE_ALIAS
        self.stats = WorkerStats()
        #: Renew the leases of jobs in flight. Only fault tests turn it off (the lease
        #: boundary race, case T3 of docs/explanation/failure-model.md): every job then
        #: has exactly its lease.
        self.renew_leases = True
        self.process: WorkerProcess | None = None
        self.stop_reason = ""

        self._flights: dict[int, _Flight] = {}
        self._lock = threading.Lock()
        self._work: queue.Queue[Job | None] = queue.Queue()
        self._busy = 0  # executor threads inside a job
        self._finished_jobs: list[_Finished] = []  # successes the dispatcher will ack
        self._acking: set[int] = set()  # their ids (flights not yet released)
        self._wake = threading.Event()  # a NOTIFY, a free thread, or stop()
        self._stopping = threading.Event()  # no more claims
        self._halted = threading.Event()  # shutdown finished: helpers end
        self._housekeeper_wake = threading.Event()  # new flights to schedule, or halted
        self._signals = 0
        self._release_prefetched = True
        self._threads: list[threading.Thread] = []
        self._helpers: list[threading.Thread] = []  # housekeeper, listener
        self._abandoned: set[int] = set()  # job ids whose thread was given up on
        self._current: dict[threading.Thread, int] = {}  # executor thread -> its job
        self._timed_out: set[int] = set()  # the same ids, until their outcome is in

    # -- control ----------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped (or the burst, job or memory limit); returns the exit code 0."""
        self._register()
        self._start_threads()
        logger.info(
            "worker started id=%s queues=%s concurrency=%d listen=%s",
            self.process.id if self.process else "-",
            ",".join(self.queues),
            self.concurrency,
            self.listen,
        )
        try:
            self._dispatch()
        finally:
            self._shutdown()
        return 0

    def stop(self, reason: str = "stop requested", *, release_prefetched: bool = True) -> None:
        """Stop claiming; jobs in flight get the grace period, then are released.

        Jobs claimed ahead and not started are released at once (another worker can
        run them now), unless `release_prefetched` is False: then they run first, as
        when a job or memory limit ends the worker.
        """
        self._release_prefetched = release_prefetched
        if not self._stopping.is_set():
            self.stop_reason = reason
            logger.info("worker stopping reason=%s in_flight=%d", reason, self.in_flight)
        self._stopping.set()
        self._wake.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: a graceful stop; a second one exits at once. Main thread only."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            logger.warning("second signal: exiting now; jobs in flight are left to the reaper")
            logging.shutdown()
            os._exit(1)
        self.stop(f"signal {signal.Signals(signum).name}")

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._flights)

    @property
    def stuck_threads(self) -> int:
        """Executor threads still inside a task after shutdown (Python cannot kill them)."""
        return sum(1 for thread in self._threads if thread.is_alive())

    # -- the dispatcher ---------------------------------------------------------------

    @property
    def prefetch(self) -> int:
        """Jobs to hold claimed ahead of free threads now.

        Fixed if PREFETCH (or --prefetch) says so. Otherwise enough to keep every thread
        busy for about PREFETCH_WINDOW_SECONDS at the jobs' mean run time, at most
        PREFETCH_PER_THREAD_MAX per thread: many for jobs of milliseconds (claims and
        acks then come in large batches), none for jobs of a second or more (they stay
        in the table, where an idle worker elsewhere can take them). Nothing until the
        first jobs have run.
        """
        if self.fixed_prefetch is not None:
            return self.fixed_prefetch
        mean = self._mean_duration
        if mean is None:
            return 0
        ahead = self.concurrency * PREFETCH_WINDOW_SECONDS / max(mean, 1e-6)
        return int(min(ahead, self.concurrency * PREFETCH_PER_THREAD_MAX))

    def _observe_duration(self, seconds: float) -> None:
        mean = self._mean_duration
        self._mean_duration = seconds if mean is None else 0.9 * mean + 0.1 * seconds

    def _free_slots(self) -> int:
        """Jobs to claim now: free threads plus free room in the prefetch buffer.

        Claims wait until half the room is free (so that they come in batches) unless
        a thread is idle; 0 means do not claim yet.
        """
        with self._lock:
            held = len(self._flights) - len(self._acking)  # buffered or running
            idle_thread = self._busy + self._work.qsize() < self.concurrency
        capacity = self.concurrency + self.prefetch
        free = capacity - held
        if self.max_jobs is not None:
            free = min(free, self.max_jobs - self.stats.claimed)
        if free <= 0 or (not idle_thread and free < max(1, capacity // 2)):
            return 0
        return free

    def _dispatch(self) -> None:
        backoff = Backoff()
        while not self._stopping.is_set():
            self._wake.clear()
            self._ack_finished()
            if self._limit_reached():
                break
            free = self._free_slots()
            if free <= 0:
                self._wake.wait(1.0)
                continue
            try:
                claimed = self._claim(free)
            except DatabaseError as error:
                # Passing (the connection, a read-only or restarting server) or not (the
                # claim already isolated bad rows; what is left is logged): back off.
                delay = backoff.next()
                if is_transient(error):
                    logger.warning("claim failed, retrying in %.2fs: %s", delay, error)
                else:
                    logger.exception("claim failed, retrying in %.2fs", delay)
                discard_connection(self.database)
                self._stopping.wait(delay)
                continue
            backoff.reset()
            if len(claimed) == free:
                continue  # there may be more: claim again once a thread is free
            if not claimed and self.burst and self.in_flight == 0:
                self.stop("burst: no due job left")
                break
            if self._wake.is_set():
                continue  # a job finished meanwhile: ack it first
            timeout = self._idle_timeout() if not claimed else 1.0
            logger.debug("worker idle claimed=%d wait=%.3fs", len(claimed), timeout)
            self._wake.wait(timeout)

    def _defer_ack(self, job: Job, attempt: int, result: Any, duration: float) -> None:
        """From an executor thread: queue a success for the dispatcher's next batch."""
        with self._lock:
            self._finished_jobs.append(_Finished(job, attempt, result, duration))
            self._acking.add(job.id)
        self._wake.set()

    def _ack_finished(self) -> None:
        """Acknowledge every success queued since the last turn in one fenced statement.

        Each job keeps its own fence (id, attempt, unexpired lease). A connection error
        is retried until answered (or a lease has passed), as for any outcome, and an
        ack refused after a retry is checked for having committed the first time.
        """
        with self._lock:
            batch, self._finished_jobs = self._finished_jobs, []
        if not batch:
            return
        jobs = Job.objects.db_manager(self.database)
        acks = [(item.job.id, item.attempt, item.result) for item in batch]
        give_up = min(item.job.lease.total_seconds() for item in batch)
        what = f"ids={','.join(str(item.job.id) for item in batch[:10])}"
        errors: dict[int, DatabaseError] = {}  # rows whose own ack the database refused
        try:
            answer = persist(
                lambda: jobs.ack_many(acks, errors=errors),
                give_up_after=give_up,
                what=what,
                database=self.database,
            )
        except DatabaseError:  # not a passing error, and not one row's: log, leave
            logger.exception("worker could not acknowledge %s; left to the reaper", what)
            answer = Answer(unknown=True)
        unknown = answer.unknown
        acked = set(answer.value or ())
        refused = [
            (item.job.id, item.attempt)
            for item in batch
            if item.job.id not in acked and item.job.id not in errors
        ]
        if refused and not unknown:
            try:
                found = persist(
                    lambda: committed_before(jobs, refused),
                    give_up_after=give_up,
                    what=what,
                    database=self.database,
                )
            except DatabaseError:  # not a passing error: their outcome is unknown
                logger.exception("worker could not check refused acks %s", what)
                found = Answer(unknown=True)
            acked |= found.value or set()
            unknown = found.unknown
        self.stats.acked_batches += 1
        for item in batch:
            execution = None
            try:
                if item.job.id in errors:
                    execution = record_ack_error(
                        item.job, item.attempt, errors[item.job.id], item.duration, self.database
                    )
                else:
                    execution = record_success(
                        item.job,
                        item.attempt,
                        item.result,
                        item.duration,
                        acked=True if item.job.id in acked else (None if unknown else False),
                    )
            except Exception:
                logger.exception("worker could not record job id=%s", item.job.id)
            finally:
                with self._lock:
                    self._acking.discard(item.job.id)
                self._finished(item.job, execution)
        # The success signals' receivers ran on this thread: nothing they left open may
        # hold the next batch's acks uncommitted.
        for what_was_left in end_open_transactions():
            logger.error("worker rolled back %s, left by a signal receiver", what_was_left)

    def _claim(self, limit: int) -> list[Job]:
        claimed = Job.objects.db_manager(self.database).claim(
            queues=self.queues, limit=limit, worker=self.process
        )
        now = time.monotonic()
        with self._lock:
            for job in claimed:
                lease = job.lease.total_seconds()
                flight = _Flight(job, job.attempts, lease, now + lease / 3)
                timeout = registry.get(job.task).timeout if job.task in registry else None
                if timeout is not None:
                    flight.timeout = timeout.total_seconds()
                self._flights[job.id] = flight
            self.stats.claimed += len(claimed)
        if claimed:
            self._housekeeper_wake.set()  # schedule the new jobs' renewals
        for job in claimed:
            logger.debug("job claimed id=%s task=%s attempt=%d", job.id, job.task, job.attempts)
            self._work.put(job)
        return claimed

    def _idle_timeout(self) -> float:
        """Until the next scheduled job is due, at most the (jittered) poll interval."""
        timeout = self.poll_interval * random.uniform(0.9, 1.1)
        try:
            with connections[self.database].cursor() as cursor:
                next_due = sql.seconds_until_next_due(cursor, self.queues)
        except DatabaseError:
            discard_connection(self.database)
            return min(timeout, 1.0)
        if next_due is not None:
            timeout = min(timeout, max(next_due, 0.005))
        return timeout

    def _limit_reached(self) -> bool:
        if self.max_jobs is not None and self.stats.claimed >= self.max_jobs:
            self.stop(f"max jobs reached ({self.max_jobs})", release_prefetched=False)
            return True
        if self.max_memory_mb is not None:
            rss = resident_memory_mb()
            if rss > self.max_memory_mb:
                self.stop(
                    f"max memory reached ({rss:.0f} MB > {self.max_memory_mb:g} MB)",
                    release_prefetched=False,
                )
                return True
        return False

    # -- executor threads -------------------------------------------------------------

    def _execute_loop(self) -> None:
        try:
            while (job := self._work.get()) is not None:
                self._starting(job)
                execution: Execution | None = None
                raised = True
                refresh_connections()
                try:
                    execution = execute(job, database=self.database, defer_ack=self._defer_ack)
                    raised = False
                except Exception:
                    logger.exception("worker could not record job id=%s", job.id)
                finally:
                    refresh_connections()
                    with self._lock:
                        self._busy -= 1
                        self._current.pop(threading.current_thread(), None)
                    if execution is not None or raised:  # else the dispatcher acks it
                        self._finished(job, execution)
                with self._lock:
                    if job.id in self._abandoned:
                        self._abandoned.discard(job.id)
                        self._threads.remove(threading.current_thread())
                        return  # a replacement thread took this one's place
        finally:
            connections.close_all()

    def _starting(self, job: Job) -> None:
        """A thread takes `job` from the buffer: its timeout counts from now."""
        with self._lock:
            self._busy += 1
            self._current[threading.current_thread()] = job.id
            flight = self._flights.get(job.id)
            if flight is not None and flight.timeout is not None:
                flight.timeout_at = time.monotonic() + flight.timeout
        self._wake.set()  # room in the buffer

    def _finished(self, job: Job, execution: Execution | None) -> None:
        with self._lock:
            self._flights.pop(job.id, None)
            if job.id in self._timed_out:
                self._timed_out.discard(job.id)
                return  # counted when it timed out
            self.stats.finished += 1
            if execution is not None:
                self._observe_duration(execution.duration)
                key = execution.outcome.value
                self.stats.outcomes[key] = self.stats.outcomes.get(key, 0) + 1
        self._wake.set()

    # -- housekeeping -----------------------------------------------------------------

    def _housekeep_loop(self) -> None:
        reaper = Reaper(database=self.database)
        now = time.monotonic()
        next_beat = now + self.heartbeat_interval
        first_reap = self.reap_interval * random.uniform(0.1, 1.0) if self.reap_interval else 0
        next_reap = now + first_reap
        backoff = Backoff()
        try:
            while not self._halted.is_set():
                try:
                    self._renew_due_leases()
                    now = time.monotonic()
                    if now >= next_beat:
                        self._heartbeat()
                        next_beat = now + self.heartbeat_interval
                    if self.reap_interval and now >= next_reap:
                        result = reaper.reap()
                        self.stats.reaped += result.requeued + result.failed
                        if not result.locked_out:
                            reaper.prune(workers_dead_for=self.prune_workers_after)
                        next_reap = now + self.reap_interval * random.uniform(0.9, 1.1)
                    backoff.reset()
                    soonest = min(
                        self._next_renewal(),
                        next_beat,
                        next_reap if self.reap_interval else next_beat,
                    )
                    wait = min(soonest - time.monotonic(), 1.0)
                except Exception as error:  # noqa: BLE001  (this thread must not die)
                    wait = backoff.next()
                    if is_transient(error):
                        logger.warning("housekeeping failed, retrying in %.2fs: %s", wait, error)
                    else:
                        logger.exception("housekeeping failed, retrying in %.2fs", wait)
                    discard_connection(self.database)
                self._housekeeper_wake.wait(max(wait, 0.01))
                self._housekeeper_wake.clear()
        finally:
            connections.close_all()

    def _next_renewal(self) -> float:
        with self._lock:
            return min((flight.renew_at for flight in self._flights.values()), default=1e18)

    def _renew_due_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            timed_out = [
                f
                for f in self._flights.values()
                if f.timeout_at <= now and f.job.id not in self._acking  # not if finished
            ]
            due = [f for f in self._flights.values() if f.renew_at <= now and f.timeout_at > now]
        for flight in timed_out:
            self._abandon(flight)
        for flight in due if self.renew_leases else ():
            held = Job.objects.db_manager(self.database).renew(flight.job.id, flight.attempt)
            if held:
                flight.renew_at = time.monotonic() + flight.lease_seconds / 3
                self.stats.renewed += 1
                continue
            flight.renew_at = 1e18  # never again: this attempt lost the job
            self.stats.renew_refused += 1
            logger.warning(
                "job lease lost id=%s task=%s attempt=%d: renewal refused; its outcome "
                "will be refused too",
                flight.job.id,
                flight.job.task,
                flight.attempt,
            )

    def _abandon(self, flight: _Flight) -> None:
        """Stop renewing a job past its timeout and give its thread's place to a new one.

        Python cannot stop a thread: the old one runs on until the task returns, and its
        outcome is then refused by the fence if the reaper took the job back meanwhile.
        """
        with self._lock:
            if self._flights.pop(flight.job.id, None) is None:
                return  # finished just now
            self._abandoned.add(flight.job.id)
            self._timed_out.add(flight.job.id)
            self.stats.timed_out += 1
            hung = len(self._abandoned)
        logger.warning(
            "job timed out id=%s task=%s attempt=%d: lease no longer renewed; the reaper "
            "will take it back",
            flight.job.id,
            flight.job.task,
            flight.attempt,
        )
        self._spawn_executor()
        self._wake.set()
        if hung > self.concurrency:
            self.stop(f"{hung} threads hung in timed-out tasks; restart the process")

    def _spawn_executor(self) -> None:
        self._start_thread(f"skipqueue-executor-{len(self._threads)}", self._execute_loop)

    def _start_thread(self, name: str, target: Any) -> None:
        thread = threading.Thread(target=self._guarded, args=(name, target), name=name, daemon=True)
        if target == self._execute_loop:
            self._threads.append(thread)
        else:
            self._helpers.append(thread)
        thread.start()

    def _guarded(self, name: str, target: Any) -> None:
        """Run a thread's loop; if it dies of an exception, start it again.

        No thread of a worker may die silently: a dead housekeeper would stop renewals
        and heartbeats, a dead executor would hold its job for ever. The job a dead
        executor held stops being renewed, so the reaper takes it back. A loop that
        returns (at shutdown, or a listener that falls back to polling) is not restarted.
        """
        try:
            target()
        except BaseException:  # noqa: BLE001  (whatever it was, the thread is gone)
            with self._lock:
                job_id = self._current.pop(threading.current_thread(), None)
                if job_id is not None:
                    self._flights.pop(job_id, None)
                    self._busy -= 1
                self.stats.thread_restarts += 1
                threads = self._threads if target == self._execute_loop else self._helpers
                if threading.current_thread() in threads:
                    threads.remove(threading.current_thread())
            logger.exception("worker thread died thread=%s job=%s; restarting it", name, job_id)
            if not self._halted.wait(0.5):  # no tight loop if it dies at once again
                self._start_thread(name, target)
            self._wake.set()

    def _heartbeat(self) -> None:
        if self.process is None:
            return
        beat = WorkerProcess.objects.using(self.database).filter(id=self.process.id)
        if not beat.update(heartbeat_at=Now()):
            self.process.save(using=self.database, force_insert=True)  # pruned as dead: back

    # -- the listener -----------------------------------------------------------------

    def _listen_loop(self) -> None:
        backoff = Backoff()
        while not self._halted.is_set():
            raw = None
            try:
                wrapper = connections[self.database]
                raw = wrapper.get_new_connection(wrapper.get_connection_params())
                raw.autocommit = True
                sql.listen(raw, self.queues)
                if not self._listen_works(raw):
                    logger.warning(
                        "LISTEN does not receive notifications on this connection (a "
                        "transaction pooler such as PgBouncer?); polling every %.1fs instead. "
                        "Point the worker at a direct connection, or set "
                        "SKIPQUEUE['LISTEN'] = False to silence this.",
                        self.poll_interval,
                    )
                    return
                logger.info("worker listening queues=%s", ",".join(self.queues))
                self._wake.set()  # anything enqueued while we were not listening
                backoff.reset()
                while not self._halted.is_set():
                    for notify in raw.notifies(timeout=1.0, stop_after=1):
                        logger.debug("worker notified channel=%s", notify.channel)
                        self._wake.set()
            except Exception as error:  # psycopg errors come raw here, not as Django's
                delay = backoff.next()
                logger.warning("listen failed, retrying in %.2fs: %s", delay, error)
                self._halted.wait(delay)
            finally:
                if raw is not None:
                    try:
                        raw.close()
                    except Exception:  # noqa: BLE001, S110  (already broken)
                        pass

    def _listen_works(self, raw: Any) -> bool:
        """Send a NOTIFY from another connection; through a transaction pooler it never comes.

        From the same connection the test could pass by luck: a pooler may hand that
        connection the very server session its LISTEN ran on. From another one, only a
        session that really stays ours receives it.
        """
        channel = sql.channel_name(self.queues[0])
        try:
            with connections[self.database].cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, %s)", [channel, sql.SELF_TEST_PAYLOAD])
        finally:
            connections[self.database].close()  # the listener keeps only its own session
        for notify in raw.notifies(timeout=2.0):
            if notify.payload == sql.SELF_TEST_PAYLOAD:
                return True
            self._wake.set()  # a real one arrived meanwhile
        return False

    # -- start and stop ---------------------------------------------------------------

    def _register(self) -> None:
        """Record this worker's row; a passing error (no server yet, a read-only one) is
        retried with backoff until it goes through or the worker is stopped."""
        backoff = Backoff()
        while True:
            try:
                self.process = WorkerProcess.objects.using(self.database).create(
                    hostname=socket.gethostname()[:255],
                    pid=os.getpid(),
                    queues=self.queues,
                    concurrency=self.concurrency,
                )
                return
            except DatabaseError as error:
                if not is_transient(error):
                    raise
                if self._stopping.is_set():
                    return
                delay = backoff.next()
                logger.warning("worker registration failed, retrying in %.2fs: %s", delay, error)
                discard_connection(self.database)
                self._stopping.wait(delay)

    def _start_threads(self) -> None:
        for _ in range(self.concurrency):
            self._spawn_executor()
        self._start_thread("skipqueue-housekeeper", self._housekeep_loop)
        if self.listen:
            self._start_thread("skipqueue-listener", self._listen_loop)

    def _shutdown(self) -> None:
        """Give jobs in flight the grace period, release the rest, then end every thread."""
        unstarted = []  # claimed ahead, never started: released at once
        while self._release_prefetched:
            try:
                job = self._work.get_nowait()
            except queue.Empty:
                break
            if job is None:  # the threads' stop sentinel (only put after this drain)
                break
            with self._lock:
                flight = self._flights.pop(job.id, None)
            if flight is not None:
                unstarted.append(flight)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline:
            self._wake.clear()
            self._ack_finished()
            with self._lock:
                if not self._flights:
                    break
            self._wake.wait(min(0.05, max(deadline - time.monotonic(), 0)))
        self._ack_finished()
        with self._lock:
            unfinished = unstarted + list(self._flights.values())
        for flight in unfinished:
            try:
                released = Job.objects.db_manager(self.database).release(
                    flight.job.id, flight.attempt
                )
            except DatabaseError as error:
                logger.warning("job not released id=%s: %s; the reaper will", flight.job.id, error)
                continue
            if released:
                self.stats.released_on_shutdown += 1
                logger.warning(
                    "job released on shutdown id=%s task=%s attempt=%d",
                    flight.job.id,
                    flight.job.task,
                    flight.attempt,
                )
        self._halted.set()
        self._housekeeper_wake.set()
        for _ in self._threads:
            self._work.put(None)
        # One shared deadline: threads still inside a task (past the grace, their jobs
        # released) are not waited for one by one.
        join_until = time.monotonic() + 1.0
        for thread in [*self._helpers, *self._threads]:
            thread.join(timeout=max(join_until - time.monotonic(), 0))
        if self.process is not None:
            try:
                WorkerProcess.objects.using(self.database).filter(id=self.process.id).update(
                    heartbeat_at=Now() - dead_after()
                )
            except DatabaseError:
                pass
        connections.close_all()
        logger.info(
            "worker stopped reason=%s claimed=%d succeeded=%d failed=%d lost=%d released=%d",
            self.stop_reason or "-",
            self.stats.claimed,
            self.stats.count(Outcome.SUCCEEDED),
            self.stats.count(Outcome.FAILED),
            self.stats.count(Outcome.LOST),
            self.stats.released_on_shutdown,
        )


def resident_memory_mb() -> float:
    """This process's resident set size in MB (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


__all__ = ["Worker", "WorkerStats", "resident_memory_mb"]
