"""TaskContext: what a task that takes a context sees of its job (ids, attempt,
cancel and time-limit checks, progress, a lease extension), and `progress_report`."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async

from django_skipqueue.core.payload import storable_text
from django_skipqueue.core.states import (
    idempotency_key_of,
)
from django_skipqueue.exceptions import (
    InvalidJobError,
    JobCancelled,
    SoftTimeLimitExceeded,
    TimeLimitExceeded,
)
from django_skipqueue.tasks import durable
from django_skipqueue.tasks.options import validate_lease
from django_skipqueue.tasks.registry import registry

if TYPE_CHECKING:
    from django_skipqueue.core.cancel import CancelFlag


#: A job's progress is written at most once per this many seconds, whatever the task
#: calls (`TaskContext.set_progress`).
PROGRESS_WRITE_SECONDS = 1.0
#: The longest progress note kept, in characters.
PROGRESS_NOTE_MAX_CHARS = 200


def progress_report(done: object, total: object = None, note: object = "") -> dict[str, Any]:
    """A progress report as stored in `Job.progress`, or TypeError / ValueError naming
    what is wrong with it."""
    for name, value in (("done", done), ("total", total)):
        if value is None and name == "total":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"set_progress(): {name} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"set_progress(): {name} must be a finite number >= 0, got {value}")
    if not isinstance(note, str):
        raise TypeError(f"set_progress(): note must be a str, got {type(note).__name__}")
    if len(note) > PROGRESS_NOTE_MAX_CHARS:
        raise ValueError(
            f"set_progress(): note is {len(note)} characters; at most "
            f"{PROGRESS_NOTE_MAX_CHARS} are kept"
        )
    return {"done": done, "total": total, "note": storable_text(note)}


@dataclass(frozen=True)
class TaskContext:
    """What a task declared with `takes_context=True` receives as its first argument."""

    job_id: int
    attempt: int
    max_attempts: int
    task_name: str
    queue_name: str
    database: str
    #: Set by the worker when its lease renewal finds a cancel request (None when the
    #: job runs outside a worker: then the row is read).
    cancel_event: CancelFlag | None = dataclasses.field(default=None, repr=False, compare=False)
    #: The job came from RabbitMQ (a relayed queue): no row holds a lease, the broker
    #: holds the message until it is acknowledged.
    brokered: bool = dataclasses.field(default=False, repr=False, compare=False)
    #: The process clock (time.monotonic) at the task's soft and hard time limits.
    soft_deadline: float | None = dataclasses.field(default=None, repr=False, compare=False)
    hard_deadline: float | None = dataclasses.field(default=None, repr=False, compare=False)
    #: How many atomic() blocks the job's connection was in when the task was called (a
    #: test's own, under `run_jobs`): a durable sleep refuses blocks deeper than those.
    base_atomic_depth: int = dataclasses.field(default=0, repr=False, compare=False)

    @property
    def time_left(self) -> float | None:
        """Seconds until the soft time limit (the hard one if there is no soft one), at
        least 0; None when the task has neither."""
        deadline = self.soft_deadline if self.soft_deadline is not None else self.hard_deadline
        if deadline is None:
            return None
        return max(deadline - time.monotonic(), 0.0)

    def _past_soft_limit(self) -> None:
        if self.soft_deadline is not None and time.monotonic() >= self.soft_deadline:
            task = registry.get(self.task_name) if self.task_name in registry else None
            limit = task.soft_time_limit if task is not None else None
            raise SoftTimeLimitExceeded(self.job_id, limit.total_seconds() if limit else 0.0)

    @property
    def idempotency_key(self) -> str:
        """Stable across every attempt of this job: hand it to external services."""
        return idempotency_key_of(self.job_id)

    # -- durable steps (tasks/durable.py, docs/howto/durable-jobs.md) ---------------------

    def step(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` as the job's next step and record its result (JSON,
        under the result rules), unless an earlier attempt of this job recorded it:
        then return that result without calling `fn`. At least once: an attempt that
        dies between the call and the record runs it again; `step_key` is stable across
        those runs, for the idempotency keys of external calls."""
        return durable.run_step(self._steps, name, fn, args, kwargs, atomic=False)

    def atomic_step(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """`step()` whose `fn` runs inside a transaction that also writes the step's
        record, and commits only if this attempt still owns the job (the ack's fence,
        proved in SQL at the end): the database writes of `fn` happen once per job,
        whatever crashes, freezes or expired leases come between. A stale attempt's
        transaction rolls back whole (StepLostError)."""
        return durable.run_step(self._steps, name, fn, args, kwargs, atomic=True)

    def sleep(self, name: str, duration: timedelta | float) -> None:
        """A durable sleep: record its wake time (the database's now + `duration`) and
        give the job back, pending until then, without spending an attempt (Retry with
        `spend_attempt=False`, raised here: do not catch it). No thread, lease or
        connection is held while it sleeps; a worker restart or deploy does not shorten
        or lose it. The attempt that wakes goes on after this call."""
        durable.sleep(self._steps, name, duration)

    def wait_for(self, name: str, timeout: timedelta | float | None = None) -> Any:
        """A durable wait for the signal `name`: the payload of the oldest signal of that
        name sent to this job (`send_signal`, kept if it came before the wait), each
        signal taken by one wait. Until one is there, the job is given back, pending and
        parked, without spending an attempt (Retry, raised here: do not catch it); the
        sender's commit makes it due at once. Past `timeout` (None: none), counted from
        the first time an attempt met the wait, raises SignalTimeoutError here, which the
        task may catch. The outcome is recorded: every later attempt gets it back."""
        return durable.wait_for(self._steps, name, timeout)

    async def astep(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """`step()` for an async task: `fn` may be a coroutine function."""
        return await durable.run_step_async(self._steps, name, fn, args, kwargs)

    async def aatomic_step(
        self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> Any:
        """`atomic_step()` for an async task: `fn` is a plain function (the ORM's
        transactions are synchronous), run in the task's thread."""
        return await sync_to_async(self.atomic_step)(name, fn, *args, **kwargs)

    async def asleep(self, name: str, duration: timedelta | float) -> None:
        """`sleep()` for an async task."""
        await sync_to_async(self.sleep)(name, duration)

    async def await_for(self, name: str, timeout: timedelta | float | None = None) -> Any:
        """`wait_for()` for an async task."""
        return await sync_to_async(self.wait_for)(name, timeout)

    def owed_sleep(self) -> None:
        """InvalidJobError if a durable sleep or wait of this attempt raised Retry and the task
        returned anyway (it caught the Retry): the runner's check after the task."""
        steps = self.__dict__.get("_steps")
        if steps is not None and steps.owed_sleep is not None:
            raise InvalidJobError(
                f"the task returned after {steps.owed_sleep} raised Retry to give the job "
                "back: it caught the Retry (an `except Exception` around context.sleep or "
                "context.wait_for?); let it propagate"
            )

    @property
    def step_key(self) -> str:
        """While a step runs: a key stable across every run of this step of this job
        (the job's idempotency key, the step's name and occurrence)."""
        return self._steps.key

    @functools.cached_property
    def _steps(self) -> durable.StepLog:
        if self.brokered:
            raise InvalidJobError(
                "durable steps need the job's row, which records them: a job of a queue "
                "relayed to RabbitMQ has none; run durable tasks on a queue that is not "
                "relayed"
            )
        return durable.StepLog(self)

    @property
    def is_last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts

    def extend_lease(
        self, seconds: timedelta | float | None = None, *, lease: timedelta | float | None = None
    ) -> bool:
        """Push this attempt's lease to at least now + `seconds` (default: the job's lease).

        Never shortens it, and the worker's own renewals never shorten what this set.
        Fenced like an ack: False means this attempt no longer owns the job, and the
        task should stop; its result would be refused. Raises JobCancelled if an
        operator cancelled the job. `lease=` is the older name.
        """
        from django_skipqueue.models import Job
        from django_skipqueue.queue.base import Renewal

        if seconds is not None and lease is not None:
            raise TypeError("extend_lease() takes seconds or lease, not both")
        wanted = validate_lease(seconds if seconds is not None else lease, "seconds")
        if self.brokered:
            return True  # the broker redelivers only if this consumer's connection dies
        jobs = Job.objects.db_manager(self.database)
        renewal = jobs.renewal(self.job_id, self.attempt, wanted)
        if renewal is Renewal.CANCEL_REQUESTED:
            self._cancelled()
        return renewal is Renewal.RENEWED

    def set_progress(self, done: float, total: float | None = None, note: str = "") -> None:
        """Report how far this attempt has come: `done` of `total` (None: unknown),
        and a short `note` ("page 3 of 40").

        Cheap to call in a tight loop, from sync or async code: it only hands the latest
        report over. A worker writes it at most once a second per job, from its
        housekeeping thread, through the fence (only the attempt that holds the lease
        can write it), and the last one when the attempt ends; outside a worker
        (`testing.run_jobs`) the last one is written when the attempt ends. It shows in
        the admin, in `queuestats --json` and in `job.progress`. A relayed queue's job
        has no lease in the table: its progress is not recorded.
        """
        report = progress_report(done, total, note)
        if self.brokered or self.cancel_event is None:
            return
        self.cancel_event.progress = report

    @property
    def cancel_requested(self) -> bool:
        """Whether an operator asked this job to stop. In a worker, as its last lease
        renewal found (within a third of the lease); outside one, read from the row."""
        if self.cancel_event is not None:
            return self.cancel_event.is_set()
        return self._cancel_in_row()

    def check_cancelled(self) -> None:
        """The task's safe point: raise JobCancelled if an operator asked this job to
        stop (reads the row now), TimeLimitExceeded once the task's `time_limit` has
        passed, or SoftTimeLimitExceeded once its `soft_time_limit` has."""
        flagged = self.cancel_event is not None and self.cancel_event.is_set()
        if not flagged and self._cancel_in_row():
            self._cancelled()
        self.at_step()  # the flag, then the limits

    def at_step(self) -> None:
        """A durable step's safe point (tasks/durable.py), before a step that runs: as
        `check_cancelled()`, but reading no row (a worker's cancel flag, the deadlines),
        so that a step costs no round trip for it."""
        if self.cancel_event is not None and self.cancel_event.is_set():
            self._cancelled()
        self._past_hard_limit()
        self._past_soft_limit()

    def _past_hard_limit(self) -> None:
        exceeded = self.cancel_event.exceeded if self.cancel_event is not None else None
        if exceeded is None and self.hard_deadline is not None:
            if time.monotonic() >= self.hard_deadline:
                task = registry.get(self.task_name) if self.task_name in registry else None
                limit = task.time_limit if task is not None else None
                exceeded = limit.total_seconds() if limit is not None else 0.0
        if exceeded is not None:
            raise TimeLimitExceeded(exceeded)

    def _cancel_in_row(self) -> bool:
        from django_skipqueue.models import Job

        return Job.objects.db_manager(self.database).cancel_requested(self.job_id, self.attempt)

    def _cancelled(self) -> None:
        if self.cancel_event is not None:
            self.cancel_event.set()
        raise JobCancelled(self.job_id)
