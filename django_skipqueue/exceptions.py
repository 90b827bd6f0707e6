"""Exceptions raised by django-skipqueue, and `Retry`, which tasks raise."""

from __future__ import annotations

from datetime import timedelta


class SkipQueueError(Exception):
    """Base class of every error django-skipqueue raises."""


class ConfigurationError(SkipQueueError):
    """A task or setting is declared in a way that cannot work."""


class UnknownTaskError(SkipQueueError, LookupError):
    """A job names a task that is not registered in this process."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"no task named {name!r} is registered in this process; register it with "
            f"@task in an installed app's tasks module or in SKIPQUEUE['TASK_MODULES']"
        )
        self.name = name


class LeaseExpiredError(SkipQueueError):
    """Recorded (not raised) when the reaper takes back an attempt whose lease ran out."""


class TransactionLeftOpenError(SkipQueueError):
    """A task returned with a transaction still open; it was rolled back."""


class InvalidJobError(SkipQueueError, ValueError):
    """An enqueue was refused before anything was written: bad arguments or options."""


class NotJSONError(InvalidJobError, TypeError):
    """A value of a type JSON cannot hold (an argument, a key, a return value). Also a
    TypeError, as Django documents for task arguments. `kind` is the refused type."""

    def __init__(self, message: str, *, kind: type | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class SignalTimeoutError(SkipQueueError):
    """A durable wait (`context.wait_for`) saw no signal before its timeout: raised inside
    the task at the wait, which may catch it and go on (every later attempt of the job
    meets it there again: the timeout is recorded). Uncaught, the job fails at once, not
    retried: a retry would replay the same timeout. Not a TimeoutError: an `except
    TimeoutError` around a network call must not swallow it."""

    def __init__(self, job_id: int, name: str, timeout: float | None) -> None:
        super().__init__(
            f"job {job_id}: no signal {name!r} came within the wait's timeout ({timeout or 0:g}s)"
        )
        self.job_id = job_id
        self.name = name
        self.timeout = timeout


class SignalNotSentError(SkipQueueError, LookupError):
    """`send_signal` found no job that could take the signal (finished, relayed, or not
    there): nothing was written, and the caller's transaction is still usable."""


class StepMismatchError(SkipQueueError):
    """A durable task met another step where an earlier attempt of its job recorded one
    (its code changed under a job in flight): the job fails at once, not retried, rather
    than hand one step's recorded result to another. docs/howto/durable-jobs.md says how
    to change a durable task's code safely. Not a ValueError: an `except ValueError` in
    the task would hide it."""

    def __init__(
        self,
        job_id: int,
        position: int,
        *,
        recorded: tuple[str, int, str],
        met: tuple[str, int, str],
    ) -> None:
        def said(step: tuple[str, int, str]) -> str:
            name, occurrence, kind = step
            return f"{kind} step {name!r} (occurrence {occurrence})"

        super().__init__(
            f"job {job_id}: step {position} was recorded as {said(recorded)}, and this "
            f"attempt met {said(met)} there: the task's code changed under the job. Restart "
            f"the job from step {position} (the admin's action, or "
            f"Job.objects.restart_from_step) once the code is what it should be"
        )
        self.job_id = job_id
        self.position = position
        self.recorded = recorded
        self.met = met


class StepLostError(SkipQueueError):
    """A step's checkpoint was refused: this attempt no longer owns its job (its lease
    ran out and the reaper took it back, or an operator acted). An atomic step's writes
    were rolled back with it. Let it propagate: the attempt's outcome is refused by the
    same fence, and the job's current attempt goes on from the last recorded step."""

    def __init__(self, job_id: int, attempt: int, step: str) -> None:
        super().__init__(
            f"job {job_id}: attempt {attempt} no longer owns the job; step {step!r} was not "
            "recorded"
        )
        self.job_id = job_id
        self.attempt = attempt


class DuplicateJobError(SkipQueueError):
    """An enqueue with `on_conflict="raise"` met an unfinished job of the task holding its
    unique key. Nothing was written for it, and the caller's transaction goes on."""

    def __init__(self, task: str, key: str, existing_id: int | None) -> None:
        held = f"job {existing_id}" if existing_id is not None else "a job"
        super().__init__(f"{task}: unique key {key!r} is held by {held}, not finished yet")
        self.task = task
        self.key = key
        self.existing_id = existing_id


class WorkflowFailed(SkipQueueError):  # noqa: N818  (named like Celery's and Django's)
    """A workflow's result was asked for, and the workflow ended failed or cancelled:
    names the job that failed (`job_id`, None for an operator's cancel) and its error."""

    def __init__(self, workflow_id: int, job_id: int | None, error: str) -> None:
        which = f"job {job_id}" if job_id is not None else "an operator"
        super().__init__(f"workflow {workflow_id} did not finish: {which}: {error}")
        self.workflow_id = workflow_id
        self.job_id = job_id
        self.error = error


class JobFailed(SkipQueueError):  # noqa: N818  (named like WorkflowFailed)
    """A job waited on (`Job.wait()`) ended failed or cancelled: its id, task and state,
    its last error ("module.Type: message") and who cancelled it."""

    def __init__(
        self, job_id: int, task: str, state: str, error: str, *, cancelled_by: str = ""
    ) -> None:
        if state == "cancelled":
            what = f"was cancelled by {cancelled_by or 'an operator'}"
        else:
            what = f"failed: {error or 'no error was recorded'}"
        super().__init__(f"job {job_id} ({task}) {what}")
        self.job_id = job_id
        self.task = task
        self.state = state
        self.error = error
        self.cancelled_by = cancelled_by


class WorkflowNotFinished(SkipQueueError):  # noqa: N818
    """A workflow's result was asked for while it still runs (use `wait()`)."""

    def __init__(self, workflow_id: int) -> None:
        super().__init__(f"workflow {workflow_id} is still running; wait() for it")
        self.workflow_id = workflow_id


class QueueFullError(SkipQueueError):
    """An enqueue was refused: the queue holds SKIPQUEUE['MAX_PENDING_PER_QUEUE'] pending jobs.

    Not an InvalidJobError: the call itself is fine and may succeed later, so a task
    that meets it is retried with backoff like any other failure.
    """


class JobCancelled(SkipQueueError):  # noqa: N818  (a control-flow signal, like Retry)
    """Raised in a task whose job an operator cancelled: by `TaskContext.extend_lease()`
    and `TaskContext.check_cancelled()`. Let it propagate (or raise it yourself): the
    job ends cancelled and is never retried."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"job {job_id} was cancelled by an operator")
        self.job_id = job_id


class SoftTimeLimitExceeded(SkipQueueError):  # noqa: N818  (Celery's name)
    """Raised in a task past its `soft_time_limit`, at its safe point,
    `TaskContext.check_cancelled()`. Catch it to clean up and
    return or re-raise; left out of the task, the attempt fails, not retried unless its
    RetryPolicy says `retry_time_limits` (Celery's default)."""

    def __init__(self, job_id: int, seconds: float) -> None:
        super().__init__(f"job {job_id} ran past its soft time limit of {seconds:g}s")
        self.job_id = job_id


class TimeLimitExceeded(BaseException):  # noqa: N818  (Celery's name)
    """The attempt ran past its task's `time_limit` (the hard limit). Raised in the task
    at its safe point, `TaskContext.check_cancelled()` (and at an async task's next
    await); nothing is ever raised into a thread from outside. A task whose code does
    not stop within a second of the limit makes its worker process exit (code 3) to be
    replaced. A BaseException, as KeyboardInterrupt is, so that `except Exception` in the
    task does not swallow it. The attempt fails through the fence, not retried unless
    its RetryPolicy says `retry_time_limits` (Celery's default)."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__(f"the task ran past its time limit of {seconds:g}s")


#: The longest delay a Retry keeps (a hundred years), before any setting applies.
RETRY_DELAY_CEILING_SECONDS = 100 * 365 * 24 * 3600.0


class Retry(Exception):  # noqa: N818  (a control-flow signal, like Celery's Retry)
    """Raise from a task to run it again after `delay` (seconds or a timedelta).

    By default the attempt counts, as Celery's `self.retry(countdown=...)` counts against
    `max_retries`: the job is pending again after `delay` if an attempt is left, else it
    ends failed, the Retry (and the exception it was raised `from`) recorded as the
    attempt's error; a retry is never lost to the backoff policy, which does not apply.

    With `spend_attempt=False` the attempt is given back instead: the job's
    `max_attempts` is raised by one (the attempt counter is the fence and never goes
    down) and nothing is recorded as an error, so a task can wait for something (a rate
    limit, a file not there yet) as often as it needs.
    """

    def __init__(
        self, delay: float | timedelta = 0, reason: str = "", *, spend_attempt: bool = True
    ) -> None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        if not seconds >= 0:  # also rejects NaN
            raise InvalidJobError(f"Retry delay must be zero or positive seconds, got {delay!r}")
        if not isinstance(spend_attempt, bool):
            raise InvalidJobError(
                f"Retry spend_attempt must be True or False, got {spend_attempt!r}"
            )
        super().__init__(reason or f"retry requested in {seconds:g}s")
        # Held to what a timedelta can hold; the release clamps it further, to
        # SKIPQUEUE['MAX_DELAY_SECONDS'].
        self.delay = timedelta(seconds=min(seconds, RETRY_DELAY_CEILING_SECONDS))
        self.reason = reason
        self.spend_attempt = spend_attempt
        #: Set by a durable sleep or wait (tasks/durable.py), never by a task: what the
        #: released job is parked on (ParkedOn's value, the step's name).
        self.park: tuple[str, str] | None = None
