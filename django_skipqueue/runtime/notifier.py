"""The notifier: LISTEN for enqueues on a worker's own direct connection, and wake it.

One thread a worker. It LISTENs on its queues' channels on a connection of its own (a
session-level feature: never through a transaction pooler), checks once that
notifications really arrive, and sets the worker's wake event on each. If they do not
(LISTEN behind PgBouncer in transaction mode receives nothing, and says nothing), it
warns and ends: the worker polls instead. A lost connection is retried with backoff.

A stopping worker rings the notifier's bell (`interrupt`): the listener waits on its
connection's socket and on the bell together, so the stop does not wait for the next
HALT_CHECK_SECONDS tick. A burst worker's exit is the last step of its drain.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import selectors
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connections

from django_skipqueue.queue import sql
from django_skipqueue.queue.connections import Backoff

logger = logging.getLogger(__name__)

#: How often a quiet listener looks at `halted` by itself: a stop that does not ring
#: the bell (`Notifier.interrupt`) is seen within this.
HALT_CHECK_SECONDS = 0.05


class Notifier:
    """LISTENs for `queues` on `database` and sets `wake` on each notification."""

    def __init__(
        self,
        *,
        database: str,
        queues: Sequence[str],
        wake: threading.Event,
        halted: threading.Event,
        poll_interval: float,
        on_control: Callable[[], None] | None = None,
        on_listening: Callable[[bool], None] | None = None,
        on_keyed: Callable[[], None] | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        self.database = database
        # The worker's stop: once it is set, no LISTEN is started (a burst worker that
        # found nothing to claim stopped while its listener connected, and then LISTENed
        # and sent its self-test for nobody, on a new connection, before it could exit).
        self.stopping = stopping
        self.on_control = on_control  # a queue was paused or resumed (flow.FlowView)
        self.on_listening = on_listening  # LISTEN works now, or stopped working
        self.on_keyed = on_keyed  # jobs with a concurrency key were enqueued
        self.queues = list(queues)
        self.wake = wake
        self.halted = halted
        self.poll_interval = poll_interval
        self._bell: socket.socket | None = None  # the ringing end, while run() listens
        self._bell_lock = threading.Lock()

    def interrupt(self) -> None:
        """Wake the listener at once, after `halted` is set (any thread)."""
        with self._bell_lock:
            if self._bell is not None:
                with contextlib.suppress(OSError):  # full: it has been rung already
                    self._bell.send(b"\0")

    def run(self) -> None:
        """Until `halted` is set, or until it finds that LISTEN does not work here."""
        ringing, bell = socket.socketpair()
        ringing.setblocking(False)
        bell.setblocking(False)
        with self._bell_lock:  # before `halted` is first read: no ring can be missed
            self._bell = ringing
        try:
            self._listen(bell)
        finally:
            with self._bell_lock:
                self._bell = None
            ringing.close()
            bell.close()

    def _listen(self, bell: socket.socket) -> None:
        backoff = Backoff()
        while not self.halted.is_set():
            raw = None
            if self._stopped():
                return
            try:
                wrapper = connections[self.database]
                raw = wrapper.get_new_connection(wrapper.get_connection_params())
                if self._stopped():
                    return  # the connection is closed below
                raw.autocommit = True
                sql.listen(raw, self.queues)
                sql.listen_control(raw)
                if not self.works(raw):
                    logger.warning(
                        "LISTEN does not receive notifications on this connection (a "
                        "transaction pooler such as PgBouncer?); polling every %.1fs instead. "
                        "Point the worker at a direct connection, or set "
                        "SKIPQUEUE['LISTEN'] = False to silence this.",
                        self.poll_interval,
                    )
                    return
                logger.info("worker listening queues=%s", ",".join(self.queues))
                if self.on_listening:
                    self.on_listening(True)  # and read again what we may have missed
                self.wake.set()  # anything enqueued while we were not listening
                backoff.reset()
                # A selector (epoll, kqueue, poll), not select(): a process with over
                # 1,024 files open may get a socket numbered past select()'s limit.
                with selectors.DefaultSelector() as selector:
                    selector.register(raw.fileno(), selectors.EVENT_READ, raw)
                    selector.register(bell, selectors.EVENT_READ, bell)
                    while not self.halted.is_set():
                        if not self._readable(selector, bell):
                            continue  # rung or quiet: look at `halted` again
                        for notify in raw.notifies(timeout=HALT_CHECK_SECONDS, stop_after=1):
                            logger.debug("worker notified channel=%s", notify.channel)
                            if notify.channel == sql.CONTROL_CHANNEL and self.on_control:
                                self.on_control()
                            elif notify.channel == sql.KEYED_CHANNEL and self.on_keyed:
                                self.on_keyed()
                            self.wake.set()
            except Exception as error:  # noqa: BLE001  (psycopg's own errors come raw here)
                if self.on_listening:
                    self.on_listening(False)
                delay = backoff.next()
                logger.warning("listen failed, retrying in %.2fs: %s", delay, error)
                self.halted.wait(delay)
            finally:
                if raw is not None:
                    try:
                        raw.close()
                    except Exception:  # noqa: BLE001, S110  (already broken)
                        pass

    def _stopped(self) -> bool:
        return self.stopping is not None and self.stopping.is_set()

    @staticmethod
    def _readable(selector: selectors.BaseSelector, bell: socket.socket) -> bool:
        """Wait up to HALT_CHECK_SECONDS for the connection's socket or the bell; True if
        the connection has something to read. A ring is emptied out of the bell."""
        readable = False
        for key, _ in selector.select(HALT_CHECK_SECONDS):
            if key.data is bell:
                with contextlib.suppress(BlockingIOError):
                    bell.recv(64)
            else:
                readable = True
        return readable

    def works(self, raw: Any) -> bool:
        """Send a NOTIFY from another connection; through a transaction pooler it never comes.

        From the same connection the test could pass by luck: a pooler may hand that
        connection the very server session its LISTEN ran on. From another one, only a
        session that really stays ours receives it.
        """
        channel = sql.channel_name(self.queues[0])
        payload = f"{sql.SELF_TEST_PAYLOAD}:{secrets.token_hex(8)}"
        try:
            with connections[self.database].cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, %s)", [channel, payload])
        finally:
            connections[self.database].close()  # the notifier keeps only its own session
        for notify in raw.notifies(timeout=2.0):
            if notify.payload == payload:
                return True
            if notify.payload.startswith(sql.SELF_TEST_PAYLOAD):
                continue  # another worker's check (through a pooler, it can reach us)
            self.wake.set()  # a real one arrived meanwhile
        return False
