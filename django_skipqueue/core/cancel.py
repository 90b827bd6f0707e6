"""The flag by which a worker tells a running task that an operator asked it to stop, or
that it ran past its hard time limit, and by which the task hands its progress reports
to the worker."""

from __future__ import annotations


class CancelFlag:
    """Set once a renewal finds an operator's cancel request; read by the task's context.

    A plain flag, not a threading.Event: one is made per claimed job, and an Event
    (a lock and a condition) cost 2 microseconds to make (measured), for a wait that
    nobody does. Setting and reading a bool are atomic under the GIL.
    """

    __slots__ = ("_set", "exceeded", "progress")

    def __init__(self) -> None:
        self._set = False
        #: The hard time limit in seconds, once the worker found the attempt past it
        #: (runtime/timelimits.py): the task's next `check_cancelled()` raises
        #: TimeLimitExceeded, and the attempt ends with it whatever the task returns.
        self.exceeded: float | None = None
        #: The task's latest `context.set_progress()` not yet written: the worker's
        #: housekeeper takes it (at most once a second per job) and writes it through
        #: the fence. Swapping a reference is atomic under the GIL.
        self.progress: dict[str, object] | None = None

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set
