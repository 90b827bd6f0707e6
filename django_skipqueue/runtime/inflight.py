"""The jobs a worker process holds, from claim to outcome: the one owner of that state.

A held job is buffered (claimed, waiting for a thread), running (a thread has it), or
acking (it succeeded; its fenced ack waits for the dispatcher's next batch). A running
job may be past its hard time limit (`past_limit`): it stays held and renewed until its
code stops or the process ends (runtime/timelimits.py). Four kinds of thread
read and change this: the dispatcher (claims, acks), the executors (start, finish), the
housekeeper (renewals, timeouts) and the shutdown. Every method takes the one lock; no
caller touches the collections, and no method does I/O or calls user code.

The process clock is passed in (`now`): it only schedules renewals and timeouts; every
decision on a lease is the database's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django_skipqueue.core.cancel import CancelFlag

if TYPE_CHECKING:
    from django_skipqueue.models import Job

NEVER = float("inf")
#: What `InFlight.past_limit` found: first past its limit, then still running after the
#: grace it was given.
PAST, STUCK = "past", "stuck"

#: One attempt of a job: (job id, attempt number).
Attempt = tuple[int, int]


@dataclass
class Flight:
    """A claimed job while this process holds it."""

    job: Job
    attempt: int
    lease_seconds: float
    renew_at: float  # process clock: when to renew next
    timeout: float | None = None  # the task's hard time limit in seconds, from its start
    #: Process clock: when the housekeeper looks at it next for its time limit (its
    #: limit, then the end of the grace it is given past it; NEVER once decided).
    timeout_at: float = NEVER
    #: Set when a renewal found that an operator asked the job to stop (the task sees
    #: it as `TaskContext.cancel_requested`).
    cancel: CancelFlag = field(default_factory=CancelFlag)
    claimed_at: float = 0.0  # process clock: when it was claimed (it waits in the buffer)
    started_at: float = 0.0  # process clock: when a thread took it from the buffer
    progress_written_at: float = -NEVER  # process clock: its progress's last write


@dataclass
class Finished:
    """A success waiting for the dispatcher's batched, fenced ack."""

    job: Job
    attempt: int
    result: Any
    duration: float


class InFlight:
    """The held jobs and their states. Safe to call from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[int, Flight] = {}  # every held job, by id
        self._acking: set[int] = set()  # succeeded, ack not yet answered
        self._finished: list[Finished] = []  # the same, for the next ack batch
        self._running: dict[threading.Thread, Attempt] = {}  # executor thread -> its job
        self.busy = 0  # executor threads inside a job
        #: When the housekeeper's next pass is planned (`plan_pass`), and the event that
        #: wakes it: a job started with a time limit that falls before that pass wakes it.
        self._next_pass_at = NEVER
        self._wake_housekeeper: threading.Event | None = None

    # -- reads -----------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._flights)

    def held(self) -> int:
        """Jobs buffered or running (not those whose success waits for its ack)."""
        with self._lock:
            return len(self._flights) - len(self._acking)

    # -- the housekeeper -------------------------------------------------------------

    def wakes(self, event: threading.Event) -> None:
        """The housekeeper's wake-up: set when a job is claimed whose first renewal, or
        starts whose time limit, falls before the housekeeper's planned pass."""
        self._wake_housekeeper = event

    def sleeps_until(self, at: float) -> None:
        """The housekeeper sleeps until `at` whatever falls due before (its back-off after
        a failed pass, which planned nothing): what `add` and `start` compare with."""
        with self._lock:
            self._next_pass_at = at

    def _due_before_the_pass(self, at: float) -> None:
        """A renewal or a time limit falls at `at` (the lock held): if that is before the
        housekeeper's planned pass, wake it to plan again (else it is acted on up to
        MAX_WAIT late). Otherwise it is left asleep: waking it takes the GIL just as a
        job begins."""
        if at < self._next_pass_at:
            self._next_pass_at = at
            if self._wake_housekeeper is not None:
                self._wake_housekeeper.set()

    def plan_pass(self, *others: float) -> float:
        """When the housekeeper's next pass is due: the next renewal, the next time limit
        of a running job, or the soonest of `others` (its own schedule). Recorded under
        the lock that `start` takes, so that a job started after this is compared with
        it, and one started before it is in it."""
        with self._lock:
            soonest = min(others, default=NEVER)
            for job_id, flight in self._flights.items():
                soonest = min(soonest, flight.renew_at)
                if job_id not in self._acking:  # a success waiting for its ack: not timed
                    soonest = min(soonest, flight.timeout_at)  # out (see timed_out)
            self._next_pass_at = soonest
            return soonest

    # -- the dispatcher --------------------------------------------------------------

    def add(self, job: Job, *, now: float, timeout: float | None) -> Flight:
        """A job just claimed: its first renewal is due after a third of its lease."""
        lease = job.lease.total_seconds()
        flight = Flight(job, job.attempts, lease, now + lease / 3, timeout, claimed_at=now)
        with self._lock:
            self._flights[job.id] = flight
            self._due_before_the_pass(flight.renew_at)
        return flight

    def take_acks(self) -> list[Finished]:
        """The successes to acknowledge now (they stay held until `acked`)."""
        with self._lock:
            batch, self._finished = self._finished, []
        return batch

    def acked(self, job_id: int) -> None:
        """Its ack was answered (accepted or not): no longer waiting for one."""
        with self._lock:
            self._acking.discard(job_id)

    # -- executor threads ------------------------------------------------------------

    def start(self, job: Job, thread: threading.Thread, *, now: float) -> float:
        """A thread takes `job` from the buffer: its timeout counts from now. Returns the
        seconds it waited in the buffer since its claim."""
        with self._lock:
            self.busy += 1
            self._running[thread] = (job.id, job.attempts)
            flight = self._flights.get(job.id)
            if flight is None:
                return 0.0
            flight.started_at = now
            if flight.timeout is not None:
                flight.timeout_at = now + flight.timeout
                self._due_before_the_pass(flight.timeout_at)
            return now - flight.claimed_at

    def stop_running(self, thread: threading.Thread) -> None:
        """The thread is out of its job (whatever the outcome)."""
        with self._lock:
            self.busy -= 1
            self._running.pop(thread, None)

    def queue_ack(self, finished: Finished) -> None:
        """A success: its ack waits for the dispatcher's next batch."""
        with self._lock:
            self._finished.append(finished)
            self._acking.add(finished.job.id)

    def finish(self, job_id: int, attempt: int) -> None:
        """The attempt's outcome is in: no longer held."""
        with self._lock:
            self._drop(job_id, attempt)

    def _drop(self, job_id: int, attempt: int) -> None:
        """No longer hold the job, if the flight held is this attempt's (the lock held)."""
        flight = self._flights.get(job_id)
        if flight is not None and flight.attempt == attempt:
            del self._flights[job_id]

    def thread_died(self, thread: threading.Thread) -> int | None:
        """A thread died: the job it ran (if any) is no longer held, so it is no longer
        renewed and the reaper takes it back. Returns that job's id."""
        with self._lock:
            running = self._running.pop(thread, None)
            if running is None:
                return None
            self._drop(*running)
            self.busy -= 1
            return running[0]

    # -- the housekeeper -------------------------------------------------------------

    def due_renewals(self, now: float) -> list[Flight]:
        """Held jobs whose lease is due for renewal. A job past its time limit is renewed
        too: its slot and its row stay this attempt's until its outcome is written."""
        with self._lock:
            return [flight for flight in self._flights.values() if flight.renew_at <= now]

    def renewed(self, flight: Flight, *, now: float) -> None:
        with self._lock:
            flight.renew_at = now + flight.lease_seconds / 3

    def renew_soon(self, flight: Flight, *, at: float) -> None:
        """A renewal that could not be made now (its row locked elsewhere): again at `at`."""
        with self._lock:
            flight.renew_at = at
            self._due_before_the_pass(at)

    def cancel_requested(self, flight: Flight, *, keep_renewing_at: float | None = None) -> None:
        """A renewal found a cancel request: tell the task, and renew no more (a task
        that ignores it loses the job when this lease ends); or, for a job holding a
        concurrency slot (`keep_renewing_at`, the process clock now: the renewal went
        through), go on renewing until its thread ends."""
        with self._lock:
            if keep_renewing_at is None:
                flight.renew_at = NEVER
            else:
                flight.renew_at = keep_renewing_at + flight.lease_seconds / 3
        flight.cancel.set()

    def started(self, flight: Flight) -> bool:
        """Whether an executor thread has started this attempt (else it is buffered)."""
        with self._lock:
            return (flight.job.id, flight.attempt) in self._running.values()

    def cancel_event(self, job_id: int) -> CancelFlag | None:
        """The cancel flag of a held job, for its TaskContext (None if not held)."""
        with self._lock:
            flight = self._flights.get(job_id)
            return flight.cancel if flight is not None else None

    def progress_due(self, now: float, every: float) -> list[tuple[Flight, dict[str, Any]]]:
        """Held jobs whose task reported progress not yet written, and last written
        `every` seconds ago or more: each report is taken (the next one waits for the
        next pass)."""
        due = []
        with self._lock:
            for flight in self._flights.values():
                report = flight.cancel.progress
                if report is not None and now - flight.progress_written_at >= every:
                    flight.cancel.progress = None
                    flight.progress_written_at = now
                    due.append((flight, report))
        return due

    def renewal_refused(self, flight: Flight) -> bool:
        """The fence refused a renewal: never renew it again. False if the attempt is no
        longer held, or waits for its ack's answer: the renewal raced its outcome (an
        ack that committed first refuses it), which is not a lost lease."""
        with self._lock:
            flight.renew_at = NEVER
            return self._flights.get(flight.job.id) is flight and (
                flight.job.id not in self._acking
            )

    def timed_out(self, now: float) -> list[Flight]:
        """Running jobs due a look for their time limit (`past_limit`), not those whose
        success waits for its ack."""
        with self._lock:
            return [
                flight
                for flight in self._flights.values()
                if flight.timeout_at <= now and flight.job.id not in self._acking
            ]

    def past_limit(self, flight: Flight, *, now: float, grace: float) -> str | None:
        """The housekeeper found `flight` due (`timed_out`). The first time, it is past its
        hard limit: its flag says so (the task's next `check_cancelled()` raises
        TimeLimitExceeded) and it is looked at again `grace` seconds later: PAST. The
        second time its code has not stopped: STUCK, and never looked at again. None if
        the attempt is no longer held (it finished just now) or waits for its ack."""
        with self._lock:
            if self._flights.get(flight.job.id) is not flight or flight.job.id in self._acking:
                return None
            if flight.cancel.exceeded is None:
                flight.cancel.exceeded = flight.timeout or 0.0
                flight.timeout_at = now + grace
                self._due_before_the_pass(flight.timeout_at)
                return PAST
            flight.timeout_at = NEVER
            return STUCK

    def thread_of(self, job_id: int, attempt: int) -> threading.Thread | None:
        """The executor thread running this attempt of `job_id`, if one is."""
        with self._lock:
            for thread, running in self._running.items():
                if running == (job_id, attempt):
                    return thread
            return None

    def shortest_run(self, now: float) -> float | None:
        """How long the job that started last has run, of those threads are inside now
        (None if no thread is inside one)."""
        with self._lock:
            started = [
                flight.started_at
                for job_id, attempt in self._running.values()
                if (flight := self._flights.get(job_id)) is not None and flight.attempt == attempt
            ]
        return now - max(started) if started else None

    def holds(self, flight: Flight) -> bool:
        """Whether `flight` is still held (its attempt not finished)."""
        with self._lock:
            return self._flights.get(flight.job.id) is flight

    def running_threads(self) -> list[threading.Thread]:
        """The executor threads inside a job now."""
        with self._lock:
            return list(self._running)

    def past_their_limit(self) -> list[Flight]:
        """The held attempts past their hard time limit whose code has not stopped."""
        with self._lock:
            return [f for f in self._flights.values() if f.cancel.exceeded is not None]

    # -- shutdown --------------------------------------------------------------------

    def unstarted(self, job_ids: Iterable[int]) -> list[Flight]:
        """Jobs taken back out of the buffer, never started: no longer held."""
        with self._lock:
            return [
                flight
                for job_id in job_ids
                if (flight := self._flights.pop(job_id, None)) is not None
            ]

    def remaining(self) -> list[Flight]:
        with self._lock:
            return list(self._flights.values())

    def running_ids(self) -> set[int]:
        """The jobs a thread is inside now (whose code may still run)."""
        with self._lock:
            return {job_id for job_id, _ in self._running.values()}


class Buffer:
    """Claimed jobs on their way from the dispatcher to the executor threads (FIFO).

    `close(n)` ends n threads: each `get()` then returns None once the jobs before it
    are taken. `drain()` takes back the jobs no thread has started.
    """

    def __init__(self) -> None:
        # SimpleQueue (C): a put and a get cost 0.07 us against queue.Queue's 1.7 us
        # (its Condition's notify was 4 % of a worker's CPU at concurrency 4, py-spy).
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()

    def put(self, job: Job) -> None:
        self._queue.put(job)

    def get(self) -> Job | None:
        """The next job, waiting for one; None: this thread should end."""
        return self._queue.get()

    def qsize(self) -> int:
        return self._queue.qsize()

    def drain(self) -> list[int]:
        """The ids of the jobs still waiting, taken out (up to an end marker)."""
        taken = []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                break
            taken.append(job.id)
        return taken

    def close(self, threads: int) -> None:
        for _ in range(threads):
            self._queue.put(None)


class ClaimSize:
    """How many jobs a worker claims at a time: free threads plus a prefetch buffer.

    The prefetch is fixed if PREFETCH (or --prefetch) says so. Otherwise it is enough to
    keep every thread busy for about WINDOW_SECONDS at the jobs' mean run time, at most
    PER_THREAD_MAX per thread and MAX in all: many for jobs of milliseconds (claims and
    acks then come in large batches), none for jobs of a second or more (they stay in
    the table, where an idle worker elsewhere can take them), and none until the first
    jobs have run.

    The caps bind only for jobs shorter than a few milliseconds, where the window alone
    would hold thousands. At 16 a thread, `--processes 2 --concurrency 4` on 2 cores
    claimed and acknowledged 68 no-op jobs a statement, and the machine stood idle 17-18 %
    of a drain: each process waited for its ack's and its claim's commits while its
    threads had nothing left to run. At 64 a thread, 20,900 jobs a second against
    16,800-18,600, and 82 us of the machine's CPU a job against 87-96 (`--prefetch 256`
    for the same jobs, medians of three and five alternated drains of 100,000, as
    `python benchmarks/run.py --parts throughput --jobs 100000` runs them). 512 gained
    nothing more.
    """

    WINDOW_SECONDS = 0.05
    PER_THREAD_MAX = 64
    MAX = 1024

    def __init__(self, *, concurrency: int, fixed: int | None) -> None:
        if fixed is not None and fixed < 0:
            raise ValueError(f"prefetch must be zero or more, got {fixed}")
        self.concurrency = concurrency
        self.fixed = fixed
        self.mean_duration: float | None = None  # moving average of jobs' run time
        #: The same per task: what `split` knows of a claimed job.
        self.task_means: dict[str, float] = {}
        #: A claim held jobs it could not start soon (`split` gave them back): no
        #: prefetch until a claim's jobs are all of tasks known to be short again.
        self.cautious = False

    def observe(self, seconds: float, task: str | None = None) -> None:
        mean = self.mean_duration
        self.mean_duration = seconds if mean is None else 0.9 * mean + 0.1 * seconds
        if task is not None:
            known = self.task_means.get(task)
            self.task_means[task] = seconds if known is None else 0.9 * known + 0.1 * seconds

    def prefetch(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.mean_duration is None or self.cautious:
            return 0
        ahead = self.concurrency * self.WINDOW_SECONDS / max(self.mean_duration, 1e-6)
        return int(min(ahead, self.concurrency * self.PER_THREAD_MAX, self.MAX))

    def split(self, jobs: list[Job], *, idle: int) -> tuple[list[Job], list[Job]]:
        """The claimed `jobs` (in claim order) to run, and those to give back at once.

        The first `idle` go to the idle threads. Behind them, a job may wait in the
        buffer only if its task is known to take at most WINDOW_SECONDS and the known
        run times of the buffered jobs ahead of it keep its wait within the window: the
        claim's size came from the worker's mean over every task, and a change of mix
        (5,000 no-op jobs, then 100 of a second) was claimed at the old size, one
        worker of two taking 96 of the 100. A fixed prefetch (`--prefetch`) is kept as
        asked."""
        if self.fixed is not None:
            return jobs, []
        means, window = self.task_means, self.WINDOW_SECONDS
        short = all(means.get(job.task, window + 1) <= window for job in jobs)
        if len(jobs) <= idle:
            self.cautious = self.cautious and not short
            return jobs, []
        keep, back, wait = jobs[:idle], [], 0.0
        for job in jobs[idle:]:
            mean = means.get(job.task)
            if mean is None or mean > window or wait > window:
                back.append(job)
            else:
                keep.append(job)
                wait += mean / self.concurrency
        self.cautious = bool(back) or (self.cautious and not short)
        return keep, back

    def free(self, *, held: int, idle_thread: bool) -> int:
        """Jobs to claim now, with `held` buffered or running. Claims wait until half the
        room is free (so that they come in batches) unless a thread is idle; 0 means do
        not claim yet."""
        capacity = self.concurrency + self.prefetch()
        free = capacity - held
        if free <= 0 or (not idle_thread and free < max(1, capacity // 2)):
            return 0
        return free
