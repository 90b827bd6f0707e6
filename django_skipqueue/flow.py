"""A worker's view of flow control: which of its queues are paused, which are limited.

`FlowView` is the one owner of that state in a worker. The dispatcher asks it which
queues to claim from; the notifier tells it when a NOTIFY on the control channel says
that a queue was paused or resumed; without one, it reads the queue table again at
least every REFRESH_SECONDS (the polling fallback). Reading it costs one query on the
small queue table, at most once a second, so the default path keeps its speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from django_skipqueue.limits import QueueLimit

#: The longest a worker goes without reading the queue table: a pause reaches every
#: worker within this, NOTIFY or not.
REFRESH_SECONDS = 1.0
#: How often a worker whose claims are fast-path only still looks for keyed jobs,
#: while the fast path keeps it busy (keyed jobs are not starved by plain ones).
KEYED_CHECK_SECONDS = 0.25


class FlowView:
    """Paused and limited queues, as one worker sees them. Safe from any thread."""

    def __init__(
        self,
        *,
        queues: Sequence[str],
        limits: dict[str, QueueLimit],
        read_paused: Callable[[Sequence[str]], set[str]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.queues = list(queues)
        self.limits = {name: limit for name, limit in limits.items() if name in self.queues}
        self._read_paused = read_paused
        self._clock = clock
        self._lock = threading.Lock()
        self._paused: set[str] = set()
        self._read_at = -float("inf")
        self._stale = True
        self._keyed_at = -float("inf")

    def changed(self) -> None:
        """A NOTIFY said a queue was paused or resumed: read again before the next claim."""
        with self._lock:
            self._stale = True

    def paused(self) -> set[str]:
        """The paused queues among ours, read again if stale (raises what the read raises)."""
        now = self._clock()
        with self._lock:
            due = self._stale or now - self._read_at >= REFRESH_SECONDS
            if due:
                self._stale = False  # a NOTIFY that lands during the read marks it again
        if due:
            found = self._read_paused(self.queues)
            with self._lock:
                self._paused, self._read_at = set(found), now
        with self._lock:
            return set(self._paused)

    def plan(self) -> tuple[list[str], list[str]]:
        """(queues for the fast path: not paused, not limited; queues for the limited
        path: not paused, limited)."""
        paused = self.paused()
        active = [name for name in self.queues if name not in paused]
        return (
            [name for name in active if name not in self.limits],
            [name for name in active if name in self.limits],
        )

    def keyed_check_due(self, *, busy: bool) -> bool:
        """Whether to claim keyed jobs before plain ones now: while the fast path keeps
        every claim full (`busy`), every KEYED_CHECK_SECONDS."""
        if not busy:
            return False
        now = self._clock()
        with self._lock:
            if now - self._keyed_at >= KEYED_CHECK_SECONDS:
                self._keyed_at = now
                return True
            return False
