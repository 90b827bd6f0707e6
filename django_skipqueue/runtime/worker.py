"""Worker: claim in batches, run jobs on threads, renew leases, housekeep, stop gracefully.

Threads and connections (N = concurrency; `connection_budget()` says how many at most):
- the dispatcher (the thread that calls `run()`): acknowledges every job that finished
  since its last turn in one fenced statement, claims as many due jobs as there are free
  threads plus the prefetch buffer in one claim, then waits for a NOTIFY, a finished job
  or the poll timeout;
- N executor threads: each runs one job at a time on its own Django connection; a
  success is handed to the dispatcher to acknowledge, other outcomes are written at once;
- the housekeeper (housekeeper.py): renews the leases of jobs in flight, records the
  heartbeat, reaps expired leases, and looks at the jobs past their hard time limit
  (timelimits.py: a task that does not stop makes the worker exit, code 3);
- the notifier (notifier.py): LISTENs on the queues' channels on its own connection;
- the scheduler (maintenance/scheduler.py): enqueues the schedules' occurrences (a
  worker whose code has none left syncs once, then its thread ends).

The jobs held, from claim to outcome, are owned by an InFlight (inflight.py); the
threads change them only through its methods. A thread that dies is started again.

The process clock only schedules (when to renew, how long to wait); every decision on
a lease is made by the database in a fenced statement.

Over 600 lines: the dispatch loop (claim, hand over, acknowledge, burst, limits) is one
thread's state machine; its threads' start and its stop are `lifecycle.py`'s.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from django.db import DatabaseError, connections

from django_skipqueue.conf import get_settings
from django_skipqueue.conf.limits import fair_queue_problems, queue_limits
from django_skipqueue.conf.relay import relayed_queues
from django_skipqueue.core.states import DEFAULT_QUEUE_NAME, validate_queue_name
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.faults import is_transient
from django_skipqueue.maintenance.scheduler import defined_schedules
from django_skipqueue.models import Job, Queue, WorkerProcess
from django_skipqueue.queue import sql
from django_skipqueue.queue.connections import (
    HEALTH_CHECK_SECONDS,
    Backoff,
    discard_connection,
    refresh_connections,
)
from django_skipqueue.queue.managers import JobManager
from django_skipqueue.runtime.executor import (
    OUTSIDE_ATOMIC,
    Execution,
    Success,
    acknowledge,
    end_open_transactions,
    execute,
)
from django_skipqueue.runtime.flow import REFRESH_SECONDS, FlowView
from django_skipqueue.runtime.housekeeper import Housekeeper
from django_skipqueue.runtime.inflight import (
    Buffer,
    ClaimSize,
    Finished,
    InFlight,
)
from django_skipqueue.runtime.lifecycle import WorkerLifecycle
from django_skipqueue.runtime.meter import Meter
from django_skipqueue.runtime.notifier import Notifier
from django_skipqueue.runtime.progress import ProgressLog, WorkerStats
from django_skipqueue.runtime.stopsignals import StopSignals
from django_skipqueue.runtime.threads import Supervisor
from django_skipqueue.runtime.timelimits import EXIT_TIME_LIMIT, HardLimits
from django_skipqueue.runtime.waiting import Waiting
from django_skipqueue.tasks.registry import registry

logger = logging.getLogger(__name__)


def connection_budget(
    concurrency: int, *, listen: bool = True, schedules: bool = True, relay: bool = False
) -> int:
    """The most database connections one worker process opens: the dispatcher, one per
    executor thread, the housekeeper, the notifier (with LISTEN), the scheduler (with
    schedules), and `--relay`'s thread and its own notifier. Size `max_connections`
    and a pooler's pool with it (docs/howto/deploy-workers.md)."""
    return 1 + concurrency + 1 + int(listen) + int(schedules) + (2 if relay else 0)


#: A job that waited this long in the prefetch buffer is checked for a cancel request
#: before it starts (one read by primary key): cancelled while buffered, it never runs.
BUFFERED_CANCEL_CHECK_SECONDS = 0.5


class Worker(WorkerLifecycle):
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
        schedules: bool | None = None,
        meter: Meter | None = None,
    ) -> None:
        conf = get_settings()
        self.queues = [validate_queue_name(name) for name in dict.fromkeys(queues)]
        if not self.queues:
            raise ValueError("a worker needs at least one queue")
        relayed = sorted(relayed_queues().intersection(self.queues))
        if relayed:
            raise ConfigurationError(
                f"queue {', '.join(relayed)} is relayed to RabbitMQ (SKIPQUEUE['RELAY']): "
                f"its jobs are published by 'manage.py relayjobs' and run by "
                f"'manage.py runworker --broker', not claimed from the table"
            )
        unfair = fair_queue_problems()
        if unfair:
            raise ConfigurationError("; ".join(unfair))
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.concurrency = concurrency
        self.sizing = ClaimSize(
            concurrency=concurrency, fixed=conf.PREFETCH if prefetch is None else prefetch
        )
        self.burst = burst
        self.max_jobs = max_jobs
        self.max_memory_mb = max_memory_mb
        self.grace = conf.GRACE_SECONDS if grace is None else grace
        self.poll_interval = conf.POLL_INTERVAL_SECONDS if poll_interval is None else poll_interval
        self.listen = conf.LISTEN if listen is None else listen
        self.database = database or conf.DATABASE_ALIAS
        #: The periodic schedules whose occurrences this worker enqueues: all of them,
        #: unless turned off (`schedules=False`) or a burst worker (None: not burst).
        wanted = not burst if schedules is None else schedules
        self.schedules = defined_schedules() if wanted else {}
        #: Whether this worker syncs the schedule table at start (even with no schedule
        #: left in its code: it deletes the rows of those removed).
        self.syncs_schedules = bool(wanted)
        self.stats = WorkerStats()
        #: Per-queue counts for the admin's charts (and Prometheus, if attached).
        self.meter = meter or Meter()
        self.process: WorkerProcess | None = None
        self.stop_reason = ""

        self.flow = FlowView(
            queues=self.queues,
            limits=queue_limits(),
            read_paused=Queue.objects.db_manager(self.database).paused_names,
        )
        #: This worker's fair queues (claimed by share: queue/fair.py), and where each
        #: one's next claim starts looking at its keys (the last claim's largest key).
        self.fair = frozenset(conf.FAIR_QUEUES).intersection(self.queues)
        self._fair_start: dict[str, str] = {}
        self._fair_first = False  # which of the plain and the fair claims goes first
        self._held_back: float | None = None  # seconds until a limit may let more through
        self._burst_looked = False  # a burst with nothing to claim looked further once
        self._burst_refilled = False  # ... and found a bucket refilled since (once)
        self._last_full = False  # the last claim took all it asked for
        self.held = InFlight()
        self._work = Buffer()  # claimed jobs on their way to the executor threads
        self._wake = threading.Event()  # a NOTIFY, a free thread, or stop()
        self._stopping = threading.Event()  # no more claims
        self._halted = threading.Event()  # shutdown finished: helpers end
        self._notifier: Notifier | None = None  # its bell is rung at shutdown
        # Set once the first claim has returned (or failed): the helpers wait for it,
        # up to HELPERS_HEAD_START_SECONDS, before their first statement.
        self._first_claim = threading.Event()
        self._signals = 0
        self._release_prefetched = True
        self.threads = Supervisor(halted=self._halted, died=self._thread_died)
        self.waiting = Waiting(database=self.database)
        self.time_limits = HardLimits(
            held=self.held, stats=self.stats, database=self.database, stop=self.stop
        )
        self.housekeeper = Housekeeper(
            database=self.database,
            held=self.held,
            stats=self.stats,
            halted=self._halted,
            past_limit=self.time_limits.look,
            heartbeat_interval=conf.HEARTBEAT_SECONDS,
            reap_interval=conf.REAP_INTERVAL_SECONDS if reap_interval is None else reap_interval,
            prune_workers_after=timedelta(seconds=conf.WORKER_PRUNE_AFTER_SECONDS),
            progress=ProgressLog(self.stats, conf.PROGRESS_SECONDS)
            if conf.PROGRESS_SECONDS
            else None,
            flow=self.flow,
            wake_dispatcher=self._wake.set,
            meter=self.meter,
            waiting=self.waiting,
        )

    @property
    def renew_leases(self) -> bool:
        """Renew the leases of jobs in flight (only fault tests turn it off)."""
        return self.housekeeper.renew_leases

    @renew_leases.setter
    def renew_leases(self, value: bool) -> None:
        self.housekeeper.renew_leases = value

    # -- control ----------------------------------------------------------------------

    @property
    def stuck_exit(self) -> bool:
        """It stopped for a task past its hard time limit that did not stop."""
        return self.time_limits.stuck_exit

    def run(self) -> int:
        """Run until stopped (or the burst, job or memory limit); returns the exit code:
        0, or EXIT_TIME_LIMIT when it stopped for a task past its hard time limit whose
        code still runs (the caller should end the process: timelimits.py)."""
        # In the process that counts (a pool's child, after its fork: made in the parent,
        # a series' values would be the parent's, never the pool's shared files).
        self.meter.prime(
            self.queues, {name: registry.get(name).queue_name for name in registry.names()}
        )
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
            # The signal handlers stay until the process exits: a SIGTERM that comes
            # while it exits (a pool forwards one to a child that stopped on its own)
            # is a stop already done, not a kill by the default action.
            self._shutdown()
        return EXIT_TIME_LIMIT if self.stuck_exit else 0

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
        """SIGTERM/SIGINT: a graceful stop; a second one exits at once. Main thread only.

        The handlers run `_on_signal` from a thread of their own (`stopsignals`): a
        handler that set the wake Event could deadlock with the dispatcher holding it.
        """
        StopSignals(self._on_signal).install()

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        if self._signals > 1:
            logger.warning("second signal: exiting now; jobs in flight are left to the reaper")
            logging.shutdown()
            os._exit(1)
        self.stop(f"signal {signal.Signals(signum).name}")

    @property
    def in_flight(self) -> int:
        return len(self.held)

    @property
    def stuck_threads(self) -> int:
        """Executor threads still inside a task after shutdown (Python cannot kill them)."""
        return sum(1 for thread in self.threads.group("executors") if thread.is_alive())

    # -- the dispatcher ---------------------------------------------------------------

    @property
    def prefetch(self) -> int:
        """Jobs to hold claimed ahead of free threads now (see `inflight.ClaimSize`)."""
        return self.sizing.prefetch()

    def _free_slots(self) -> int:
        """Jobs to claim now (see `inflight.ClaimSize.free`); 0: do not claim yet."""
        free = self.sizing.free(
            held=self.held.held(),
            idle_thread=self.held.busy + self._work.qsize() < self.concurrency,
        )
        if self.max_jobs is not None:
            free = min(free, self.max_jobs - self.stats.claimed)
        return max(free, 0)

    def _dispatch(self) -> None:
        backoff = Backoff()
        while not self._stopping.is_set():
            self._wake.clear()
            self._ack_finished()
            if self._limit_reached():
                break
            free = self._free_slots()
            if free <= 0:
                self._wake.wait(self._unhoard())
                continue
            try:
                claimed = self._claim(free)
            except DatabaseError as error:
                self._first_claim.set()  # the helpers start now, not after the back-off
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
            linger = self.waiting.after_claim(len(claimed))
            done = not claimed and self.burst and self.in_flight == 0
            if claimed:
                self._burst_looked = self._burst_refilled = False
            elif done:
                more = self._burst_more()
                if more is not None:  # due jobs to claim now, or once a limit allows
                    if more > 0:
                        self._stopping.wait(more)
                    continue
            if done:  # before the helpers start: the listener then does not LISTEN
                self.stop("burst: no due job left")
            if not self._first_claim.is_set():  # once (Event.set takes a lock each time)
                self._first_claim.set()  # the helpers start now (`_start_helper`)
            if done:
                break
            if len(claimed) == free:
                continue  # there may be more: claim again once a thread is free
            if linger == 0.0:
                continue  # waiting from now: claim once more before sleeping (waiting.py)
            if self._wake.is_set():
                continue  # a job finished meanwhile: ack it first
            if linger is not None:
                timeout = linger  # jobs came a moment ago: look again soon, unannounced
            else:
                timeout = self._idle_timeout() if not claimed else 1.0
            logger.debug("worker idle claimed=%d wait=%.3fs", len(claimed), timeout)
            self._wake.wait(timeout)

    def _burst_more(self) -> float | None:
        """A burst worker found nothing to claim and holds nothing: whether to exit
        (None) or claim again after this many seconds. Not before it looked, once, at
        what a plain claim cannot see (bursts exited with due jobs left, every time:
        tests/runtime/test_worker.py, `test_a_burst_runs_the_keyed_and_rate_limited_jobs_...`):
        - a limit that held jobs back (a queue's rate or slots): after its wait;
        - expired leases of a worker that died: one reap (unless `reap_interval=0`);
          a drain shorter than the reap interval otherwise exited past them for good;
        - due keyed jobs (a concurrency key, a rate-limited task) that the keyed claim
          did not look for since its last empty look: a keyed claim now; those left
          out for an empty token bucket, after the bucket's refill.
        Keyed jobs whose key another worker's jobs fill are left to that worker."""
        if self._held_back is not None:
            return max(self._held_back, 0.005)
        jobs = Job.objects.db_manager(self.database)
        fast, _limited = self.flow.plan()
        try:
            if not self._burst_looked:
                self._burst_looked = True
                if self.housekeeper.reap_interval:
                    reaped = self.housekeeper.reap()
                    if reaped.requeued:
                        self.flow.note_keyed(True)
                        return 0.0
                if fast and jobs.keyed_due(fast):
                    self.flow.note_keyed(True)
                    return 0.0
                return None
            refill = jobs.seconds_until_rate_refill(fast) if fast else None
        except DatabaseError as error:
            logger.warning("the look before the burst's exit failed: %s", error)
            discard_connection(self.database)
            return None
        if refill is None:
            return None
        if refill == 0.0:  # refilled since the claim: one more claim, not a loop (a job
            if self._burst_refilled:  # whose key another worker fills is not a candidate,
                return None  # and its bucket, untouched, stays "refilled")
            self._burst_refilled = True
        self._burst_looked = False  # after the wait: the keyed claim, then look again
        self.flow.note_keyed(True)
        return refill

    def _defer_ack(self, job: Job, attempt: int, result: object, duration: float) -> None:
        """From an executor thread: queue a success for the dispatcher's next batch."""
        self.held.queue_ack(Finished(job, attempt, result, duration))
        self._nudge()

    def _nudge(self) -> None:
        """Wake the dispatcher (from an executor thread, two or three times a job).

        Where the Event is set already, its lock and notify are spared (about 4 % of a
        worker's CPU at concurrency 4, py-spy): no wake-up is lost by it, because
        `_dispatch` clears the Event before it looks at the finished jobs and the free
        threads, so a change made before the set flag was seen is seen by that look.
        """
        if not self._wake.is_set():
            self._wake.set()

    def _ack_finished(self) -> None:
        """Acknowledge every success queued since the last turn (executor.acknowledge)."""
        batch = self.held.take_acks()
        if not batch:
            return
        successes: list[Success] = [(f.job, f.attempt, f.result, f.duration) for f in batch]
        executions = acknowledge(successes, self.database)
        self.stats.acked_batches += 1
        for item, execution in zip(batch, executions, strict=True):
            self.held.acked(item.job.id)
            self._finished(item.job, execution)

    def _claim(self, limit: int) -> list[Job]:
        """Claim up to `limit` jobs and hand them to the executor threads.

        The fast path (one statement, `JobManager.claim`) takes plain jobs of the queues
        that are neither paused nor limited (`flow.FlowView` says which). Jobs with a
        concurrency key and those of limited queues go through `claim_limited`: first
        when a queue is limited, or when keyed jobs wait and the fast path has kept
        every claim full for a while (so that they are not starved by plain ones);
        otherwise after the fast path, when it left room and keyed jobs may wait (a
        NOTIFY on the keyed channel, or the housekeeper's probe, said so).
        """
        jobs = Job.objects.db_manager(self.database)
        fast, limited = self.flow.plan()
        self._held_back = None
        claimed: list[Job] = []
        keyed = self.flow.keyed_waiting()
        first = bool(limited) or (keyed and self.flow.keyed_check_due(busy=self._last_full))
        if first:
            claimed += self._claim_limited(jobs, fast + limited, limit)
        if fast and len(claimed) < limit:
            if self.fair:
                claimed += self._claim_fast_and_fair(jobs, fast, limit - len(claimed))
            else:
                plain = jobs.claim(queues=fast, limit=limit - len(claimed), worker=self.process)
                claimed += self._hand_over(plain)
            self.flow.refresh_soon()  # the jobs are running: now is a good time to read
            if keyed and not first and len(claimed) < limit:
                claimed += self._claim_limited(jobs, fast, limit - len(claimed))
        self._last_full = len(claimed) >= limit
        return claimed

    def _claim_fast_and_fair(self, jobs: JobManager, fast: list[str], limit: int) -> list[Job]:
        """The fast path of a worker with fair queues: the plain claim of its other
        queues and the fair claim of each fair one (`claim_fair`), taking turns at going
        first, so that neither kind keeps the other's jobs waiting while both have
        some."""
        plain = [name for name in fast if name not in self.fair]
        fair = [name for name in fast if name in self.fair]
        self._fair_first = not self._fair_first
        turns: list[str | None] = [*fair, None] if self._fair_first else [None, *fair]
        claimed: list[Job] = []
        for queue in turns:
            if len(claimed) >= limit:
                break
            if queue is None:
                if plain:
                    got = jobs.claim(queues=plain, limit=limit - len(claimed), worker=self.process)
                    claimed += self._hand_over(got)
                continue
            got, self._fair_start[queue] = jobs.claim_fair_from(
                queue=queue,
                limit=limit - len(claimed),
                worker=self.process,
                start=self._fair_start.get(queue, ""),
            )
            claimed += self._hand_over(got)
        return claimed

    def _claim_limited(self, jobs: JobManager, queues: list[str], limit: int) -> list[Job]:
        claimed, held_back = jobs.claim_limited(
            queues=queues, limits=self.flow.limits, limit=limit, worker=self.process
        )
        if held_back is not None:
            self._held_back = held_back
        # Keyed jobs still wait if this claim was full or a limit held some back;
        # otherwise the housekeeper's probe or the next keyed NOTIFY says when to look.
        self.flow.note_keyed(len(claimed) >= limit or held_back is not None)
        return self._hand_over(claimed)

    def _hand_over(self, claimed: list[Job]) -> list[Job]:
        """Hold the claimed jobs (their leases renewed from now) and queue them to run,
        but those that would wait in the buffer longer than the worker can tell
        (`ClaimSize.split`): given back at once, for any worker to claim. Returns the
        jobs held."""
        if not claimed:
            return claimed
        idle = self.concurrency - self.held.busy - self._work.qsize()
        claimed, back = self.sizing.split(claimed, idle=max(idle, 0))
        if back:
            claimed += self._give_back(back)
        now = time.monotonic()
        for job in claimed:  # a renewal due before the housekeeper's pass wakes it
            timeout = registry.get(job.task).timeout if job.task in registry else None
            seconds = timeout.total_seconds() if timeout else None
            self.held.add(job, now=now, timeout=seconds)
        self.stats.claimed += len(claimed)
        for job in claimed:  # both on the database's clock
            if job.started_at is not None and job.run_at is not None:
                self.meter.picked_up(job.queue_name, (job.started_at - job.run_at).total_seconds())
        for job in claimed:
            logger.debug("job claimed id=%s task=%s attempt=%d", job.id, job.task, job.attempts)
            self._work.put(job)
        return claimed

    def _unhoard(self) -> float:
        """Every thread busy, and jobs waiting in the buffer: if each thread has been in
        its job longer than the prefetch window, the buffer's jobs would wait longer than
        the claim expected (a known-short task whose jobs turned slow: what a task took
        before said nothing of these arguments), so they are given back for any worker
        to claim, and no more is claimed ahead until the jobs are short again. Returns
        how long the dispatcher waits before it looks again."""
        if not self._work.qsize() or self.sizing.fixed is not None:
            return 1.0
        window = self.sizing.WINDOW_SECONDS
        shortest = self.held.shortest_run(time.monotonic())
        if self.held.busy < self.concurrency or shortest is None or shortest < window:
            return window
        waiting = self.held.unstarted(self._work.drain())
        kept = self._give_back([flight.job for flight in waiting])
        self.sizing.cautious = True
        if kept:  # not given back (a cancel requested, the database's error): run here
            self._hand_over(kept)
        logger.debug("buffered jobs given back count=%d", len(waiting) - len(kept))
        return 1.0

    def _give_back(self, jobs: list[Job]) -> list[Job]:
        """Release claimed jobs no thread will start soon (fenced, no attempt spent).
        Returns those the release did not take (a cancel requested meanwhile, or the
        database's error): they are held and run as claimed."""
        pairs = [(job.id, job.attempts) for job in jobs]
        try:
            given = Job.objects.db_manager(self.database).release_many(pairs)
        except DatabaseError as error:
            logger.debug("claimed jobs not given back: %s; they run here", error)
            return jobs
        logger.debug(
            "claimed jobs given back count=%d: their tasks' run times are not known to be "
            "short, and every thread is taken",
            len(given),
        )
        return [job for job in jobs if job.id not in given]

    def _idle_timeout(self) -> float:
        """Until the next scheduled job is due, at most the (jittered) poll interval.

        A limit that held jobs back sets the wait instead (`_held_back`); a paused queue
        caps it at the flow view's refresh, so that a resume is seen by polling too.
        """
        timeout = self.poll_interval * random.uniform(0.9, 1.1)
        fast, limited = self.flow.plan()
        if len(fast) + len(limited) < len(self.queues):
            timeout = min(timeout, REFRESH_SECONDS)
        if self._held_back is not None:
            return min(timeout, max(self._held_back, 0.005))
        if not fast + limited:
            return timeout
        try:
            with connections[self.database].cursor() as cursor:
                next_due = sql.seconds_until_next_due(cursor, fast + limited)
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
        me = threading.current_thread()
        try:
            refreshed = -HEALTH_CHECK_SECONDS  # when this thread last refreshed them
            while (job := self._work.get()) is not None:
                now = time.monotonic()
                waited = self.held.start(job, me, now=now)
                self._nudge()  # room in the buffer
                execution: Execution | None = None
                raised = True
                if now - refreshed >= HEALTH_CHECK_SECONDS:
                    # After a wait: what time changes (CONN_MAX_AGE, the health check's
                    # ping) is looked at again. Right after the last job's refresh below
                    # nothing else can have changed (5 us a job saved, at full speed).
                    refresh_connections()
                if waited >= BUFFERED_CANCEL_CHECK_SECONDS:
                    self._check_cancelled_while_buffered(job)
                try:
                    execution = execute(
                        job,
                        database=self.database,
                        defer_ack=self._defer_ack,
                        cancel=self.held.cancel_event(job.id),
                        depths=OUTSIDE_ATOMIC,  # this loop never enters atomic()
                    )
                    raised = False
                except Exception:
                    logger.exception("worker could not record job id=%s", job.id)
                finally:
                    if execution is not None or raised:
                        # The outcome was written here, and its signal's receivers ran
                        # here: nothing they left open (an atomic() block, a raw or
                        # autocommit-off transaction) may hold the next job's writes. A
                        # deferred success signals on the dispatcher's thread instead.
                        for left in end_open_transactions(OUTSIDE_ATOMIC):
                            logger.error("worker rolled back %s, left by a signal receiver", left)
                    refresh_connections()
                    refreshed = time.monotonic()
                    self.held.stop_running(me)
                    if execution is not None or raised:  # else the dispatcher acks it
                        self._finished(job, execution)
        finally:
            connections.close_all()

    def _check_cancelled_while_buffered(self, job: Job) -> None:
        """A job that waited in the buffer may have been cancelled meanwhile (the cancel
        only asked, as it was running already): if so its flag is set now, and the
        executor ends it cancelled without calling the task. One read by primary key,
        only for jobs that waited at least BUFFERED_CANCEL_CHECK_SECONDS."""
        flag = self.held.cancel_event(job.id)
        if flag is None or flag.is_set():
            return
        jobs = Job.objects.db_manager(self.database)
        try:
            if jobs.cancel_requested(job.id, job.attempts):
                flag.set()
        except DatabaseError as error:  # the task's own run will meet the same database
            logger.debug("cancel check failed id=%s: %r", job.id, error)

    def _finished(self, job: Job, execution: Execution | None) -> None:
        self.held.finish(job.id, job.attempts)
        self.stats.finished += 1
        if execution is not None:
            self.sizing.observe(execution.duration, job.task)
            key = execution.outcome.value
            self.stats.outcomes[key] = self.stats.outcomes.get(key, 0) + 1
            self.meter.finished(
                job.queue_name,
                job.task,
                execution.outcome,
                execution.duration,
                execution.error,
                job.id,
            )
        if job.concurrency_key is not None or job.queue_name in self.flow.limits:
            # Its slot is free: a keyed job its key held back may be claimed now, not
            # only after the housekeeper's next probe (up to KEYED_PROBE_SECONDS).
            self.flow.note_keyed(True)
        self._nudge()


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
