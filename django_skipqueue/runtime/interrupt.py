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
#: only a delivery lowers it. While it is up, a thread running under a tracer (coverage,
#: a debugger) spins at the start of its next Python call, until some thread's pending
#: exception is delivered; after a take-back none is, so it spun for ever. `leave` lowers
#: it by giving its own thread one and catching it, with calls into C only from the
#: take-back on: a Python call in between spun at its start, holding `_lock` (an
#: outside trial, with coverage and with threading.settrace). Untraced code runs at its
#: usual speed either way (measured). 3.10, 3.12 and 3.13 do not.
_TAKING_BACK_RAISES_THE_FLAG = sys.version_info[:2] == (3, 11)

# `PyThreadState_SetAsyncExc(ident, exception)`: how many threads were given `exception`
# to raise (None: take a pending one back). Bound once, so that a call runs no Python
# code: ctypes looks a function up in Python (`CDLL.__getattr__`) on its first use.
_SET_ASYNC_EXC = ctypes.pythonapi.PyThreadState_SetAsyncExc
_THREAD_ID = ctypes.c_ulong


class _Lower(BaseException):
    """Given to the thread itself and caught at once (`leave`)."""


_LOWER = ctypes.py_object(_Lower)


def enter(job_id: int) -> int:
    """This thread starts job `job_id`'s task call: from here `interrupt` may land.
    Returns the thread's ident, for `leave`."""
    ident = threading.get_ident()
    with _lock:  # C calls only while it is held (see _TAKING_BACK_RAISES_THE_FLAG)
        due = _due.pop(ident, None)
        late = due is not None and due[0] == job_id  # past its limit before the call began
        if not late:
            _inside[ident] = job_id
    if late:
        raise TimeLimitExceeded(due[1])  # type: ignore[index]
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
    with _lock:  # C calls only while it is held (see _TAKING_BACK_RAISES_THE_FLAG)
        _inside.pop(ident, None)
        _due.pop(ident, None)
        past = _raised.pop(ident, None)
        if past is not None:
            # Raised and perhaps too late to land: taken back (nothing if it landed).
            _SET_ASYNC_EXC(_THREAD_ID(ident), None)
            if _TAKING_BACK_RAISES_THE_FLAG and not _raised:  # none other outstanding
                try:  # delivered where a C call returns: this one's, or len()'s
                    _SET_ASYNC_EXC(_THREAD_ID(ident), _LOWER)
                    len(_raised)
                except _Lower:
                    pass
    return past


def interrupt(thread: threading.Thread, job_id: int, limit: float) -> bool:
    """Make `thread` raise TimeLimitExceeded (naming `limit`, in seconds) if it is still
    inside job `job_id`'s task call, or as it enters it (`enter`) if it has not yet: a
    slow `job_started` receiver once let the task run with no limit at all. False if
    the interrupt will not be raised, or if the lock is not had within a second (the
    caller, the housekeeper, must not wait on a thread it gives up on)."""
    ident = thread.ident
    exceeded = ctypes.py_object(_exceeded(limit))  # made before the lock: C calls under it
    if ident is None or not _lock.acquire(timeout=1.0):
        return False
    try:
        if _inside.get(ident) != job_id:
            # Not inside the call: before it (raised by `enter`), or past it (the next
            # `enter` or `leave` of this thread drops the mark).
            _due[ident] = (job_id, limit)
            return False
        if _SET_ASYNC_EXC(_THREAD_ID(ident), exceeded) != 1:
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
