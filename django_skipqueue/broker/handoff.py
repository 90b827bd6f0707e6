"""What a broker consumer's threads share: the one owner of that state, with one lock.

The consuming thread (pika's connection is not thread-safe, so only it acks, publishes
and settles) hands deliveries to a pool; pool threads hand their verdicts back. Between
them pass: the deliveries held (each with the time by which it must be acked or given
back, and whether a thread started it), finished deliveries waiting to be settled,
whether a wake-up of the consuming thread is already on its way, and how many pool
threads are inside a task. A delivery is settled once: by its verdict, or by the
consuming thread when it is overdue (`overdue`), never both. Every method takes the
lock; none does I/O or calls user code, except `finish`, which calls the wake-up
function after releasing it.

Counters only the consuming thread touches (deliveries running) stay in
the consumer. The process clock is passed in (`now`): it only schedules deadlines.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from django_skipqueue.broker.isolation import Crashed
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
    given_up: bool = False  # settled as timed out while its task still ran
    deliveries: int = 0  # deliveries of its message before this one without an ack
    #: Run in a process of its own, which ended without a verdict (`isolation.py`).
    crashed: Crashed | None = None


@dataclass
class Held:
    """A delivery the consumer holds unacked: waiting for a thread, or running. Its times
    are the process clock's, counted from the delivery, as the broker counts its
    consumer timeout (`consumer.Consumer._overdue`)."""

    message: Message
    #: Deliveries so far without an ack (what a copy published in its place carries).
    deliveries: int
    #: When it came. Not started by `hand_back_at`, it is given back, never started.
    came: float
    hand_back_at: float
    #: Running at `give_up_at` (the broker's timeout near), its attempt is timed out.
    give_up_at: float
    #: Past it, its task's own timeout ended the attempt (None: no timeout, or not
    #: started yet).
    deadline: float | None = None
    started_at: float | None = None
    isolated: bool = False  # run in a process of its own (`isolation.py`)

    @property
    def started(self) -> bool:
        return self.started_at is not None

    @property
    def due(self) -> float:
        """When it is past its time: given back if not started by then, else timed out
        at its give-up time or its task's deadline, whichever comes first."""
        if not self.started:
            return self.hand_back_at
        return self.give_up_at if self.deadline is None else min(self.give_up_at, self.deadline)

    @property
    def by_broker(self) -> bool:
        """A running one times out by the broker's timeout, unless its task's came first."""
        return self.deadline is None or self.give_up_at < self.deadline


@dataclass(frozen=True)
class Overdue:
    """What `Handoff.overdue` found past its time."""

    #: Not started: to be published again as a fresh copy (keeping its count), then acked.
    unstarted: list[tuple[int, Held]]
    #: Running past its task's timeout, or near the broker's consumer timeout: its
    #: attempt is settled as timed out; the thread's later verdict is dropped.
    running: list[tuple[int, Held, bool]]  # (tag, held, by the broker's timeout)


class Handoff:
    """Held deliveries, finished ones, the pending wake-up and busy threads, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: list[Done] = []
        self._held: dict[Delivery, Held] = {}
        self._wake_pending = False
        self._wake: Callable[[], None] = lambda: None
        self._busy = 0
        #: Running deliveries given up on (`overdue`) whose thread has not returned:
        #: when each was given up on.
        self._abandoned: dict[Delivery, float] = {}
        self._soonest = float("inf")  # no held delivery is due before this

    def connected(self, wake: Callable[[], None]) -> None:
        """A new connection: `wake` asks its consuming thread for a turn (thread-safe);
        what was held for the old one is dropped (its tags died with it: RabbitMQ
        delivers those messages again, so a thread that has not started one skips it)."""
        with self._lock:
            self._done.clear()
            self._held.clear()
            self._soonest = float("inf")
            self._wake_pending = False
            self._wake = wake

    def lost(self) -> None:
        """The connection is gone: nothing held for it can be acked any more."""
        self.connected(lambda: None)

    def hold(self, delivery: Delivery, held: Held) -> None:
        """The consuming thread hands `delivery` to the pool."""
        with self._lock:
            self._held[delivery] = held
            self._soonest = min(self._soonest, held.hand_back_at)

    def start(self, delivery: Delivery, timeout: float | None, now: float) -> bool:
        """A pool thread is about to run `delivery`: False if it must not (the thread
        skips it): no longer held (given back, or its connection is gone), or held so
        long that it is to be given back (`overdue` does that, in the consuming thread)
        rather than started with little of the broker's timeout left. `timeout`: the
        task's own."""
        with self._lock:
            held = self._held.get(delivery)
            if held is None or now >= held.hand_back_at:
                return False
            held.started_at = now
            self._soonest = min(self._soonest, held.give_up_at)
            if timeout is not None:
                held.deadline = now + timeout
                self._soonest = min(self._soonest, held.deadline)
            self._busy += 1
            return True

    def finish(self, done: Done) -> bool:
        """A pool thread's verdict on a delivery it started. False (dropped) if the
        delivery was settled already (timed out) or its connection is gone. Wakes the
        consuming thread unless a wake-up is on its way."""
        with self._lock:
            self._busy -= 1
            self._abandoned.pop((done.generation, done.tag), None)
            if self._held.pop((done.generation, done.tag), None) is None:
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

    def overdue(self, generation: int, now: float) -> Overdue:
        """The held deliveries of this connection past their time, each returned once
        (no longer held: a thread skips an unstarted one, and `finish` drops a running
        one's verdict)."""
        unstarted: list[tuple[int, Held]] = []
        running: list[tuple[int, Held, bool]] = []
        with self._lock:
            if now < self._soonest:
                return Overdue(unstarted, running)
            soonest = float("inf")
            for delivery, held in list(self._held.items()):
                if delivery[0] != generation:
                    continue
                if now < held.due:
                    soonest = min(soonest, held.due)
                    continue
                del self._held[delivery]
                if not held.started:
                    unstarted.append((delivery[1], held))
                else:
                    running.append((delivery[1], held, held.by_broker))
                    self._abandoned[delivery] = now
            self._soonest = soonest
        return Overdue(unstarted, running)

    def holds(self, delivery: Delivery) -> bool:
        """Whether `delivery` is still held (not settled as timed out, not given back)."""
        with self._lock:
            return delivery in self._held

    def abandoned_since(self) -> float | None:
        """When the first running delivery still inside its task was given up on (None:
        every such thread returned)."""
        with self._lock:
            return min(self._abandoned.values(), default=None)

    def unstarted(self, generation: int) -> list[tuple[int, Held]]:
        """The held deliveries of this connection no thread started, taken (a thread that
        reaches one later skips it): a stopping consumer gives them back."""
        with self._lock:
            taken = [(d, h) for d, h in self._held.items() if d[0] == generation and not h.started]
            for delivery, _ in taken:
                del self._held[delivery]
        return [(delivery[1], held) for delivery, held in taken]

    def busy(self) -> int:
        """Pool threads inside a task now, of any connection (a thread whose connection
        died runs its task to the end)."""
        with self._lock:
            return self._busy

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
