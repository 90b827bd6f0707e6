"""Durable steps (issue 55): a job that resumes where it stopped.

A task declared with `takes_context=True` calls `context.step(name, fn, ...)`: the first
attempt that reaches the step runs `fn` and records its result (a checkpoint, one row
of skipqueue_step); every later attempt of the job gets the recorded result back
without running `fn`. `context.atomic_step(...)` runs `fn` inside a transaction that
commits the step's writes and its checkpoint together, only while this attempt owns the
job. `context.sleep(...)` records a wake time and gives the job back, pending until
then, without spending an attempt. `context.wait_for(name)` does the same until a
signal of that name, sent in its sender's transaction by `send_signal` (queue/signals.py),
is there to take, or until its timeout.

Steps are keyed by their order in the task: the n-th step an attempt meets must be the
n-th one recorded, with the same name, occurrence (the how-many-th call of that name)
and kind; anything else is code that changed under a job in flight, and the job fails
with StepMismatchError naming both, rather than feed one step's result to another.

The checkpoint is written by RECORD_STEP (queue/steps.sql), fenced as an ack is.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from asgiref.sync import sync_to_async
from django.apps import apps
from django.db import connections

from django_skipqueue import signals
from django_skipqueue.conf import get_settings
from django_skipqueue.core.payload import check_stored_size, encode, normalize
from django_skipqueue.core.states import check_step_name
from django_skipqueue.exceptions import (
    RETRY_DELAY_CEILING_SECONDS,
    InvalidJobError,
    Retry,
    SignalTimeoutError,
    StepLostError,
    StepMismatchError,
)
from django_skipqueue.queue import sql
from django_skipqueue.queue.connections import bounded


class Owner(Protocol):
    """What a step log needs of its attempt (a TaskContext)."""

    @property
    def job_id(self) -> int: ...

    @property
    def attempt(self) -> int: ...

    @property
    def database(self) -> str: ...

    @property
    def task_name(self) -> str: ...

    @property
    def base_atomic_depth(self) -> int: ...

    @property
    def idempotency_key(self) -> str: ...

    def at_step(self) -> None: ...


#: The kinds of step, as recorded (models.StepKind's values).
PLAIN, ATOMIC, SLEEP, SIGNAL = "plain", "atomic", "sleep", "signal"
#: A wait's outcomes, as its step's result says (queue/steps.sql, TAKE_SIGNAL).
WAITING, RECEIVED, TIMED_OUT = "waiting", "received", "timed out"


@dataclass(frozen=True, slots=True)
class Recorded:
    """One recorded step, as an attempt reads it back."""

    position: int
    name: str
    occurrence: int
    kind: str
    result: Any
    #: For a sleep: seconds from the read to its wake time, on the database's clock.
    wake_in: float | None = None


class StepLog:
    """One attempt's walk through its job's steps (made per attempt, in its context)."""

    def __init__(self, context: Owner) -> None:
        self.context = context
        self._recorded: dict[int, Recorded] | None = None  # by position
        self._read_at = 0.0  # time.monotonic() of the read, for the sleeps' wake times
        self._position = 0
        self._seen: dict[str, int] = {}
        #: The step running now: (name, occurrence); `TaskContext.step_key` reads it.
        self.current: tuple[str, int] | None = None
        #: A sleep or wait this attempt met and raised Retry for ("sleep 'nap'"): owed,
        #: so that a task that caught the Retry is stopped at its next step or its return.
        self.owed_sleep: str | None = None

    def meet(self, name: str, kind: str) -> tuple[int, int, Recorded | None]:
        """The next step is `name`: its position, its occurrence, and its record if an
        earlier attempt wrote one (StepMismatchError if that record is another step).
        A step that raised was not recorded: its position stays empty, and a later
        attempt runs it there again."""
        check_step_name(name, "step")
        self._alone(name)
        if self.owed_sleep is not None:
            raise InvalidJobError(
                f"step {name!r} was called after {self.owed_sleep} raised Retry to give the "
                "job back: the task caught it (an `except Exception` around context.sleep "
                "or context.wait_for?); let it propagate"
            )
        recorded = self._read()
        self._position += 1
        occurrence = self._seen[name] = self._seen.get(name, 0) + 1
        found = recorded.get(self._position)
        if found is None:
            return self._position, occurrence, None
        if (found.name, found.occurrence, found.kind) != (name, occurrence, kind):
            raise StepMismatchError(
                self.context.job_id,
                self._position,
                recorded=(found.name, found.occurrence, found.kind),
                met=(name, occurrence, kind),
            )
        return self._position, occurrence, found

    @property
    def key(self) -> str:
        """The running step's idempotency key: the job's, its name and its occurrence."""
        if self.current is None:
            raise RuntimeError("context.step_key is only defined while a step runs")
        name, occurrence = self.current
        return f"{self.context.idempotency_key}:{name}:{occurrence}"

    def wake_in(self, found: Recorded) -> float:
        """Seconds left until a recorded sleep's wake time (<= 0: past)."""
        return (found.wake_in or 0.0) - (time.monotonic() - self._read_at)

    def _alone(self, name: str) -> None:
        if self.current is not None:
            raise InvalidJobError(
                f"step {name!r} was called while step {self.current[0]!r} runs: steps run "
                "one after another at the task's own level (not inside another step's "
                "function, not concurrently, as with asyncio.gather); make the inner "
                "work part of the outer step, or a step of its own after it"
            )

    @contextmanager
    def running(self, name: str, occurrence: int) -> Iterator[None]:
        self._alone(name)  # an async step that began while another one ran
        self.current = (name, occurrence)
        try:
            yield
        finally:
            self.current = None

    def record(
        self, position: int, name: str, occurrence: int, kind: str, result: Any, seconds: float
    ) -> Any:
        """Write the checkpoint through the fence, and return the result as stored (what
        a replay returns: jsonb's key order, -0.0 as 0.0). StepLostError if this attempt
        no longer owns the job (nothing written)."""
        context = self.context
        with connections[context.database].cursor() as cursor:
            cursor.execute(
                sql.RECORD_ATOMIC_STEP if kind == ATOMIC else sql.RECORD_STEP,
                {
                    "job": context.job_id,
                    "attempt": context.attempt,
                    "position": position,
                    "name": name,
                    "occurrence": occurrence,
                    "kind": kind,
                    "seconds": max(seconds, 0.0),
                    "result": encode(result),
                },
            )
            row = cursor.fetchone()
        if row is None:
            raise StepLostError(context.job_id, context.attempt, name)
        return _loaded(row[1])

    def take_signal(self, position: int, name: str) -> tuple[Any, float | None]:
        """Look for the signal the wait at `position` waits on (TAKE_SIGNAL): the wait's
        outcome if this look decided it (its step's result: received or timed out;
        None: still waiting), and the seconds left to its timeout (None: none).
        StepLostError if this attempt no longer owns the job."""
        context = self.context
        with connections[context.database].cursor() as cursor:
            cursor.execute(
                sql.TAKE_SIGNAL,
                {
                    "job": context.job_id,
                    "attempt": context.attempt,
                    "position": position,
                    "name": name,
                },
            )
            row = cursor.fetchone()
        if row is None:
            raise StepLostError(context.job_id, context.attempt, name)
        outcome, left = row
        return _loaded(outcome), left

    def recorded(self, name: str, kind: str) -> None:
        """Say a step was recorded (signals.step_recorded: the metrics count it)."""
        self._send(signals.step_recorded, name, kind)

    def replayed(self, found: Recorded) -> Any:
        """Say a step was replayed (signals.step_replayed); its recorded result."""
        self._send(signals.step_replayed, found.name, found.kind)
        return found.result

    def _send(self, signal: Any, name: str, kind: str) -> None:
        if signal.receivers:  # the sender is the Job class, as for the job signals
            context = self.context
            job = apps.get_model("skipqueue", "Job")
            signal.send(job, job_id=context.job_id, task=context.task_name, name=name, kind=kind)

    def _read(self) -> dict[int, Recorded]:
        if self._recorded is None:
            with connections[self.context.database].cursor() as cursor:
                cursor.execute(sql.STEPS_OF, [self.context.job_id])
                rows = cursor.fetchall()
            self._read_at = time.monotonic()
            # Django's psycopg loaders hand jsonb over as its text (fields decode it).
            self._recorded = {
                position: Recorded(position, name, occurrence, kind, _loaded(result), wake_in)
                for position, name, occurrence, kind, result, wake_in in rows
            }
        return self._recorded


def _loaded(text: Any) -> Any:
    return json.loads(text) if isinstance(text, str) else text


def checked_result(value: Any, name: str) -> Any:
    """A step's return value as JSON data within SKIPQUEUE['MAX_PAYLOAD_BYTES'], or
    InvalidJobError naming the step: a result, stored by the same rules as a job's."""
    what = f"step {name!r}'s return value"
    result = normalize(value, what)
    check_stored_size(result, what)
    return result


def run_step(
    steps: StepLog, name: str, fn: Callable[..., Any], args: Any, kwargs: Any, *, atomic: bool
) -> Any:
    kind = ATOMIC if atomic else PLAIN
    position, occurrence, found = steps.meet(name, kind)
    if found is not None:
        return steps.replayed(found)
    steps.context.at_step()  # a cancel request or a time limit stops the job here
    started = time.monotonic()
    with steps.running(name, occurrence):
        if not atomic:
            result = checked_result(fn(*args, **kwargs), name)
            result = steps.record(
                position, name, occurrence, kind, result, time.monotonic() - started
            )
        else:
            with bounded(steps.context.database):
                result = checked_result(fn(*args, **kwargs), name)
                seconds = time.monotonic() - started
                result = steps.record(position, name, occurrence, kind, result, seconds)
    steps.recorded(name, kind)
    return result


async def run_step_async(
    steps: StepLog, name: str, fn: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """`run_step` of a plain step for async code: `fn` may be a coroutine function; the
    record is read and written in the task's thread (sync_to_async), as the job's."""
    position, occurrence, found = await sync_to_async(steps.meet)(name, PLAIN)
    if found is not None:
        return steps.replayed(found)
    steps.context.at_step()
    started = time.monotonic()
    with steps.running(name, occurrence):
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):
            value = await value
    result = checked_result(value, name)
    seconds = time.monotonic() - started
    record = sync_to_async(steps.record)
    result = await record(position, name, occurrence, PLAIN, result, seconds)
    steps.recorded(name, PLAIN)
    return result


def sleep(steps: StepLog, name: str, duration: timedelta | float) -> None:
    seconds = _seconds(duration, f"sleep {name!r}: the duration")
    _outside_transaction(steps, f"sleep {name!r}")
    position, occurrence, found = steps.meet(name, SLEEP)
    if found is None:
        steps.record(position, name, occurrence, SLEEP, {"seconds": seconds}, 0.0)
        steps.recorded(name, SLEEP)
        left = seconds
    else:
        steps.replayed(found)
        left = steps.wake_in(found)
    if left > 0:
        _park(steps, f"sleep {name!r}", SLEEP, name, left)


def wait_for(steps: StepLog, name: str, timeout: timedelta | float | None) -> Any:
    """A wait for the signal `name` (`send_signal`): its payload, once one is there to
    take; until then, the job is given back (parked) without spending an attempt, and
    woken by the signal's commit or at the timeout. SignalTimeoutError past the timeout.
    The outcome is recorded with the step: every later attempt replays it."""
    seconds = None if timeout is None else _seconds(timeout, f"wait_for {name!r}: the timeout")
    _outside_transaction(steps, f"wait_for {name!r}")
    position, occurrence, found = steps.meet(name, SIGNAL)
    outcome = None
    if found is None:
        waiting = {"outcome": WAITING, "timeout": seconds}
        steps.record(position, name, occurrence, SIGNAL, waiting, 0.0)
        steps.recorded(name, SIGNAL)
    elif found.result.get("outcome") != WAITING:
        outcome = steps.replayed(found)
    if outcome is None:
        outcome, left = steps.take_signal(position, name)
        if outcome is None:
            delay = RETRY_DELAY_CEILING_SECONDS if left is None else max(left, 0.0)
            _park(steps, f"wait_for {name!r}", SIGNAL, name, delay)
    if outcome["outcome"] == TIMED_OUT:
        raise SignalTimeoutError(steps.context.job_id, name, outcome.get("timeout"))
    return outcome.get("payload")


def _park(steps: StepLog, what: str, kind: str, name: str, seconds: float) -> None:
    """Give the job back until `seconds` from now, parked on the step `name`."""
    steps.owed_sleep = what
    reason = f"{what}: parked for {seconds:g}s" if kind == SLEEP else f"{what}: parked"
    retry = Retry(seconds, reason, spend_attempt=False)
    retry.park = (kind, name)
    raise retry


def _seconds(value: object, what: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not 0 <= seconds <= RETRY_DELAY_CEILING_SECONDS
    ):
        raise InvalidJobError(
            f"{what} must be a timedelta or seconds from 0 to "
            f"{RETRY_DELAY_CEILING_SECONDS:g} (a hundred years), got {value!r}"
        )
    return float(seconds)


def _outside_transaction(steps: StepLog, what: str) -> None:
    if len(connections[steps.context.database].atomic_blocks) > steps.context.base_atomic_depth:
        raise InvalidJobError(
            f"{what} inside transaction.atomic(): the Retry that gives the job back would "
            "roll its record back, and the job would park again at every wake-up; call it "
            "outside the block"
        )


def send_signal(job_id: int, name: str, payload: Any = None, *, using: str | None = None) -> int:
    """Send the signal `name`, with `payload`, to the durable job `job_id`, in the
    caller's transaction: its `context.wait_for(name)` returns the payload once this
    commits (`Job.objects.send_signal`, queue/signals.py, says the rest)."""
    job = apps.get_model("skipqueue", "Job")
    alias = using or get_settings().DATABASE_ALIAS
    return int(job.objects.db_manager(alias).send_signal(job_id, name, payload))
