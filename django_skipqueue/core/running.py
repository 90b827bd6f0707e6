"""Which job this thread (or task of an event loop) runs now, if any: set by the runner
around a task's call, read by `Job.wait()` and `Workflow.wait()`, which refuse to block
a worker thread on another job (that job may need this very thread: a worker of
`--concurrency 1` waited for ever). Celery refuses the same ("Never call result.get()
within a task"). A ContextVar: an async task's event loop sees it too."""

from __future__ import annotations

from contextvars import ContextVar

RUNNING_JOB: ContextVar[int | None] = ContextVar("skipqueue_running_job", default=None)


def refuse_waiting_in_a_task(what: str, allow_in_task: bool) -> None:
    """RuntimeError if a task is running in this context and did not say `allow_in_task`."""
    running = RUNNING_JOB.get()
    if running is None or allow_in_task:
        return
    raise RuntimeError(
        f"job {running} waits on {what} inside its task: that holds this worker thread "
        "until the other ends, and it may need this very thread (a worker of one thread "
        "waits for ever). Chain them instead (chain(first.s(...), then.s())), or pass "
        "allow_in_task=True if its queue's workers are others."
    )


def checked_timeout(timeout: object) -> float | None:
    """A wait's `timeout`: None, or a number of seconds >= 0 (TypeError or ValueError
    naming the argument otherwise)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if not timeout >= 0:  # NaN fails this too
        raise ValueError(f"timeout must be 0 or more seconds, not {timeout!r}")
    return float(timeout)
