"""Run a job and decide its outcome, writing nothing: the one run path of both workers.

`run_and_decide()` calls the task (with its context, the django.tasks bridge, async
tasks run to completion), rolls back what it left open, watches the session for changes
that would outlive the job, checks the return value, and classifies what happened as a
`Decision`: succeeded (with the result), released (`Retry`, with its delay), cancelled,
or failed (with the error and, when another attempt may help, the backoff before it).

The PostgreSQL worker writes a decision through the fence (`executor.execute`); the
broker consumer turns it into an ack, a delayed retry or a dead letter
(`executor.run_brokered`). Only registered tasks run (tasks/registry.py).

Over 600 lines because a task's run is one sequence read top to bottom (call, roll
back, watch the session, check the result, decide): split, each step would need the
others' state passed around.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync
from django.db.backends.base.base import BaseDatabaseWrapper

from django_skipqueue import signals
from django_skipqueue.core.cancel import CancelFlag
from django_skipqueue.core.payload import (
    JSONValue,
    Undecodable,
    check_stored_size,
    normalize,
    storable_text,
)
from django_skipqueue.core.redaction import redact_text
from django_skipqueue.core.running import RUNNING_JOB
from django_skipqueue.exceptions import (
    InvalidJobError,
    JobCancelled,
    NotJSONError,
    Retry,
    SignalTimeoutError,
    SoftTimeLimitExceeded,
    StepMismatchError,
    TimeLimitExceeded,
    TransactionLeftOpenError,
    UnknownTaskError,
)
from django_skipqueue.faults import is_row_fault
from django_skipqueue.models import Job, Workflow
from django_skipqueue.queue.base import ErrorInfo
from django_skipqueue.queue.connections import (
    BOUND_TRANSACTION,
    add_execute_wrapper,
    atomic_depth,
    discard,
    drop_atomic_blocks,
    initialized_connections,
    remove_execute_wrapper,
    thread_connection,
)
from django_skipqueue.tasks.base import default_retry_policy
from django_skipqueue.tasks.context import TaskContext
from django_skipqueue.tasks.registry import registry

try:  # the context class of the Tasks API (django.tasks, or the django-tasks backport)
    from django_skipqueue.core.tasks_api import TaskContext as DjangoTaskContext
except ImportError:  # neither is installed: no django.tasks Task can exist
    DjangoTaskContext = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from django_skipqueue.tasks.base import Task

logger = logging.getLogger(__name__)

MESSAGE_MAX_CHARS = 8 * 1024
TRACEBACK_MAX_CHARS = 32 * 1024


class Outcome(str, enum.Enum):
    """An attempt's outcome; its value is its one name everywhere (logs, counts,
    `run_jobs`, the QueueMinute columns, the metrics' `outcome` label)."""

    SUCCEEDED = "succeeded"  # acked: done
    RETRYING = "retried"  # failed attempt, pending again after a backoff
    FAILED = "failed"  # ended failed
    RELEASED = "released"  # attempt given back (Retry)
    LOST = "lost"  # the fence refused the write: this attempt had lost the job
    UNKNOWN = "unknown"  # no answer from the database within a lease: the reaper owns it
    CANCELLED = "cancelled"  # stopped on an operator's cancel request: ended cancelled


@dataclass(slots=True)
class Decision:
    """What running a job came to, before anything is written (made once a job, and
    not frozen: a frozen dataclass's __init__ took 2.5 us for its six fields, this one
    0.7 us, measured, Python 3.11; nothing changes one after it is made).

    `outcome` is SUCCEEDED (`result`), RELEASED (`retry_in`: the Retry's delay),
    CANCELLED, RETRYING (a retryable failure: `error`, and `retry_in` the backoff before
    the next attempt, if one is left) or FAILED (`error`, not retryable). `raised` is
    the exception of a failure, for what only its type says.
    """

    outcome: Outcome
    duration: float
    result: Any = None
    error: ErrorInfo | None = None
    retry_in: timedelta | None = None
    raised: BaseException | None = None

    @property
    def failed(self) -> bool:
        return self.outcome in (Outcome.RETRYING, Outcome.FAILED)


def run_and_decide(
    job: Job,
    *,
    database: str,
    cancel: CancelFlag | None = None,
    brokered: bool = False,
    check_size: bool = True,
    depths: Mapping[str, int] | None = None,
) -> Decision:
    """Run `job` (a claimed row, or an unsaved Job made from a broker message) and
    decide its outcome. Sends `job_started`; never raises for what the task, or a
    `job_started` receiver, does. `depths` are the thread's atomic() depths before the
    job (`atomic_depths()`, read here if not given): blocks deeper than those after it
    are the job's, rolled back and named."""
    attempt = job.attempts
    started = time.monotonic()  # durations only; no decision uses the process clock
    connection = thread_connection(database)  # looked up once a job
    # Read before job_started's receivers run: an atomic() block one of them leaves
    # open is rolled back after the task as the task's own would be. Read after them,
    # it counted as the caller's, and the job's outcome write retried for ever.
    if depths is None:  # every alias's: a task may use several
        depths = atomic_depths()
    task: Task[Any, Any] | None = None
    past: float | None = None  # the hard limit, if the worker found the attempt past it
    try:
        try:
            signals.job_started.send(sender=Job, job=job)
        except BaseException:
            # A receiver that raises fails the attempt, as the task raising would (a
            # pre_save receiver's exception stops the save the same way), retried by the
            # task's policy. Before, it escaped, and the job waited for its lease.
            _roll_back_left_open(depths)  # one it left open is named instead
            task = registry.get(job.task) if job.task in registry else None
            raise
        logger.debug(
            "job started id=%s task=%s attempt=%d%s",
            job.id,
            job.task,
            attempt,
            " broker" if brokered else "",
        )
        task = registry.get(job.task)
        if cancel is not None and cancel.is_set():  # cancelled before it started
            raise JobCancelled(job.id)
        running = RUNNING_JOB.set(job.id)  # job.wait() in the task is refused
        try:
            with SessionWatch(connection):
                value = _call(
                    task, job, database, cancel, brokered=brokered, depth=depths.get(database, 0)
                )
        finally:
            RUNNING_JOB.reset(running)
            # Past its hard limit (runtime/timelimits.py), the attempt ends with
            # TimeLimitExceeded, whatever came out of the task, the rest as its cause.
            past = cancel.exceeded if cancel is not None else None
            _roll_back_left_open(depths)
        if past is not None:  # it returned once past its limit: still past it
            raise TimeLimitExceeded(past)
        result = _return_value(task, value)
        if check_size:
            check_stored_size(result, "the return value")
    except Retry as request:
        duration = time.monotonic() - started
        if past is not None:
            return decide_failure(task, _past_limit(past, request), attempt, duration)
        if not request.spend_attempt:
            return Decision(Outcome.RELEASED, duration, retry_in=request.delay, raised=request)
        # A counted retry: a failed attempt whose delay is the task's, not the policy's.
        if attempt >= job.max_attempts:
            request.args = (
                f"{request}: a retry was asked for after the last attempt ({attempt} of "
                f"{job.max_attempts}, max_attempts)",
            )
        error = describe_error(request)
        return Decision(
            Outcome.RETRYING, duration, error=error, retry_in=request.delay, raised=request
        )
    except JobCancelled as cancelled:
        if past is not None:
            exceeded = _past_limit(past, cancelled)
            return decide_failure(task, exceeded, attempt, time.monotonic() - started)
        if brokered:  # no cancel reaches a brokered job: a failure like any other
            return decide_failure(task, cancelled, attempt, time.monotonic() - started)
        return Decision(Outcome.CANCELLED, time.monotonic() - started)
    except BaseException as raised:  # noqa: BLE001  (a task's SystemExit is a failure too)
        if past is not None and not isinstance(raised, TimeLimitExceeded):
            raised = _past_limit(past, raised)
        return decide_failure(task, raised, attempt, time.monotonic() - started)
    return Decision(Outcome.SUCCEEDED, time.monotonic() - started, result=result)


def _past_limit(limit: float, raised: BaseException) -> TimeLimitExceeded:
    """The attempt ran past its hard limit, and `raised` came out of it (its own error,
    or SoftTimeLimitExceeded): it ends with TimeLimitExceeded all the same, `raised` as
    its cause."""
    exceeded = TimeLimitExceeded(limit)
    exceeded.__cause__ = raised
    return exceeded


def _return_value(task: Task[Any, Any], value: Any) -> JSONValue:
    """`value` as JSON data, or NotJSONError; for a django.tasks Task, the TypeError that
    Django's backends record (normalize_json's "Unsupported type: ..."), caused by it."""
    try:
        return normalize(value, "the return value")
    except NotJSONError as error:
        if task.django_task is None:
            raise
        raise TypeError(f"Unsupported type: {error.kind} ({error})") from error


def decide_failure(
    task: Task[Any, Any] | None, raised: BaseException, attempt: int, duration: float
) -> Decision:
    """A failed attempt: its error, and the backoff if another attempt may help."""
    error = describe_error(raised)
    retry_in = retry_delay(task, raised, attempt)
    outcome = Outcome.RETRYING if retry_in is not None else Outcome.FAILED
    return Decision(outcome, duration, error=error, retry_in=retry_in, raised=raised)


def retry_delay(
    task: Task[Any, Any] | None, raised: BaseException, attempt: int
) -> timedelta | None:
    """The backoff before the attempt after `attempt`, or None if `raised` is not worth
    another (whether one is left is the caller's: the table's fence, or the message)."""
    if not _is_retryable(task, raised):
        return None
    policy = task.retry_policy if task is not None else default_retry_policy()
    return policy.delay(attempt)


def describe_error(error: BaseException) -> ErrorInfo:
    """The class path, message and traceback of `error`: capped, redacted, no frame locals.

    Every text is made storable (NUL and lone surrogates escaped), and a message whose
    `__str__` raises is described instead, so the history always shows the real error.
    """
    kind = type(error)
    text = "".join(traceback.format_exception(kind, error, error.__traceback__))
    # Masked first, then cut: a secret across the cut would be stored with its head
    # cut off, which no rule recognises (a DSN without its `@`). What is masked is
    # bounded at four times what is kept, at a word's edge (`_words_after`): a secret
    # across that bound is dropped whole, never kept in part.
    text = redact_text(_words_after(text, len(text) - 4 * TRACEBACK_MAX_CHARS))
    if len(text) > TRACEBACK_MAX_CHARS:
        text = "...(truncated)\n" + text[-TRACEBACK_MAX_CHARS:]
    try:
        message = str(error)
    except Exception as unprintable:  # noqa: BLE001  (any __str__ may raise)
        message = f"<str() of the exception raised {type(unprintable).__name__}>"
    return ErrorInfo(
        type=storable_text(f"{kind.__module__}.{kind.__qualname__}"),
        message=storable_text(
            redact_text(_words_before(message, 4 * MESSAGE_MAX_CHARS))[:MESSAGE_MAX_CHARS]
        ),
        traceback=storable_text(text),
    )


#: The edge of a word: where a cut leaves no token (a DSN, a key) in part.
_SPACE = re.compile(r"\s")


def _words_before(text: str, end: int) -> str:
    """`text` up to `end`, less the word that `end` cuts (all of `text` if it is shorter).
    Masking shrinks a text, so what follows the cut could be kept by the final cut:
    cut in a word, a password's DSN lost its `@` and no rule knew it
    (tests/core/test_redaction.py, `test_a_message_is_masked_before_it_is_cut_...`)."""
    if len(text) <= end:
        return text
    cut = text[:end]
    spaces = list(_SPACE.finditer(cut, max(end - 4096, 0)))
    return cut[: spaces[-1].start()] if spaces else cut[: max(end - 4096, 0)]


def _words_after(text: str, start: int) -> str:
    """`text` from `start`, less the word that `start` cuts (all of it if `start` <= 0)."""
    if start <= 0:
        return text
    space = _SPACE.search(text, start, min(start + 4096, len(text)))
    return text[space.end() :] if space else text[min(start + 4096, len(text)) :]


def _call(
    task: Task[Any, Any],
    job: Job,
    database: str,
    cancel: CancelFlag | None = None,
    *,
    brokered: bool = False,
    depth: int = 0,
) -> Any:
    """Call the task with the job's arguments (and its context). `depth`: the atomic()
    blocks the job's connection was in before the job (run_and_decide's `depths`)."""
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
    if job.inputs:  # a workflow's job: its parents' results (or the failure), read now
        args[:0] = Workflow.objects.db_manager(database).inputs_of(job)
    if task.django_task is not None:  # declared with django.tasks' @task
        return _call_django_task(task, job, args)
    if task.takes_context:
        now = time.monotonic()
        soft, hard = task.soft_time_limit, task.time_limit
        context = TaskContext(
            job_id=job.id,
            attempt=job.attempts,
            max_attempts=job.max_attempts,
            task_name=job.task,
            queue_name=job.queue_name,
            database=database,
            cancel_event=cancel,
            brokered=brokered,
            soft_deadline=now + soft.total_seconds() if soft is not None else None,
            hard_deadline=now + hard.total_seconds() if hard is not None else None,
            base_atomic_depth=depth,
        )
        args.insert(0, context)
    if task.is_async:
        limit = task.time_limit
        if limit is not None:  # cancelled at its next await past the limit
            value = async_to_sync(_within(task.func, limit.total_seconds()))(*args, **job.kwargs)
        else:
            value = async_to_sync(task.func)(*args, **job.kwargs)
    else:
        value = task.func(*args, **job.kwargs)
    if task.takes_context:
        args[0].owed_sleep()  # a durable sleep whose Retry the task caught
    return value


def _within(func: Any, seconds: float) -> Any:
    """An async task's hard time limit: the coroutine is cancelled at its next await
    past `seconds`, and the attempt ends with TimeLimitExceeded."""

    async def limited(*args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(func(*args, **kwargs), seconds)
        except asyncio.TimeoutError:
            raise TimeLimitExceeded(seconds) from None

    return limited


def _call_django_task(task: Task[Any, Any], job: Job, args: list[Any]) -> Any:
    """Call a django.tasks Task: its own context class, async run in an event loop."""
    django_task = task.django_task
    if django_task.takes_context:
        result = django_task.get_backend().result_from_job(job)  # the job's own options
        args.insert(0, DjangoTaskContext(task_result=result))
    return django_task.call(*args, **job.kwargs)


#: Statements that change a session for its life, not one transaction's: a task that
#: runs one leaves its thread's connection changed for every later job (a search_path
#: under which our tables are not found, a statement_timeout, a role).
#: Seen at the start of a statement (after comments): SET, RESET, DISCARD, LISTEN,
#: PREPARE, LOAD, a DO block (which may run any of them), a temporary table, view or
#: sequence (which would hide ours for every later job: their writes would vanish at
#: the session's end), a cursor WITH HOLD. Anywhere in it: set_config() (its third
#: argument may be a parameter), a session-level advisory lock, and a second statement
#: after a semicolon. A false alarm only costs a new connection for the next job.
_SESSION_CHANGES = re.compile(
    r"(?:SET\s+(?!LOCAL\b|TRANSACTION\b|CONSTRAINTS\b)|RESET\b|DISCARD\b|LISTEN\b"
    r"|PREPARE\b|LOAD\b|DO\b|CREATE\s+(?:OR\s+REPLACE\s+|GLOBAL\s+|LOCAL\s+)?TEMP(?:ORARY)?\b"
    r"|DECLARE\b.*\bWITH\s+HOLD\b)",
    re.IGNORECASE | re.DOTALL,
)
_SESSION_CHANGES_ANYWHERE = re.compile(
    r"\bset_config\s*\(|\bpg_(?:try_)?advisory_lock(?:_shared)?\s*\(|;\s*[^\s;]",
    re.IGNORECASE,
)
_LEADING_COMMENTS = re.compile(r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)+", re.DOTALL)


def changes_session(sql: str) -> bool:
    """Whether a statement a task ran may change its connection's session for good
    (`_SESSION_CHANGES`): then the connection is closed after the task."""
    start = _LEADING_COMMENTS.match(sql)
    text = sql[start.end() :] if start else sql
    return bool(_SESSION_CHANGES.match(text) or _SESSION_CHANGES_ANYWHERE.search(text))


class SessionWatch:
    """Around a task's call: if the task may have changed its connection's session state
    (SET, RESET, set_config(), a temporary table...: `changes_session`), the connection is closed
    after the call, so that our fenced write and the next job run on a fresh session
    (behind a transaction pooler too: the server connection is not kept). Seen through
    Django's execute wrappers, so it costs one regular expression per statement of the
    task. A task that reaches the raw psycopg connection is not seen; `persist`
    reconnects once when our own write fails after such a task."""

    __slots__ = ("_connection", "changed")

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self._connection = connection
        self.changed = False

    def __enter__(self) -> SessionWatch:
        add_execute_wrapper(self._connection, self._watch)
        return self

    def __exit__(self, *exc: object) -> None:
        remove_execute_wrapper(self._connection, self._watch)
        connection = self._connection
        if (
            self.changed
            and not connection.in_atomic_block
            # A transaction still open is the check's after this (_roll_back_left_open):
            # it closes the connection too, and names what it rolled back. Closed here,
            # the task's uncommitted writes vanished and the job succeeded.
            and (connection.connection is None or not _transaction_status(connection.connection))
        ):
            logger.warning(
                "the task changed its database session (SET); the connection is closed "
                "so that later jobs do not inherit it"
            )
            discard(connection)

    def _watch(self, execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        # Our own bounds of a transaction (a durable atomic step's) set_config() for that
        # transaction only (is_local): not a change of the session.
        if (
            not self.changed
            and isinstance(sql, str)
            and sql is not BOUND_TRANSACTION
            and changes_session(sql)
        ):
            self.changed = True
        return execute(sql, params, many, context)

    #: It only looks for session changes (SET), which the enqueue's own INSERT never
    #: makes: the direct enqueue (db/direct.py) may pass it by, so that enqueues from
    #: inside a task (a workflow's fan-out) take the same path as anywhere else.
    _watch.skipqueue_passive = True  # type: ignore[attr-defined]


#: The atomic() depths of a thread outside any block: a worker's executor threads, where
#: nothing but a job's code enters one (`run_and_decide`'s `depths`).
OUTSIDE_ATOMIC: Mapping[str, int] = MappingProxyType({})


def atomic_depths() -> Mapping[str, int]:
    """How deep in atomic() blocks each of this thread's connections is, for those in one,
    read before a job's code runs (2 us: a worker's executor threads pass
    OUTSIDE_ATOMIC instead)."""
    return {c.alias: d for c in initialized_connections() if (d := atomic_depth(c))}


def _roll_back_left_open(depths: Mapping[str, int]) -> None:
    """Roll back every transaction the task left open on this thread, and say so.

    Two ways to leave one: atomic() blocks entered and never exited, on any alias (a
    connection deeper than `depths`, read before the task), or a transaction begun
    behind Django's back (a raw `BEGIN`, or `set_autocommit(False)`), which only the
    server's status shows. Either way the connection is closed (the server rolls back)
    and Django's bookkeeping reset, so the fenced write that follows, and the next job,
    run on a clean connection in autocommit. Raises TransactionLeftOpenError naming
    what was rolled back.
    """
    left = end_open_transactions(depths)
    if left:
        if any(line.startswith(_STILL_RUNNING) for line in left):
            outcome = (
                "the connection was closed: an open transaction's writes were rolled back, "
                "and a statement already running in autocommit may have committed"
            )
        else:
            outcome = "its writes were rolled back"
        raise TransactionLeftOpenError(
            f"the task left a transaction open ({'; '.join(left)}); {outcome}, so this job "
            f"is failed, not retried"
        )


#: How `end_open_transactions` names a statement still running in autocommit (status
#: ACTIVE): a time limit's interrupt right after its send, say. It may commit whatever
#: the connection's close does, so nothing may say it was rolled back.
_STILL_RUNNING = "a statement still running"


def end_open_transactions(depths: Mapping[str, int] | None = None) -> list[str]:
    """Close this thread's connections that the server says are inside a transaction
    Django did not open (outside atomic(): a raw BEGIN in autocommit, autocommit turned
    off by `set_autocommit(False)`, or an alias configured without it) and that wrote
    and did not commit; one line for each. With
    `depths` (`atomic_depths()` before a job), atomic() blocks deeper than those are
    closed and named too, on every alias.

    Closing makes the server roll the transaction back. A connection in atomic() (the
    caller's own transaction, in tests) is left alone. A transaction that wrote nothing
    is ended without a line (`_wrote`), on an alias configured without autocommit too,
    whose code must commit what it writes.
    """
    found = []
    for connection in initialized_connections():
        if depths is not None:
            depth = depths.get(connection.alias, 0)
            if atomic_depth(connection) > depth:
                found.append(
                    f"{atomic_depth(connection) - depth} atomic() block(s) on "
                    f"{connection.alias!r}, entered and never exited"
                )
                discard(connection)
                drop_atomic_blocks(connection, depth)
                continue
        raw = connection.connection
        # With a connection open, Django's `autocommit` attribute is what get_autocommit()
        # returns (its ensure_connection() then does nothing but cost 1.5 us). libpq's
        # status is read as an int, not through psycopg's `info` (a new ConnectionInfo
        # and an enum a read): 5.2 us a job became 1.4 (measured, Python 3.11).
        if raw is None or connection.in_atomic_block:
            continue
        status = _transaction_status(raw)
        if status is None or status == 0:  # IDLE, or a driver that does not say
            continue
        if status not in (1, 2, 3):  # UNKNOWN: the connection is broken, nothing is open
            discard(connection)
            continue
        # Open outside atomic(): a raw BEGIN, autocommit turned off by the task
        # (set_autocommit(False)), or an alias configured without autocommit. A
        # transaction that wrote nothing (no transaction id assigned) is rolled back
        # quietly; one that wrote is rolled back and named: left, it would hold the next
        # jobs' writes on this thread and vanish with them when the connection closes.
        if status == 2 and not _wrote(connection, raw):
            _roll_back_quietly(connection, raw)
            continue
        name = {1: "ACTIVE", 2: "INTRANS", 3: "INERROR"}[status]
        if not connection.settings_dict["AUTOCOMMIT"]:
            how = "on an alias whose AUTOCOMMIT is off"
        elif not connection.autocommit:
            how = "after set_autocommit(False)"
        else:
            how = "outside atomic()"
        if status == 1 and connection.autocommit and connection.settings_dict["AUTOCOMMIT"]:
            found.append(f"{_STILL_RUNNING} in autocommit on {connection.alias!r}, status {name}")
        else:
            found.append(
                f"a transaction left uncommitted {how} on {connection.alias!r}, status {name}"
            )
        discard(connection)
    return found


def _wrote(connection: BaseDatabaseWrapper, raw: Any) -> bool:
    """Whether the open transaction on `raw` wrote (or locked rows): PostgreSQL assigns a
    transaction id only then. True where that cannot be asked (another backend, an error)."""
    if connection.vendor != "postgresql":
        return True
    try:
        with raw.cursor() as cursor:
            cursor.execute("SELECT pg_current_xact_id_if_assigned() IS NOT NULL")
            return bool(cursor.fetchone()[0])
    except Exception:  # noqa: BLE001  (an old server, a broken connection: count it)
        return True


def _roll_back_quietly(connection: BaseDatabaseWrapper, raw: Any) -> None:
    """End a transaction that wrote nothing. An alias configured without autocommit keeps
    its connection (its code opens a transaction with every first query); any other is
    closed, as the task changed how it commits."""
    if connection.settings_dict["AUTOCOMMIT"]:
        discard(connection)
        return
    try:
        raw.rollback()
    except Exception:  # noqa: BLE001
        discard(connection)


def _transaction_status(raw: Any) -> int | None:
    """libpq's PQtransactionStatus of a psycopg connection (0 idle, 1 active, 2 in a
    transaction, 3 in a failed one, 4 unknown). A task may use another alias of another
    backend: SQLite's connection says only whether it is in a transaction (0 or 2);
    another driver's state is not known here (None), and it is left alone."""
    pgconn = getattr(raw, "pgconn", None)
    if pgconn is not None:
        return int(pgconn.transaction_status)
    status = getattr(getattr(raw, "info", None), "transaction_status", None)
    if status is not None:  # psycopg2's
        return int(status)
    in_transaction = getattr(raw, "in_transaction", None)  # sqlite3's
    if isinstance(in_transaction, bool):
        return 2 if in_transaction else 0
    return None


def _is_retryable(task: Task[Any, Any] | None, error: BaseException) -> bool:
    if isinstance(
        error,
        (InvalidJobError, TransactionLeftOpenError, StepMismatchError, SignalTimeoutError),
    ):
        return False  # malformed row or result: another attempt would fail the same way
    if type(error) is TypeError and isinstance(error.__cause__, NotJSONError):
        return False  # a django.tasks Task's result JSON cannot hold (_return_value)
    if is_row_fault(error):
        return False  # the database refused this job's own row or result
    if isinstance(error, UnknownTaskError):
        return True  # a rolling deploy: a newer worker may know the task
    if isinstance(error, (TimeLimitExceeded, SoftTimeLimitExceeded)):
        policy = task.retry_policy if task is not None else default_retry_policy()
        return policy.retry_time_limits  # Celery's default: not retried (core/retry.py)
    return task is None or not isinstance(error, task.non_retryable)
