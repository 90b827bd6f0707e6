"""Supervised threads: a worker's threads, started again when one dies.

No thread of a worker may die silently (docs/explanation/protocol.md, "Faults"): a dead
housekeeper would stop renewals and heartbeats, a dead executor would hold its job for
ever. A thread whose loop raises is reported to `died` and started again after a short
pause (no tight loop if it dies at once again); a loop that returns (at shutdown, or a
notifier that falls back to polling) is not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

logger = logging.getLogger(__name__)

#: The pause before a thread that died is started again.
RESTART_DELAY_SECONDS = 0.5


class Supervisor:
    """Starts named daemon threads in groups; restarts any that dies until `halted`."""

    def __init__(
        self, *, halted: threading.Event, died: Callable[[threading.Thread], None]
    ) -> None:
        self.halted = halted
        self.died = died
        self._groups: dict[str, list[threading.Thread]] = {}
        self._lock = threading.Lock()

    def group(self, name: str) -> list[threading.Thread]:
        """The live members of a group (a copy)."""
        with self._lock:
            return list(self._groups.get(name, ()))

    def start(self, group: str, name: str, target: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(
            target=self._run, args=(group, name, target), name=name, daemon=True
        )
        # Started under the lock: `join_all` (at shutdown, from another thread) never
        # sees a member not started yet, which Thread.join refuses with a RuntimeError
        # (seen in CI: an executor's replacement, after a time limit, met the shutdown).
        # start() only waits for the new thread's bootstrap, which takes no lock of ours.
        with self._lock:
            self._groups.setdefault(group, []).append(thread)
            thread.start()
        return thread

    def retire(self, thread: threading.Thread) -> None:
        """A thread ends on purpose (another took its place): no longer a member."""
        with self._lock:
            for members in self._groups.values():
                if thread in members:
                    members.remove(thread)

    def join_all(self, *, within: float, skip: Collection[threading.Thread] = ()) -> None:
        """Wait for every member but `skip`, all together at most `within` seconds."""
        until = time.monotonic() + within
        with self._lock:
            threads = [thread for members in self._groups.values() for thread in members]
        for thread in threads:
            if thread in skip:
                continue
            thread.join(timeout=max(until - time.monotonic(), 0))

    def _run(self, group: str, name: str, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException:  # noqa: BLE001  (whatever it was, the thread is gone)
            me = threading.current_thread()
            logger.exception("thread died thread=%s", name)
            self.retire(me)
            self.died(me)
            if not self.halted.wait(RESTART_DELAY_SECONDS):
                self.start(group, name, target)
