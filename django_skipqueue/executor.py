"""Run one claimed job: look it up, call it, then ack, fail or release through the fence.

The worker loops over this; tests and `run_jobs()` call it directly. It never raises
for anything the task does: every outcome is written (or refused by the fence) and
returned. Only registered tasks run (see registry.py).
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from asgiref.sync import async_to_sync
from django.db import DatabaseError, connections

from django_skipqueue import signals
from django_skipqueue.base import TaskContext, default_retry_policy
from django_skipqueue.compat import drop_atomic_blocks
from django_skipqueue.conf import get_settings
from django_skipqueue.connections import discard
from django_skipqueue.exceptions import (
    InvalidJobError,
    JobCancelled,
    Retry,
    TransactionLeftOpenError,
    UnknownTaskError,
)
from django_skipqueue.faults import is_row_fault, is_transient
from django_skipqueue.inflight import CancelFlag
from django_skipqueue.managers import ErrorInfo
from django_skipqueue.models import Job, JobState
from django_skipqueue.payload import Undecodable, encoded_size, normalize, storable_text
from django_skipqueue.redaction import redact_text
from django_skipqueue.registry import registry

if TYPE_CHECKING:
    from django_skipqueue.base import Task
    from django_skipqueue.managers import JobManager

logger = logging.getLogger(__name__)
T = TypeVar("T")

MESSAGE_MAX_CHARS = 8 * 1024
TRACEBACK_MAX_CHARS = 32 * 1024


class Outcome(str, enum.Enum):
    SUCCEEDED = "succeeded"  # acked: done
    RETRYING = "retrying"  # failed attempt, pending again after a backoff
    FAILED = "failed"  # ended failed
    RELEASED = "released"  # attempt given back (Retry)
    LOST = "lost"  # the fence refused the write: this attempt had lost the job
    UNKNOWN = "unknown"  # no answer from the database within a lease: the reaper owns it
    CANCELLED = "cancelled"  # stopped on an operator's cancel request: ended cancelled


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


def describe_error(error: BaseException) -> ErrorInfo:
    """The class path, message and traceback of `error`: capped, redacted, no frame locals.

    Every text is made storable (NUL and lone surrogates escaped), and a message whose
    `__str__` raises is described instead, so the history always shows the real error.
    """
    kind = type(error)
    text = "".join(traceback.format_exception(kind, error, error.__traceback__))
    if len(text) > TRACEBACK_MAX_CHARS:
        text = "...(truncated)\n" + text[-TRACEBACK_MAX_CHARS:]
    try:
        message = str(error)
    except Exception as unprintable:  # noqa: BLE001  (any __str__ may raise)
        message = f"<str() of the exception raised {type(unprintable).__name__}>"
    return ErrorInfo(
        type=storable_text(f"{kind.__module__}.{kind.__qualname__}"),
        message=storable_text(redact_text(message[:MESSAGE_MAX_CHARS])),
        traceback=storable_text(redact_text(text)),
    )


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
) -> Execution: ...


@overload
def execute(
    job: Job,
    *,
    database: str | None = None,
    defer_ack: DeferredAck,
    cancel: CancelFlag | None = None,
) -> Execution | None: ...


def execute(
    job: Job,
    *,
    database: str | None = None,
    defer_ack: DeferredAck | None = None,
    cancel: CancelFlag | None = None,
) -> Execution | None:
    """Run `job`, a row just returned by `Job.objects.claim()`, and record its outcome.

    With `defer_ack`, a success is handed to it instead of being acknowledged here (the
    worker acknowledges the jobs that finished meanwhile in one fenced statement), and
    None is returned: the outcome is known once the ack is. `cancel` is the worker's
    flag of a cancel request for this job (the task's `context.cancel_requested`).
    """
    database = database or get_settings().DATABASE_ALIAS
    jobs = Job.objects.db_manager(database)
    attempt = job.attempts
    started = time.monotonic()  # durations only; no decision uses the process clock
    signals.job_started.send(sender=Job, job=job)
    logger.debug("job started id=%s task=%s attempt=%d", job.id, job.task, attempt)

    task: Task[Any, Any] | None = None
    depth = len(connections[database].atomic_blocks)
    try:
        task = registry.get(job.task)
        if cancel is not None and cancel.is_set():  # cancelled before it started
            raise JobCancelled(job.id)
        try:
            with SessionWatch(database):
                value = _call(task, job, database, cancel)
        finally:
            _roll_back_left_open(database, depth)
        result = normalize(value, "the return value")
        limit = get_settings().MAX_PAYLOAD_BYTES
        size = encoded_size(result)
        if size > limit:
            raise InvalidJobError(
                f"the return value takes {size} bytes as stored (jsonb text), over the "
                f"limit of {limit} (SKIPQUEUE['MAX_PAYLOAD_BYTES'])"
            )
    except Retry as request:
        duration, delay = time.monotonic() - started, request.delay
        released = _persist(lambda: jobs.release(job.id, attempt, delay=delay), job, database)
        if released.unknown:
            return _unknown(job, attempt, duration)
        if not released.value:
            return _lost(job, attempt, duration)
        logger.debug(
            "job released id=%s task=%s attempt=%d delay=%.3fs reason=%s",
            job.id,
            job.task,
            attempt,
            request.delay.total_seconds(),
            request,
        )
        signals.job_released.send(sender=Job, job=job, delay=request.delay)
        return Execution(job.id, attempt, Outcome.RELEASED, duration)
    except JobCancelled:
        duration = time.monotonic() - started
        ended = _persist(lambda: jobs.end_cancelled(job.id, attempt), job, database)
        if ended.unknown:
            return _unknown(job, attempt, duration)
        if not ended.value:
            return _lost(job, attempt, duration)
        logger.info("job cancelled id=%s task=%s attempt=%d", job.id, job.task, attempt)
        return Execution(job.id, attempt, Outcome.CANCELLED, duration)
    except BaseException as raised:  # noqa: BLE001  (a task's SystemExit is a failure too)
        duration = time.monotonic() - started
        execution = _record_failure(jobs, job, attempt, task, raised, duration, database)
        if (
            isinstance(raised, KeyboardInterrupt)
            and threading.current_thread() is threading.main_thread()
        ):
            raise
        return execution

    duration = time.monotonic() - started
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


def acknowledge(successes: Sequence[Success], database: str) -> list[Execution | None]:
    """Acknowledge successes in one fenced statement, then log and signal each outcome.

    Each job keeps its own fence (id, attempt, unexpired lease). A passing error is
    retried until answered (or a lease has passed: the outcome is then unknown), and an
    ack refused after a retry is checked for having committed the first time. A row
    whose own ack the database refuses fails that job with the error. Returns each
    success's Execution, in order (None where recording it failed, which is logged).
    """
    jobs = Job.objects.db_manager(database)
    acks = [(job.id, attempt, result) for job, attempt, result, _ in successes]
    give_up = min(job.lease.total_seconds() for job, _, _, _ in successes)
    what = f"ids={','.join(str(job.id) for job, _, _, _ in successes[:10])}"
    errors: dict[int, DatabaseError] = {}  # rows whose own ack the database refused
    try:
        answer = persist(
            lambda: jobs.ack_many(acks, errors=errors),
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
    # The success signals' receivers ran on this thread: nothing they left open may
    # hold the next batch's acks uncommitted.
    for left in end_open_transactions():
        logger.error("worker rolled back %s, left by a signal receiver", left)
    return executions


def release_on_shutdown(attempts: Sequence[tuple[Job, int]], database: str) -> int:
    """Give each attempt back at a graceful stop (fenced): pending again without
    spending an attempt. Returns how many were released; the others had finished or
    lost their lease, or the database did not answer (then the reaper takes them back).
    """
    jobs = Job.objects.db_manager(database)
    released = 0
    for job, attempt in attempts:
        try:
            if not jobs.release(job.id, attempt):
                continue
        except DatabaseError as error:
            logger.warning("job not released id=%s: %s; the reaper will", job.id, error)
            continue
        released += 1
        logger.warning(
            "job released on shutdown id=%s task=%s attempt=%d", job.id, job.task, attempt
        )
    return released


def record_ack_error(
    job: Job, attempt: int, error: DatabaseError, duration: float, database: str
) -> Execution:
    """A success whose own ack the database refused (not by the connection): the job
    fails with that error, as if the task had raised it (not retried for a bad row)."""
    task = registry.get(job.task) if job.task in registry else None
    jobs = Job.objects.db_manager(database)
    return _record_failure(jobs, job, attempt, task, error, duration, database)


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
    signals.job_succeeded.send(sender=Job, job=job, result=result, duration=duration)
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
    started = time.monotonic()
    signals.job_started.send(sender=Job, job=job)
    logger.debug("job started id=%s task=%s attempt=%d broker", job.id, job.task, attempt)
    task: Task[Any, Any] | None = None
    depth = len(connections[database].atomic_blocks)
    try:
        task = registry.get(job.task)
        try:
            with SessionWatch(database):
                value = _call(task, job, database, CancelFlag(), brokered=True)
        finally:
            _roll_back_left_open(database, depth)
        result = normalize(value, "the return value")
    except Retry as request:
        duration = time.monotonic() - started
        signals.job_released.send(sender=Job, job=job, delay=request.delay)
        return Verdict(Outcome.RELEASED, duration, retry_in=request.delay)
    except BaseException as raised:  # noqa: BLE001  (a task's SystemExit is a failure too)
        duration = time.monotonic() - started
        error = describe_error(raised)
        _log_raised(job, attempt, duration, error)
        if _is_retryable(task, raised) and attempt < job.max_attempts:
            policy = task.retry_policy if task is not None else default_retry_policy()
            retry_in = policy.delay(attempt)
            signals.job_retried.send(sender=Job, job=job, error=error, run_after=retry_in)
            return Verdict(Outcome.RETRYING, duration, error=error, retry_in=retry_in)
        logger.warning("job failed id=%s task=%s attempt=%d", job.id, job.task, attempt)
        signals.job_failed.send(sender=Job, job=job, error=error)
        return Verdict(Outcome.FAILED, duration, error=error)
    duration = time.monotonic() - started
    logger.debug(
        "job succeeded id=%s task=%s attempt=%d duration=%.3fs", job.id, job.task, attempt, duration
    )
    signals.job_succeeded.send(sender=Job, job=job, result=result, duration=duration)
    return Verdict(Outcome.SUCCEEDED, duration, result=result)


def _call(
    task: Task[Any, Any],
    job: Job,
    database: str,
    cancel: CancelFlag | None = None,
    *,
    brokered: bool = False,
) -> Any:
    for name in ("args", "kwargs"):
        value = getattr(job, name)
        if isinstance(value, Undecodable):
            raise InvalidJobError(
                f"job {job.id} has {name} that Python cannot load from JSON ({value.reason}); "
                f"it was written by another client"
            )
    if not isinstance(job.args, list) or not isinstance(job.kwargs, dict):
        raise InvalidJobError(
            f"job {job.id} has malformed arguments: args must be a JSON array and kwargs a "
            f"JSON object, got {type(job.args).__name__} and {type(job.kwargs).__name__}"
        )
    args: list[Any] = list(job.args)
    if task.django_task is not None:  # declared with django.tasks' @task
        return _call_django_task(task, job, args)
    if task.takes_context:
        context = TaskContext(
            job_id=job.id,
            attempt=job.attempts,
            max_attempts=job.max_attempts,
            task_name=job.task,
            queue_name=job.queue_name,
            database=database,
            cancel_event=cancel,
            brokered=brokered,
        )
        args.insert(0, context)
    if task.is_async:
        return async_to_sync(task.func)(*args, **job.kwargs)
    return task.func(*args, **job.kwargs)


def _call_django_task(task: Task[Any, Any], job: Job, args: list[Any]) -> Any:
    """Call a django.tasks Task: its own context class, async run in an event loop."""
    django_task = task.django_task
    if django_task.takes_context:
        from django.tasks import TaskContext as DjangoTaskContext

        result = django_task.get_backend().result_from_job(job)  # the job's own options
        args.insert(0, DjangoTaskContext(task_result=result))
    return django_task.call(*args, **job.kwargs)


#: Statements that change a session for its life, not one transaction's: a task that
#: runs one leaves its thread's connection changed for every later job (a search_path
#: under which our tables are not found, a statement_timeout, a role).
_SESSION_CHANGES = re.compile(
    r"\s*(?:SET\s+(?!LOCAL\b|TRANSACTION\b|CONSTRAINTS\b)|RESET\b|DISCARD\b)"
    r"|.*\bset_config\s*\(.*\bfalse\b",
    re.IGNORECASE | re.DOTALL,
)


class SessionWatch:
    """Around a task's call: if the task changed its connection's session state (SET,
    RESET, `set_config(..., false)`: `_SESSION_CHANGES`), the connection is closed
    after the call, so that our fenced write and the next job run on a fresh session
    (behind a transaction pooler too: the server connection is not kept). Seen through
    Django's execute wrappers, so it costs one regular expression per statement of the
    task. A task that reaches the raw psycopg connection is not seen; `persist`
    reconnects once when our own write fails after such a task."""

    __slots__ = ("_connection", "changed")

    def __init__(self, database: str) -> None:
        self._connection = connections[database]
        self.changed = False

    def __enter__(self) -> SessionWatch:
        self._connection.execute_wrappers.append(self._watch)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._connection.execute_wrappers.remove(self._watch)
        except ValueError:  # the task replaced the list
            pass
        if self.changed and not self._connection.in_atomic_block:
            logger.warning(
                "the task changed its database session (SET); the connection is closed "
                "so that later jobs do not inherit it"
            )
            discard(self._connection)

    def _watch(self, execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        if isinstance(sql, str) and _SESSION_CHANGES.match(sql):
            self.changed = True
        return execute(sql, params, many, context)


def _roll_back_left_open(database: str, depth: int) -> None:
    """Roll back every transaction the task left open on this thread, and say so.

    Two ways to leave one: atomic() blocks entered and never exited (the stack is
    deeper than before the task), or a transaction begun behind Django's back (a raw
    `BEGIN`), which only the server's status shows. Either way the connection is
    closed (the server rolls back) and Django's bookkeeping reset, so the fenced write
    that follows, and the next job, run on a clean connection in autocommit. Raises
    TransactionLeftOpenError naming what was rolled back.
    """
    left = []
    connection = connections[database]
    if len(connection.atomic_blocks) > depth:
        left.append(
            f"{len(connection.atomic_blocks) - depth} atomic() block(s) on {database!r}, "
            f"entered and never exited"
        )
        discard(connection)
        drop_atomic_blocks(connection, depth)
    left.extend(end_open_transactions())
    if left:
        raise TransactionLeftOpenError(
            f"the task left a transaction open ({'; '.join(left)}); its writes were rolled "
            f"back, so this job is failed, not retried"
        )


def end_open_transactions() -> list[str]:
    """Close this thread's connections that the server says are inside a transaction
    Django did not open (outside atomic(), in autocommit); one line for each.

    Closing makes the server roll the transaction back. A connection in atomic() (the
    caller's own transaction, in tests) is left alone.
    """
    found = []
    for connection in connections.all(initialized_only=True):
        raw = connection.connection
        if raw is None or connection.in_atomic_block or not connection.get_autocommit():
            continue
        status = int(raw.info.transaction_status)
        if status == 0:  # IDLE: nothing open
            continue
        if status not in (1, 2, 3):  # UNKNOWN: the connection is broken, nothing is open
            discard(connection)
            continue
        name = {1: "ACTIVE", 2: "INTRANS", 3: "INERROR"}[status]
        found.append(f"a transaction outside atomic() on {connection.alias!r}, status {name}")
        discard(connection)
    return found


def _is_retryable(task: Task[Any, Any] | None, error: BaseException) -> bool:
    if isinstance(error, (InvalidJobError, TransactionLeftOpenError)):
        return False  # malformed row or result: another attempt would fail the same way
    if is_row_fault(error):
        return False  # the database refused this job's own row or result
    if isinstance(error, UnknownTaskError):
        return True  # a rolling deploy: a newer worker may know the task
    return task is None or not isinstance(error, task.non_retryable)


def _record_failure(
    jobs: JobManager,
    job: Job,
    attempt: int,
    task: Task[Any, Any] | None,
    raised: BaseException,
    duration: float,
    database: str,
) -> Execution:
    error = describe_error(raised)
    retry_in: timedelta | None = None
    if _is_retryable(task, raised):
        policy = task.retry_policy if task is not None else default_retry_policy()
        retry_in = policy.delay(attempt)
    answer = _persist(
        lambda: jobs.fail(job.id, attempt, error=error, retry_in=retry_in), job, database
    )
    if answer.unknown:
        return _unknown(job, attempt, duration, error)
    state = answer.value
    if state is None:
        return _lost(job, attempt, duration, error)
    if isinstance(raised, UnknownTaskError):
        logger.error("job task unknown id=%s task=%s attempt=%d", job.id, job.task, attempt)
    else:
        _log_raised(job, attempt, duration, error)
    if state == JobState.CANCELLED:  # failed after a cancel request: not retried
        logger.info("job cancelled id=%s task=%s attempt=%d", job.id, job.task, attempt)
        return Execution(job.id, attempt, Outcome.CANCELLED, duration, error)
    if state == JobState.PENDING:
        logger.debug(
            "job retrying id=%s task=%s attempt=%d in=%.3fs",
            job.id,
            job.task,
            attempt,
            retry_in.total_seconds() if retry_in else 0.0,
        )
        signals.job_retried.send(sender=Job, job=job, error=error, run_after=retry_in)
        return Execution(job.id, attempt, Outcome.RETRYING, duration, error)
    logger.warning("job failed id=%s task=%s attempt=%d", job.id, job.task, attempt)
    signals.job_failed.send(sender=Job, job=job, error=error)
    return Execution(job.id, attempt, Outcome.FAILED, duration, error)


def _log_raised(job: Job, attempt: int, duration: float, error: ErrorInfo) -> None:
    # The stored, redacted traceback, not exc_info: secrets stay out of logs too.
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
    signals.job_outcome_unknown.send(sender=Job, job=job)
    return Execution(job.id, attempt, Outcome.UNKNOWN, duration, error)


def _lost(job: Job, attempt: int, duration: float, error: ErrorInfo | None = None) -> Execution:
    logger.warning(
        "job lease lost id=%s task=%s attempt=%d: outcome refused by the fence",
        job.id,
        job.task,
        attempt,
    )
    signals.job_lost.send(sender=Job, job=job)
    return Execution(job.id, attempt, Outcome.LOST, duration, error)
