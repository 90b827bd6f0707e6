"""stopsignals.StopSignals: SIGTERM handled in a thread, never inside the Event's lock.

The first child process does what the worker's dispatcher does all the time (clear its
wake Event and wait on it) while the test sends it SIGTERM after SIGTERM. A handler that
called `Event.set()` itself hung such a process now and then (about one signal in a
hundred, when it landed inside the Event's lock); with `StopSignals` every signal reaches
the callback. The second child makes that landing certain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from django_skipqueue.runtime.stopsignals import StopSignals
from tests.processes import REPO_ROOT

SIGNALS_WANTED = 300

CHILD = f"""
import signal
import threading
from django_skipqueue.runtime.stopsignals import StopSignals

wake = threading.Event()
done = threading.Event()
received = []

def on_signal(signum):
    received.append(signum)
    wake.set()
    if len(received) >= {SIGNALS_WANTED}:
        done.set()

StopSignals(on_signal).install()
print("ready", flush=True)
while not done.is_set():
    wake.clear()
    wake.wait(0.00001)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the test may still be sending them
print("stopped", len(received), flush=True)
"""


def test_a_flood_of_sigterms_never_hangs_a_process_spinning_on_an_event():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20
        while child.poll() is None and time.monotonic() < deadline:
            child.send_signal(signal.SIGTERM)
            time.sleep(0.001)
        assert child.poll() is not None, "the child hung: a signal was lost or deadlocked"
        out, _ = child.communicate()
        word, count = out.split()
        # One more may reach the callback between `done` and SIG_IGN: not fewer.
        assert word == "stopped" and int(count) >= SIGNALS_WANTED
        assert child.returncode == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


# The deadlock made certain: the main thread holds the Event's lock (as inside `Event.wait`)
# when the signal is handled. A handler that called `wake.set()` hangs here every time.
INSIDE_THE_LOCK = """
import os, signal, threading, time
from django_skipqueue.runtime.stopsignals import StopSignals

wake = threading.Event()
StopSignals(lambda signum: wake.set()).install()
with wake._cond:  # what Event.wait holds between its bytecodes
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # the handler runs here, at the next check for signals
print("woken" if wake.wait(5) else "not woken", flush=True)
"""


def test_a_signal_handled_while_the_main_thread_holds_the_events_lock_still_wakes_it():
    child = subprocess.run(
        [sys.executable, "-c", INSIDE_THE_LOCK],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert (child.returncode, child.stdout.strip()) == (0, "woken"), child.stderr


def test_the_callback_runs_in_its_own_thread_and_restore_puts_the_old_handler_back():
    calls: list[tuple[int, str]] = []
    arrived = threading.Event()

    def on_signal(signum: int) -> None:
        calls.append((signum, threading.current_thread().name))
        arrived.set()

    before = signal.getsignal(signal.SIGINT)
    stop_signals = StopSignals(on_signal)
    stop_signals.install()
    thread = stop_signals._thread
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert arrived.wait(5)
    finally:
        stop_signals.restore()
    assert calls == [(signal.SIGINT, "skipqueue-signals")]
    assert signal.getsignal(signal.SIGINT) is before
    assert thread is not None and not thread.is_alive()  # (a worker's may live on: its own)


def test_install_refuses_a_thread_other_than_the_main_one():
    errors: list[BaseException] = []

    def install() -> None:
        try:
            StopSignals(lambda signum: None).install()
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert "main thread" in str(errors[0])


def test_a_callback_that_raises_is_logged_and_later_signals_still_arrive(caplog):
    signum = signal.SIGTERM
    calls: list[int] = []
    second = threading.Event()

    def on_signal(number: int) -> None:
        calls.append(number)
        if len(calls) == 1:
            raise ValueError("boom")
        second.set()

    stop_signals = StopSignals(on_signal)
    stop_signals.install()
    try:
        os.kill(os.getpid(), signum)
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signum)
        assert second.wait(5)
    finally:
        stop_signals.restore()
    assert calls == [signum, signum]
    assert "the handler failed" in caplog.text
