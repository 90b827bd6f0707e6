"""Run one claimed job: look it up, call it, then ack, fail or release through the fence.

The worker loops over this; tests and `run_jobs()` call it directly. It never raises
for anything the task does: every outcome is written (or refused by the fence) and
returned. Only registered tasks run (see registry.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from django.db import DatabaseError, connections
from django.dispatch import Signal

from django_skipqueue import signals
from django_skipqueue.conf import get_settings
from django_skipqueue.core import tracing
from django_skipqueue.core.cancel import CancelFlag
from django_skipqueue.core.redaction import redact_text
from django_skipqueue.exceptions import (
    Retry,
    UnknownTaskError,
)
from django_skipqueue.faults import is_transient
from django_skipqueue.models import Job, JobState
from django_skipqueue.queue.base import ErrorInfo
from django_skipqueue.queue.connections import bounded, discard, discard_connection
from django_skipqueue.tasks.registry import registry

if TYPE_CHECKING:
    from django_skipqueue.queue.managers import JobManager

from django_skipqueue.runtime.runner import (  # noqa: F401  (this module's face too)
    OUTSIDE_ATOMIC,
    Decision,
    Outcome,
    decide_failure,
    describe_error,
    end_open_transactions,
    run_and_decide,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Answer(Generic[T]):
    """What became of a fenced write: its value if the database answered.

    `unknown` means no answer came within a lease (the connection kept failing): the
    write may or may not have happened, and the reaper will take the job back if it
    did not. Not the same as a refusal by the fence, which is an answer.
    """

    value: T | None = None
    unknown: bool = False


@dataclass(frozen=True)
class Execution:
    """What one call of `execute` did."""

    job_id: int
    attempt: int
    outcome: Outcome
    duration: float
    error: ErrorInfo | None = None


#: A success whose ack is deferred: (job, attempt, result, duration in seconds).
Success = tuple["Job", int, Any, float]
#: Takes over a success's fenced ack; `acknowledge()` must record it later.
DeferredAck = Callable[["Job", int, Any, float], None]


@overload
def execute(
    job: Job,
    *,
    database: str | None = None,
    defer_ack: None = None,
    cancel: CancelFlag | None = None,
    depths: Mapping[str, int] | None = None,
) -> Execution: ...


@overload
def execute(
    job: Job,
    *,
    database: str | None = None,
    defer_ack: DeferredAck,
    cancel: CancelFlag | None = None,
    depths: Mapping[str, int] | None = None,
) -> Execution | None: ...


def execute(
    job: Job,
    *,
    database: str | None = None,
    defer_ack: DeferredAck | None = None,
    cancel: CancelFlag | None = None,
    depths: Mapping[str, int] | None = None,
) -> Execution | None:
    """Run `job`, a row just returned by `Job.objects.claim()`, and record its outcome.

    With `defer_ack`, a success is handed to it instead of being acknowledged here (the
    worker acknowledges the jobs that finished meanwhile in one fenced statement), and
    None is returned: the outcome is known once the ack is. `cancel` is the worker's
    flag of a cancel request for this job (the task's `context.cancel_requested`).
    `depths`: see `run_and_decide` (a worker's executor threads pass OUTSIDE_ATOMIC).
    """
    database = database or get_settings().DATABASE_ALIAS
    jobs = _job_manager(database)
    attempt = job.attempts
    if cancel is None:  # outside a worker: the flag still carries the task's progress
        cancel = CancelFlag()
    span = tracing.start_run(job)  # None without OpenTelemetry
    decision = run_and_decide(job, database=database, cancel=cancel, depths=depths)
    if span is not None:
        tracing.end_run(
            span, _span_outcome(job, decision), decision.error if decision.failed else None
        )
    if cancel.progress is not None:  # the last report, not yet written: before the outcome
        _write_progress(jobs, job, attempt, cancel)
    duration = decision.duration
    if decision.outcome is Outcome.RELEASED:
        delay = decision.retry_in or timedelta(0)
        park = getattr(decision.raised, "park", None)  # a durable sleep's or wait's
        released = _persist(
            lambda: jobs.release(job.id, attempt, delay=delay, park=park), job, database
        )
        if released.unknown:
            return _unknown(job, attempt, duration)
        if not released.value:
            return _lost(job, attempt, duration)
        logger.debug(
            "job released id=%s task=%s attempt=%d delay=%.3fs reason=%s",
            job.id,
            job.task,
            attempt,
            delay.total_seconds(),
            decision.raised,
        )
        _announce(signals.job_released, job=job, delay=delay)
        return Execution(job.id, attempt, Outcome.RELEASED, duration)
    if decision.outcome is Outcome.CANCELLED:
        in_workflow = job.workflow_id is not None
        ended = _persist(
            lambda: jobs.end_cancelled(job.id, attempt, workflow=in_workflow), job, database
        )
        if ended.unknown:
            return _unknown(job, attempt, duration)
        if not ended.value:
            return _lost(job, attempt, duration)
        logger.info("job cancelled id=%s task=%s attempt=%d", job.id, job.task, attempt)
        return Execution(job.id, attempt, Outcome.CANCELLED, duration)
    if decision.failed:
        execution = record_failure(jobs, job, attempt, decision, database)
        if (
            isinstance(decision.raised, KeyboardInterrupt)
            and threading.current_thread() is threading.main_thread()
        ):
            raise decision.raised
        return execution

    result = decision.result
    if defer_ack is not None:
        defer_ack(job, attempt, result, duration)
        return None
    try:
        acked = _persist(lambda: jobs.ack(job.id, attempt, result), job, database)
    except DatabaseError as refused:  # not the connection: this row's ack itself fails
        return record_ack_error(job, attempt, refused, duration, database)
    if not acked.unknown and not acked.value:  # a retried ack may have committed before
        found = _persist(lambda: committed_before(jobs, [(job.id, attempt)]), job, database)
        acked = Answer(job.id in (found.value or ()), unknown=found.unknown)
    return record_success(
        job, attempt, result, duration, acked=None if acked.unknown else bool(acked.value)
    )


def _span_outcome(job: Job, decision: Decision) -> str:
    """The attempt's outcome as its span says it (the metrics' labels): a failure with
    no attempt left is `failed`, whatever the retry policy offered."""
    outcome = decision.outcome
    if outcome is Outcome.RETRYING and job.attempts >= job.max_attempts:
        outcome = Outcome.FAILED
    return outcome.value


_MANAGERS: dict[str, JobManager] = {}


def _job_manager(database: str) -> JobManager:
    """Job.objects on `database`, kept per alias: a manager holds no state, and making one
    (db_manager copies it) cost 2.5 us a job."""
    manager = _MANAGERS.get(database)
    if manager is None:
        manager = _MANAGERS[database] = Job.objects.db_manager(database)
    return manager


def _write_progress(jobs: JobManager, job: Job, attempt: int, cancel: CancelFlag) -> None:
    """The task's last progress report, written when its attempt ends (through the
    fence: nothing if the attempt lost the job). A failed write is logged: progress
    never decides an outcome."""
    report, cancel.progress = cancel.progress, None
    if report is None:
        return
    try:
        jobs.report_progress(job.id, attempt, report)
    except DatabaseError as error:
        logger.warning("job progress not written id=%s: %s", job.id, error)


def acknowledge(successes: Sequence[Success], database: str) -> list[Execution | None]:
    """Acknowledge successes in one fenced statement, then log and signal each outcome.

    Each job keeps its own fence (id, attempt, unexpired lease). A passing error is
    retried until answered (or a lease has passed: the outcome is then unknown), and an
    ack refused after a retry is checked for having committed the first time. A row
    whose own ack the database refuses fails that job with the error. Returns each
    success's Execution, in order (None where recording it failed, which is logged).
    """
    jobs = _job_manager(database)
    acks = [(job.id, attempt, result) for job, attempt, result, _ in successes]
    workflows = any(job.workflow_id is not None for job, _, _, _ in successes)
    give_up = min(job.lease.total_seconds() for job, _, _, _ in successes)
    what = f"ids={','.join(str(job.id) for job, _, _, _ in successes[:10])}"
    errors: dict[int, DatabaseError] = {}  # rows whose own ack the database refused
    try:
        answer = persist(
            lambda: jobs.ack_many(acks, errors=errors, workflows=workflows),
            give_up_after=give_up,
            what=what,
            database=database,
        )
    except DatabaseError:  # not a passing error, and not one row's: log, leave
        logger.exception("worker could not acknowledge %s; left to the reaper", what)
        answer = Answer(unknown=True)
    unknown, acked = answer.unknown, set(answer.value or ())
    refused = [
        (job.id, attempt)
        for job, attempt, _, _ in successes
        if job.id not in acked and job.id not in errors
    ]
    if refused and not unknown:
        try:
            found = persist(
                lambda: committed_before(jobs, refused),
                give_up_after=give_up,
                what=what,
                database=database,
            )
        except DatabaseError:  # not a passing error: their outcome is unknown
            logger.exception("worker could not check refused acks %s", what)
            found = Answer(unknown=True)
        acked |= found.value or set()
        unknown = found.unknown
    executions: list[Execution | None] = []
    for job, attempt, result, duration in successes:
        try:
            if job.id in errors:
                executions.append(
                    record_ack_error(job, attempt, errors[job.id], duration, database)
                )
            else:
                outcome = True if job.id in acked else (None if unknown else False)
                executions.append(record_success(job, attempt, result, duration, acked=outcome))
        except Exception:
            logger.exception("worker could not record job id=%s", job.id)
            executions.append(None)
    # The success signals' receivers ran on this thread (the dispatcher's, outside any
    # atomic() block): nothing they left open, a block or a raw transaction, may hold
    # the next claims and acks uncommitted (a block left open once wedged the worker).
    for left in end_open_transactions(OUTSIDE_ATOMIC):
        logger.error("worker rolled back %s, left by a signal receiver", left)
    return executions


def release_on_shutdown(attempts: Sequence[tuple[Job, int]], database: str) -> int:
    """Give each attempt back at a graceful stop (fenced): pending again without
    spending an attempt; a job asked to stop ends cancelled instead. Returns how many
    were given back (the cancelled not counted); the others had finished or lost their
    lease, or the database did not answer (then the reaper takes them back).
    """
    jobs = _job_manager(database)
    together: set[int] = set()
    if len(attempts) > 1:  # one statement for them all; the others one by one below
        pairs = [(job.id, attempt) for job, attempt in attempts]
        try:
            try:
                together = jobs.release_many(pairs)
            except DatabaseError as error:
                if not is_transient(error):
                    raise
                # Once more on a new connection: the one it had may have been ended
                # (a restart, pg_terminate_backend) while the server answers again.
                discard_connection(database)
                together = jobs.release_many(pairs)
        except DatabaseError as error:
            if is_transient(error):  # the server is gone: one by one would fail as well
                logger.warning("jobs not released: %s; the reaper will", error)
                return 0
            logger.warning("jobs not released together: %s; trying one by one", error)
    released: list[int] = []
    cancelled: list[int] = []
    for job, attempt in attempts:
        try:
            # Those the batch left: asked to stop (ended cancelled), or lost.
            if job.id in together or jobs.give_back(job.id, attempt):
                released.append(job.id)
                logger.debug(
                    "job released on shutdown id=%s task=%s attempt=%d", job.id, job.task, attempt
                )
            elif jobs.end_cancelled(job.id, attempt, workflow=job.workflow_id is not None):
                cancelled.append(job.id)
        except DatabaseError as error:
            logger.warning("job not released id=%s: %s; the reaper will", job.id, error)
    # One line each, not one a job: a stop with a full prefetch buffer wrote hundreds.
    if released:
        logger.warning(
            "jobs released on shutdown count=%d ids=%s", len(released), shown_ids(released)
        )
    if cancelled:
        logger.warning(
            "jobs cancelled on shutdown (a cancel was requested) count=%d ids=%s",
            len(cancelled),
            shown_ids(cancelled),
        )
    return len(released)


def shown_ids(ids: list[int]) -> str:
    """The first 20 ids of a log line's list (`...` after them if there are more)."""
    return ",".join(map(str, ids[:20])) + (",..." if len(ids) > 20 else "")


def record_ack_error(
    job: Job, attempt: int, error: DatabaseError, duration: float, database: str
) -> Execution:
    """A success whose own ack the database refused (not by the connection): the job
    fails with that error, as if the task had raised it (not retried for a bad row)."""
    task = registry.get(job.task) if job.task in registry else None
    jobs = _job_manager(database)
    decision = decide_failure(task, error, attempt, duration)
    return record_failure(jobs, job, attempt, decision, database)


def committed_before(jobs: JobManager, refused: list[tuple[int, int]]) -> set[int]:
    """Of refused acks, the ids whose ack had committed before its connection died.

    A retried ack is refused when the first try committed but its answer was lost:
    the job is then done with exactly that attempt number.
    """
    done = jobs.filter(id__in=[job_id for job_id, _ in refused], state=JobState.DONE)
    found = set(done.values_list("id", "attempts"))
    return {job_id for job_id, attempt in refused if (job_id, attempt) in found}


def record_success(
    job: Job, attempt: int, result: Any, duration: float, *, acked: bool | None
) -> Execution:
    """Log and signal a success by what its fenced ack became: accepted (True),
    refused by the fence (False), or unknown (None: no answer within a lease)."""
    if acked is None:
        return _unknown(job, attempt, duration)
    if not acked:
        return _lost(job, attempt, duration)
    logger.debug(
        "job succeeded id=%s task=%s attempt=%d duration=%.3fs", job.id, job.task, attempt, duration
    )
    _announce(signals.job_succeeded, job=job, result=result, duration=duration)
    return Execution(job.id, attempt, Outcome.SUCCEEDED, duration)


@dataclass(frozen=True)
class Verdict:
    """What became of a job run from the broker (`run_brokered`): nothing is written."""

    outcome: Outcome  # SUCCEEDED, RETRYING (retry_in set), FAILED or RELEASED
    duration: float
    result: Any = None
    error: ErrorInfo | None = None
    retry_in: timedelta | None = None


def run_brokered(job: Job, *, database: str | None = None) -> Verdict:
    """Run `job`, an unsaved Job made from a RabbitMQ message (a relayed queue), and say
    what became of it; the consumer acts on the verdict in the broker (ack, delayed
    retry, dead letter). The same task call, context, signals and logs as `execute`,
    but no fenced write: the broker's redelivery, not a lease, owns a lost attempt."""
    database = database or get_settings().DATABASE_ALIAS
    attempt = job.attempts
    # The result is not size-checked here: it is never stored unless RESULTS is on.
    span = tracing.start_run(job)  # None without OpenTelemetry
    decision = run_and_decide(
        job, database=database, cancel=CancelFlag(), brokered=True, check_size=False
    )
    if span is not None:
        tracing.end_run(
            span, _span_outcome(job, decision), decision.error if decision.failed else None
        )
    duration = decision.duration
    if decision.outcome is Outcome.RELEASED:
        _announce(signals.job_released, job=job, delay=decision.retry_in)
        return Verdict(Outcome.RELEASED, duration, retry_in=decision.retry_in)
    if decision.failed:
        error = decision.error
        assert error is not None  # noqa: S101  (a failure has its error)
        final = decision.retry_in is None or attempt >= job.max_attempts
        _log_raised(job, attempt, duration, error, final=final)
        if not final:
            retry_in = decision.retry_in
            _announce(signals.job_retried, job=job, error=error, run_after=retry_in)
            return Verdict(Outcome.RETRYING, duration, error=error, retry_in=retry_in)
        logger.warning("job failed id=%s task=%s attempt=%d", job.id, job.task, attempt)
        _announce(signals.job_failed, job=job, error=error, exception=decision.raised)
        return Verdict(Outcome.FAILED, duration, error=error)
    logger.debug(
        "job succeeded id=%s task=%s attempt=%d duration=%.3fs", job.id, job.task, attempt, duration
    )
    _announce(signals.job_succeeded, job=job, result=decision.result, duration=duration)
    return Verdict(Outcome.SUCCEEDED, duration, result=decision.result)


def record_failure(
    jobs: JobManager,
    job: Job,
    attempt: int,
    decision: Decision,
    database: str,
    *,
    lock_seconds: float | None = None,
) -> Execution:
    """Write a failed attempt's `decision` through the fence, then log and signal it.

    With `lock_seconds`, a lock on the row is waited for that long at most, and the
    write is tried for twice that (a stopping worker's write of a task it gives up on,
    whose own transaction may hold the row: timelimits.py); else for up to a lease."""
    error, retry_in, duration = decision.error, decision.retry_in, decision.duration
    assert error is not None  # noqa: S101  (a failure has its error)

    def write() -> JobState | None:
        in_workflow = job.workflow_id is not None
        if lock_seconds is None:
            return jobs.fail(job.id, attempt, error=error, retry_in=retry_in, workflow=in_workflow)
        with bounded(database, lock_seconds):
            return jobs.fail(job.id, attempt, error=error, retry_in=retry_in, workflow=in_workflow)

    give_up = job.lease.total_seconds() if lock_seconds is None else 2 * lock_seconds
    answer = persist(write, give_up_after=give_up, what=f"id={job.id}", database=database)
    if answer.unknown:
        return _unknown(job, attempt, duration, error)
    state = answer.value
    if state is None:
        return _lost(job, attempt, duration, error)
    if isinstance(decision.raised, UnknownTaskError):
        logger.error("job task unknown id=%s task=%s attempt=%d", job.id, job.task, attempt)
    elif isinstance(decision.raised, Retry) and state == JobState.PENDING:
        # A retry the task asked for is its plan, not an error: one INFO line, as
        # Celery's, not an ERROR with a traceback (an error event in Sentry each time).
        logger.info(
            "job retry requested id=%s task=%s attempt=%d in=%.3fs reason=%s",
            job.id,
            job.task,
            attempt,
            retry_in.total_seconds() if retry_in else 0.0,
            error.message,
        )
    else:
        _log_raised(job, attempt, duration, error, final=state == JobState.FAILED)
    if state == JobState.CANCELLED:  # failed after a cancel request: not retried
        logger.info("job cancelled id=%s task=%s attempt=%d", job.id, job.task, attempt)
        return Execution(job.id, attempt, Outcome.CANCELLED, duration, error)
    if state == JobState.PENDING:
        logger.debug(
            "job retried id=%s task=%s attempt=%d in=%.3fs",
            job.id,
            job.task,
            attempt,
            retry_in.total_seconds() if retry_in else 0.0,
        )
        _announce(signals.job_retried, job=job, error=error, run_after=retry_in)
        return Execution(job.id, attempt, Outcome.RETRYING, duration, error)
    logger.warning("job failed id=%s task=%s attempt=%d", job.id, job.task, attempt)
    _announce(signals.job_failed, job=job, error=error, exception=decision.raised)
    return Execution(job.id, attempt, Outcome.FAILED, duration, error)


def _announce(signal: Signal, **kwargs: Any) -> None:
    """Send an outcome signal (its outcome is written already). A receiver that raises
    changes nothing but a log line naming it: before, the worker logged "could not
    record job" for a recorded job, and left the attempt out of its counts. (A
    `job_started` receiver's error fails the attempt instead: runner.py.)"""
    for receiver, answer in signal.send_robust(sender=Job, **kwargs):
        if isinstance(answer, Exception):
            job = kwargs.get("job")
            logger.error(
                "signal receiver raised signal=%s receiver=%s job=%s: %s",
                _SIGNAL_NAMES.get(signal, "?"),
                getattr(receiver, "__qualname__", repr(receiver)),
                getattr(job, "id", "-"),
                redact_text(f"{type(answer).__name__}: {answer}"),
                exc_info=answer,
            )


#: The outcome signals by name, for `_announce`'s line.
_SIGNAL_NAMES = {
    getattr(signals, name): name
    for name in ("job_released", "job_succeeded", "job_retried", "job_failed")
    + ("job_outcome_unknown", "job_lost")
}


def _log_raised(job: Job, attempt: int, duration: float, error: ErrorInfo, *, final: bool) -> None:
    # The stored, redacted traceback, not exc_info: secrets stay out of logs too. Not
    # for the last failure of a django.tasks Task: Django's own task_finished receiver
    # logs that one with its traceback (logger.exception, for error monitoring), and
    # the failure was logged twice (tasks/signal_handlers.py sends it).
    task = registry.get(job.task) if job.task in registry else None
    if final and task is not None and task.django_task is not None:
        logger.error(
            "job raised id=%s task=%s attempt=%d duration=%.3fs error=%s "
            "(its traceback: django.tasks' line below)",
            job.id,
            job.task,
            attempt,
            duration,
            error.type,
        )
        return
    logger.error(
        "job raised id=%s task=%s attempt=%d duration=%.3fs error=%s\n%s",
        job.id,
        job.task,
        attempt,
        duration,
        error.type,
        error.traceback.rstrip(),
    )


def _persist(write: Callable[[], T], job: Job, database: str) -> Answer[T]:
    """Run a fenced write of `job`'s outcome; see `persist`."""
    return persist(
        write, give_up_after=job.lease.total_seconds(), what=f"id={job.id}", database=database
    )


def persist(write: Callable[[], T], *, give_up_after: float, what: str, database: str) -> Answer[T]:
    """Run a fenced write, retrying through passing errors, never dropping it.

    A passing error (faults.is_transient: the connection, a read-only or restarting
    server) leaves the outcome unknown, so the write is retried with backoff
    (the fence makes a repeat harmless) until it is answered, or until `give_up_after`
    seconds (a whole lease) have passed: by then the lease has surely run out and the
    write would be refused anyway, and the reaper owns the job. The answer then says
    `unknown`; a database error that is not passing is raised.
    """
    give_up = time.monotonic() + give_up_after
    delay = 0.05
    fresh = False  # tried once on a new connection after an error that is not passing
    while True:
        try:
            return Answer(write())
        except DatabaseError as error:
            if not is_transient(error):
                if fresh or connections[database].in_atomic_block:
                    raise
                # A task may have left its session changed behind our back (a SET on
                # the raw connection): the same write on a new session tells a broken
                # session from a refused row. The fence makes the repeat harmless.
                logger.warning("job outcome write failed %s, on a new connection: %s", what, error)
                discard(connections[database])
                fresh = True
                continue
            discard(connections[database])
            if time.monotonic() + delay > give_up:
                logger.error("job outcome not written %s: %s; left to the reaper", what, error)
                return Answer(unknown=True)
            logger.warning("job outcome write failed %s, retrying in %.2fs: %s", what, delay, error)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def _unknown(job: Job, attempt: int, duration: float, error: ErrorInfo | None = None) -> Execution:
    logger.error(
        "job outcome unknown id=%s task=%s attempt=%d: no answer from the database within "
        "a lease; the reaper will take the job back if the write did not happen",
        job.id,
        job.task,
        attempt,
    )
    _announce(signals.job_outcome_unknown, job=job)
    return Execution(job.id, attempt, Outcome.UNKNOWN, duration, error)


def _lost(job: Job, attempt: int, duration: float, error: ErrorInfo | None = None) -> Execution:
    logger.warning(
        "job lease lost id=%s task=%s attempt=%d: outcome refused by the fence",
        job.id,
        job.task,
        attempt,
    )
    _announce(signals.job_lost, job=job)
    return Execution(job.id, attempt, Outcome.LOST, duration, error)
