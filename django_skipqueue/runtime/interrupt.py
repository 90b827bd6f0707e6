"""Raising TimeLimitExceeded into a task's thread past its hard time limit.

Python cannot stop a thread, but CPython can make one raise an exception at its next
bytecode (`PyThreadState_SetAsyncExc`): a task looping in Python code stops there; one
blocked in a C call (a socket read without a timeout, `time.sleep`) only when that call
returns. It must never land in the worker's own code (in the middle of an ack, holding
a lock of `InFlight`), so it is only raised while the thread is inside a task's call,
which `enter()` and `leave()` mark, and one that has not landed yet when the call ends
is taken back by `leave()`. The mark and the raise take the same lock.

Both are inside `runner.run_and_decide`'s handling of what a task raises, so an
interrupt that lands is recorded as that attempt's failure, through the fence.
"""

from __future__ import annotations

import ctypes
import sys
import threading

from django_skipqueue.exceptions import TimeLimitExceeded

_lock = threading.Lock()
_inside: dict[int, int] = {}  # thread ident -> the id of the job whose task it runs
#: thread ident -> the limit of an interrupt raised into its current task call (by
#: thread, not job id: two threads may run two attempts of one job, one given up on).
_raised: dict[int, float] = {}
#: thread ident -> (job id, limit): a limit that fell before the thread entered the job's
#: task call (its `job_started` receivers were still running): raised by `enter`.
_due: dict[int, tuple[int, float]] = {}


#: CPython 3.11: taking an interrupt back (`PyThreadState_SetAsyncExc(ident, NULL)`) raises
#: the interpreter's flag for a pending asynchronous exception as giving one does, and
#: only a delivery lowers it. Left up, a thread running under a tracer (coverage, a
#: debugger) spins for ever at its next call (tests/test_time_limits.py); untraced code
#: runs at its usual speed (measured). 3.10, 3.12 and 3.13 do not.
_TAKING_BACK_RAISES_THE_FLAG = sys.version_info[:2] == (3, 11)


class _Lower(BaseException):
    """Given to the thread itself and caught at once (`_lower_the_flag`)."""


def _lower_the_flag() -> None:
    """Deliver an exception to this thread and catch it: a delivery lowers the flag a
    take-back left up (`_TAKING_BACK_RAISES_THE_FLAG`). Raised where the C call that
    gives it returns, or at the start of `_checkpoint` at the latest; no loop in
    between, where CPython may find no handler for it."""
    try:
        _set_async_exc(threading.get_ident(), _Lower)
        _checkpoint()
    except _Lower:
        pass


def _checkpoint() -> None:
    """A Python call: the start of its frame is a place where a pending exception lands."""


def _set_async_exc(ident: int, exception: type[BaseException] | None) -> int:
    """How many threads were given `exception` to raise (None: take a pending one back)."""
    value = ctypes.py_object(exception) if exception is not None else None
    return int(ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), value))


def enter(job_id: int) -> int:
    """This thread starts job `job_id`'s task call: from here `interrupt` may land.
    Returns the thread's ident, for `leave`."""
    ident = threading.get_ident()
    with _lock:
        due = _due.pop(ident, None)
        if due is not None and due[0] == job_id:  # past its limit before the call began
            raise TimeLimitExceeded(due[1])
        _inside[ident] = job_id
    return ident


def leave(ident: int, job_id: int) -> float | None:
    """The task call of `enter` ended (returned or raised): from here no interrupt lands.
    Returns the limit of an interrupt raised into it (None if none was): the attempt
    ends as TimeLimitExceeded whatever came out of the task, another exception that
    code on the way turned it into, or a return after catching it.

    Two functions, not a context manager: a generator's `with` cost 3.9 us a job with
    the separate take of the limit, these two 1.1 us (measured, Python 3.11). The lock
    is the first thing taken here, so the stretch where an interrupt could land in this
    code is as short as the context manager's exit was."""
    with _lock:
        _inside.pop(ident, None)
        _due.pop(ident, None)
        past = _raised.pop(ident, None)
        if past is not None:
            # Raised and perhaps too late to land: taken back (nothing if it landed).
            _set_async_exc(ident, None)
            if _TAKING_BACK_RAISES_THE_FLAG and not _raised:  # none other outstanding
                _lower_the_flag()
    return past


def interrupt(thread: threading.Thread, job_id: int, limit: float) -> bool:
    """Make `thread` raise TimeLimitExceeded (naming `limit`, in seconds) if it is still
    inside job `job_id`'s task call, or as it enters it (`enter`) if it has not yet: a
    slow `job_started` receiver once let the task run with no limit at all. False if
    the interrupt will not be raised, or if the lock is not had within a second (the
    caller, the housekeeper, must not wait on a thread it gives up on)."""
    ident = thread.ident
    if ident is None or not _lock.acquire(timeout=1.0):
        return False
    try:
        if _inside.get(ident) != job_id:
            # Not inside the call: before it (raised by `enter`), or past it (the next
            # `enter` or `leave` of this thread drops the mark).
            _due[ident] = (job_id, limit)
            return False
        if _set_async_exc(ident, _exceeded(limit)) != 1:
            return False
        _raised[ident] = limit
        return True
    finally:
        _lock.release()


def _exceeded(limit: float) -> type[TimeLimitExceeded]:
    """CPython raises an exception class (made without arguments), not an instance: a
    subclass of TimeLimitExceeded that names `limit`, recorded under the same name."""

    class Exceeded(TimeLimitExceeded):
        def __init__(self) -> None:
            super().__init__(limit)

    Exceeded.__name__ = Exceeded.__qualname__ = TimeLimitExceeded.__qualname__
    Exceeded.__module__ = TimeLimitExceeded.__module__
    return Exceeded
