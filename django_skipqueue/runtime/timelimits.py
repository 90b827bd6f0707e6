"""What a worker does with a job that runs past its hard time limit (`time_limit`).

Python cannot stop a thread, and this package never raises an exception into one: raised
from outside, it lands wherever the thread is, inside a logging handler's lock or a
database driver's, say, and leaves that lock held for ever (every thread that logged
then froze, the housekeeper too). The unit that ends work that will not stop is the
process, as in Celery's prefork pool:

1. At the limit (the housekeeper's pass is planned for it), the attempt is marked past
   it (`InFlight.past_limit`): the task's next `context.check_cancelled()` raises
   TimeLimitExceeded, and whatever the task returns from then on, the attempt ends with
   TimeLimitExceeded. Its lease is still renewed: the job, and any concurrency slot it
   holds, stay this attempt's.
2. GRACE_SECONDS later, if its code still runs, the worker stops: it claims no more, its
   other jobs get the stop's grace period, the jobs it has not started are released.
3. Last before the process ends (`fail_stuck`), the stuck attempt's outcome is written
   through the fence: failed with TimeLimitExceeded (retried only where its retry
   policy says `retry_time_limits`), which frees its slot. The process then exits with
   EXIT_TIME_LIMIT, for its supervisor, or the `--processes` pool, to start a new one.

A threaded worker restarts whole for one stuck task; under `--processes` one child does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from django.db import DatabaseError

from django_skipqueue.exceptions import TimeLimitExceeded
from django_skipqueue.models import Job
from django_skipqueue.queue.connections import bounded
from django_skipqueue.runtime.executor import Execution, record_failure
from django_skipqueue.runtime.inflight import PAST, STUCK, Flight, InFlight
from django_skipqueue.runtime.runner import decide_failure
from django_skipqueue.tasks.registry import registry

if TYPE_CHECKING:
    from django_skipqueue.runtime.progress import WorkerStats

logger = logging.getLogger(__name__)

#: How long past its hard limit a task's code may go on before its worker stops: time to
#: reach its next `check_cancelled()`, or to return.
GRACE_SECONDS = 1.0
#: How long the stuck attempt's failure waits for a lock on its row: the task's own
#: transaction may hold it for as long as its code runs (a SELECT ... FOR UPDATE of its
#: job); past that the job is left to the reaper, after its lease.
LOCK_SECONDS = 1.0
#: The exit code of a worker that stopped for a task past its time limit: not 0, so that
#: a supervisor (systemd, Kubernetes) or the `--processes` pool starts a new process.
EXIT_TIME_LIMIT = 3


class HardLimits:
    """The time-limit decisions of one worker: `look` from the housekeeper, `fail_stuck`
    from its shutdown. `stop` is the worker's graceful stop, given a reason."""

    def __init__(
        self,
        *,
        held: InFlight,
        stats: WorkerStats,
        database: str,
        stop: Callable[[str], None],
        grace: float = GRACE_SECONDS,
    ) -> None:
        self.held = held
        self.stats = stats
        self.database = database
        self.stop = stop
        self.grace = grace
        #: A task past its limit did not stop: the worker exits with EXIT_TIME_LIMIT.
        self.stuck_exit = False

    def look(self, flight: Flight, *, now: float) -> None:
        """The housekeeper found `flight` due (`InFlight.timed_out`): mark it past its
        limit, or, at the end of its grace, stop the worker if its code still runs."""
        found = self.held.past_limit(flight, now=now, grace=self.grace)
        job, limit = flight.job, flight.timeout or 0.0
        if found == PAST:
            self.stats.timed_out += 1
            logger.warning(
                "job timed out id=%s task=%s attempt=%d limit=%gs: it ends with "
                "TimeLimitExceeded; the worker exits if its code still runs in %gs",
                job.id,
                job.task,
                flight.attempt,
                limit,
                self.grace,
            )
        elif found == STUCK:
            self.stuck_exit = True
            logger.error(
                "job past its time limit id=%s task=%s attempt=%d limit=%gs did not stop: "
                "this worker stops, fails the attempt and exits with code %d for a new "
                "process",
                job.id,
                job.task,
                flight.attempt,
                limit,
                EXIT_TIME_LIMIT,
            )
            self.stop(f"job {job.id} past its time limit of {limit:g}s did not stop")

    def keep_leases(self, margin: float) -> None:
        """Before a stopping worker's threads end (its housekeeper's renewals with them):
        the lease of each attempt past its limit, once more, a lease and `margin` from
        now, so that it outlives the rest of the stop and the failure is written while
        the attempt still owns the job (a 0.25 s lease ran out first, and the reaper
        gave the job, and its concurrency slot, to another worker while the code ran)."""
        jobs = Job.objects.db_manager(self.database)
        for flight in self.held.past_their_limit():
            lease = timedelta(seconds=flight.lease_seconds + margin)
            try:
                with bounded(self.database, LOCK_SECONDS):  # its own code may lock its row
                    jobs.renewal(flight.job.id, flight.attempt, lease, keep_if_cancelled=True)
            except DatabaseError as error:
                logger.warning("job lease not extended id=%s: %s", flight.job.id, error)

    def fail_stuck(self) -> list[tuple[Job, Execution]]:
        """The attempts still past their limit, failed through the fence with
        TimeLimitExceeded (logged and signalled as any failed attempt): the last write
        of a stopping worker before its process ends, so that a concurrency slot is
        free only from then, milliseconds before the code that held it stops with the
        process. Returns what was written."""
        written = []
        jobs = Job.objects.db_manager(self.database)
        for flight in self.held.past_their_limit():
            job = flight.job
            task = registry.get(job.task) if job.task in registry else None
            exceeded = TimeLimitExceeded(flight.cancel.exceeded or 0.0)
            ran = time.monotonic() - flight.started_at
            decision = decide_failure(task, exceeded, flight.attempt, ran)
            if not self.held.holds(flight):  # its code ended meanwhile: written by its thread
                continue
            try:
                execution = record_failure(
                    jobs, job, flight.attempt, decision, self.database, lock_seconds=LOCK_SECONDS
                )
            except DatabaseError as error:
                logger.error("job outcome not written id=%s: %s; left to the reaper", job.id, error)
                continue
            written.append((job, execution))
        return written


__all__ = ["EXIT_TIME_LIMIT", "GRACE_SECONDS", "HardLimits"]
