"""What a broker consumer's threads share: the one owner of that state, with one lock.

The consuming thread (pika's connection is not thread-safe, so only it acks, publishes
and settles) hands deliveries to a pool; pool threads hand their verdicts back. Between
them pass: finished deliveries waiting to be settled, whether a wake-up of the consuming
thread is already on its way, and the deadlines of deliveries whose task has a timeout
(a delivery settled as timed out must not be settled again when its thread returns).
Every method takes the lock; none does I/O or calls user code, except `finish`, which
calls the wake-up function after releasing it.

Counters only the consuming thread touches (deliveries running, suspects held) stay in
the consumer. The process clock is passed in (`now`): it only schedules timeouts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django_skipqueue.broker.message import Message
    from django_skipqueue.runtime.executor import Verdict

logger = logging.getLogger(__name__)

#: A delivery on one connection: (generation, delivery tag). Tags start again at 1 on
#: each connection, so the connection's generation is part of the name.
Delivery = tuple[int, int]


@dataclass
class Done:
    """A finished delivery, handed from a pool thread to the consuming thread."""

    generation: int  # the connection it came on: tags of a closed one cannot be acked
    tag: int
    message: Message
    verdict: Verdict


class Handoff:
    """Finished deliveries, the pending wake-up and timeout deadlines, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: list[Done] = []
        self._deadlines: dict[Delivery, tuple[float, Message]] = {}
        self._wake_pending = False
        self._wake: Callable[[], None] = lambda: None

    def connected(self, wake: Callable[[], None]) -> None:
        """A new connection: `wake` asks its consuming thread for a turn (thread-safe);
        what was held for the old one is dropped (its tags died with it)."""
        with self._lock:
            self._done.clear()
            self._deadlines.clear()
            self._wake_pending = False
            self._wake = wake

    def lost(self) -> None:
        """The connection is gone: nothing held for it can be acked any more."""
        self.connected(lambda: None)

    def timed(self, delivery: Delivery, deadline: float, message: Message) -> None:
        """A delivery whose task has a timeout starts; past `deadline` it is given up."""
        with self._lock:
            self._deadlines[delivery] = (deadline, message)

    def finish(self, done: Done, *, timed: bool) -> bool:
        """A pool thread's verdict. False (dropped) if the delivery was already settled
        as timed out. Wakes the consuming thread unless a wake-up is on its way."""
        delivery = (done.generation, done.tag)
        with self._lock:
            if timed and self._deadlines.pop(delivery, None) is None:
                return False
            self._done.append(done)
            wake, self._wake_pending = not self._wake_pending, True
            waker = self._wake
        if wake:
            try:
                waker()
            except Exception as error:  # noqa: BLE001  (the connection closed meanwhile)
                logger.debug("broker consumer: no wake-up for a finished job: %r", error)
        return True

    def expired(self, generation: int, now: float) -> list[tuple[int, Message]]:
        """The deliveries of this connection past their deadline, each returned once (its
        thread's later verdict is then dropped by `finish`); deadlines of older
        connections are forgotten."""
        found = []
        with self._lock:
            for delivery, (deadline, message) in list(self._deadlines.items()):
                if delivery[0] != generation:
                    del self._deadlines[delivery]
                elif now >= deadline:
                    del self._deadlines[delivery]
                    found.append((delivery[1], message))
        return found

    def settle_here(self, done: Done) -> None:
        """A verdict the consuming thread reached itself (a timeout): no wake-up needed."""
        with self._lock:
            self._done.append(done)

    def drain(self) -> list[Done]:
        """Every verdict waiting, in order. A verdict handed over after this wakes the
        consuming thread again (the pending flag is cleared with the same lock)."""
        with self._lock:
            done, self._done = self._done, []
            self._wake_pending = False
        return done

    def waiting(self) -> int:
        """How many verdicts wait to be settled (for tests and logs)."""
        with self._lock:
            return len(self._done)
