"""A worker's view of flow control: which of its queues are paused, which are limited.

`FlowView` is the one owner of that state in a worker. The dispatcher asks it which
queues to claim from; the notifier tells it when a NOTIFY on the control channel says
that a queue was paused or resumed; without one, no claim uses a reading older than
REFRESH_SECONDS (the polling fallback). The reading is one query on the small queue
table; a busy worker makes it after handing its claimed jobs over (`refresh_soon`),
so that it never sits between a NOTIFY of a new job and that job's claim.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from django_skipqueue.conf.limits import QueueLimit
from django_skipqueue.core.spec import RATE_KEY_PREFIX

#: The longest a worker that does not receive NOTIFY goes without reading the queue
#: table: a pause reaches every worker within this.
REFRESH_SECONDS = 1.0
#: The same for a worker whose LISTEN works (each pause and resume wakes it at once;
#: this is only a safety net).
LISTENING_REFRESH_SECONDS = 30.0
#: How often a worker whose claims are fast-path only still looks for keyed jobs,
#: while the fast path keeps it busy (keyed jobs are not starved by plain ones).
KEYED_CHECK_SECONDS = 0.25
#: How often the housekeeper looks for keyed jobs that no NOTIFY announced (those of
#: a schedule, those whose run_after came, those a limit held back).
KEYED_PROBE_SECONDS = 1.0


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
        self._plan = self._split(self._paused)
        self._read_at = -float("inf")
        self._stale = True
        self._keyed_at = -float("inf")
        self._max_age = REFRESH_SECONDS
        self._keyed_waiting = True  # keyed jobs may be due: look at the first claim
        self._probed_at = -float("inf")

    def keyed_arrived(self) -> None:
        """A NOTIFY said jobs with a concurrency key were enqueued (the notifier's thread)."""
        with self._lock:
            self._keyed_waiting = True

    def note_keyed(self, waiting: bool) -> None:
        """What a keyed claim or a probe found: whether keyed jobs still wait."""
        with self._lock:
            self._keyed_waiting = waiting

    def holds_slot(self, job: Any) -> bool:
        """Whether `job` takes a slot of a concurrency limit (its key's, or its queue's):
        such a job keeps its lease, and so its slot, while its code can still run, even
        past its timeout or after a cancel request (docs/explanation/failure-model.md,
        H15 and H23); given away, the slot would let a second run start beside it."""
        if job.concurrency_key is not None:
            # A rate-limited task's own key limits nothing: no slot to keep.
            return not job.concurrency_key.startswith(RATE_KEY_PREFIX)
        limit = self.limits.get(job.queue_name)
        return limit is not None and limit.concurrency is not None

    def keyed_waiting(self) -> bool:
        """Whether keyed jobs may be due: the dispatcher then runs the keyed claim."""
        with self._lock:
            return self._keyed_waiting

    def keyed_probe_due(self) -> bool:
        """For the housekeeper: whether to probe for keyed jobs now (once a period)."""
        now = self._clock()
        with self._lock:
            if now - self._probed_at >= KEYED_PROBE_SECONDS:
                self._probed_at = now
                return True
            return False

    def listening(self, works: bool) -> None:
        """The notifier's LISTEN works (NOTIFY brings every pause at once) or stopped
        working (then poll, and read again now: a NOTIFY may have been missed)."""
        with self._lock:
            self._max_age = LISTENING_REFRESH_SECONDS if works else REFRESH_SECONDS
            self._stale = True

    def changed(self) -> None:
        """A NOTIFY said a queue was paused or resumed: read again before the next claim."""
        with self._lock:
            self._stale = True

    def paused(self) -> set[str]:
        """The paused queues among ours: read again first if a NOTIFY said so or the
        last reading is REFRESH_SECONDS old (raises what the read raises)."""
        self._read_if(older_than=self._max_age)
        with self._lock:
            return set(self._paused)

    def refresh_soon(self) -> None:
        """Read again if the last reading is half a refresh old: called off the claim's
        path, so that a busy worker's claims rarely wait for a reading."""
        self._read_if(older_than=self._max_age / 2)

    def _read_if(self, *, older_than: float) -> None:
        now = self._clock()
        with self._lock:
            due = self._stale or now - self._read_at >= older_than
            if due:
                self._stale = False  # a NOTIFY that lands during the read marks it again
        if due:
            found = set(self._read_paused(self.queues))
            plan = self._split(found)
            with self._lock:
                self._paused, self._plan, self._read_at = found, plan, now

    def plan(self) -> tuple[list[str], list[str]]:
        """(queues for the fast path: not paused, not limited; queues for the limited
        path: not paused, limited). Made once per reading (a claim asks for it every
        time): the lists are shared, not to be changed."""
        self._read_if(older_than=self._max_age)
        with self._lock:
            return self._plan

    def _split(self, paused: set[str]) -> tuple[list[str], list[str]]:
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
