"""SIGTERM and SIGINT, handled outside the signal handler.

Python runs a signal handler in the main thread, between two bytecodes of whatever the
main thread was doing. If that was the inside of `threading.Event.set`, `.clear` or
`.wait` (they hold the Event's lock, a plain `Lock`), a handler that calls `.set()` on
the same Event waits for a lock its own thread holds: the process hangs for good. A
worker's dispatcher clears and waits on its wake Event all the time, so a SIGTERM
landing there left a worker that never stopped (seen under load in CI).

So the handler here takes no lock: it writes the signal's number to a pipe, and a
daemon thread ("skipqueue-signals") reads the pipe and calls the callback, where
Events, logging and connections are safe to use.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger("django_skipqueue.runtime.worker")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Call `callback(signum)` from a thread for each SIGTERM/SIGINT the process gets.

    `install()` must run in the main thread (Python's rule for `signal.signal`);
    `restore()` puts the previous handlers back and ends the thread.
    """

    def __init__(self, callback: Callable[[int], None]) -> None:
        self.callback = callback
        self._previous: dict[int, object] = {}
        self._read = self._write = -1
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignals.install() must be called from the main thread")
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._thread = threading.Thread(target=self._relay, name="skipqueue-signals", daemon=True)
        self._thread.start()
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        # A pool's child starts with them blocked (pool.WorkerPool._spawn): from here on
        # they are handled, so let them in (one that came meanwhile is handled now).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    @contextmanager
    def handling(self) -> Iterator[None]:
        """Install for the block when this is the main thread (a command run by
        call_command from another thread leaves the process's handlers alone), then
        restore."""
        if threading.current_thread() is threading.main_thread():
            self.install()
        try:
            yield
        finally:
            self.restore()

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._write >= 0:
            os.close(self._write)  # the thread reads end-of-file and returns
            self._write = -1
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a system call here: no lock, no logging, no allocation worth naming.
        try:
            os.write(self._write, bytes([signum]))
        except OSError:  # the pipe is closed (restored) or full (a flood of signals)
            pass

    def _relay(self) -> None:
        try:
            while chunk := os.read(self._read, 64):
                for signum in chunk:
                    try:
                        self.callback(signum)
                    except Exception:
                        logger.exception("stop signal %d: the handler failed", signum)
        finally:
            os.close(self._read)
