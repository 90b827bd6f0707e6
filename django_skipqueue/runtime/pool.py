"""`runworker --processes N`: N worker processes under one parent, past one core.

One worker process is one core (the GIL). The parent forks N children once Django is
set up and before it holds a database connection; each child runs its own Worker, with
its own connections and its own WorkerProcess row, and applies `--max-memory` and
`--max-jobs` to itself. The parent only supervises:
- SIGTERM or SIGINT is passed to every child, which drains as a single worker does
  (jobs in flight get the grace period); a second signal is passed on too, and the
  children exit at once. The parent exits when the last child has.
- A child that exits while the pool runs (it crashed, was killed, or reached its job
  or memory limit) is replaced. One that exits within a second of starting is replaced
  after a growing delay (1 s doubling to 30 s), so a child that cannot start does not
  spin. In `--burst` mode children are not replaced: each exits when no due job is left.
- A parent that dies without passing a signal on (SIGKILL) takes its children with it:
  on Linux each child gets SIGTERM then (PR_SET_PDEATHSIG) and drains.

Fork, not spawn: a child starts with the parent's imported code at no cost, and the
parent has no threads and no open connections when it forks (POSIX only).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from types import FrameType

from django.db import connections

from django_skipqueue.runtime.stopsignals import STOP_SIGNALS

logger = logging.getLogger("django_skipqueue.runtime.worker")

#: A child that exits sooner than this after its start counts as failing to start.
QUICK_EXIT_SECONDS = 1.0
MAX_RESTART_DELAY = 30.0


def stop_with_parent() -> None:
    """Linux: SIGTERM this child when the parent dies (SIGKILLed, say), so that no worker
    runs on unsupervised; it then drains like any stopped worker. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class WorkerPool:
    """Runs `run_child()` in `processes` forked children until stopped (see module doc)."""

    def __init__(
        self,
        processes: int,
        run_child: Callable[[], int],
        *,
        replace: bool = True,
        helper: Callable[[], int] | None = None,
        in_child: Callable[[int], None] | None = None,
    ) -> None:
        if processes < 1:
            raise ValueError(f"processes must be at least 1, got {processes}")
        self.processes = processes
        self.run_child = run_child
        self.replace = replace
        self.children: dict[int, float] = {}  # pid: when it started (monotonic)
        #: pid: its slot, 0 to processes - 1; a replacement takes the slot of the child
        #: it replaces. `in_child(slot)` runs in each new child before its worker (the
        #: metrics' files are the slot's, so the pool's stay bounded).
        self.slots: dict[int, int] = {}
        self.in_child = in_child
        self.stopping = False
        self.replaced = 0
        self._restart_delay = QUICK_EXIT_SECONDS
        #: One more child that runs no jobs (the metrics server of `--metrics-port`):
        #: replaced if it exits, stopped when the last worker child has exited.
        self.helper = helper
        self.helper_pid: int | None = None
        self._helper_delay = QUICK_EXIT_SECONDS

    def run(self) -> int:
        """Start the children and supervise them; 0 when every child stopped cleanly."""
        connections.close_all()  # no connection may be shared with a child
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        for slot in range(self.processes):
            self._spawn(slot)
        if self.helper is not None:
            self.helper_pid = self._fork(self.helper)
        logger.info(
            "worker pool started processes=%d pids=%s",
            self.processes,
            ",".join(map(str, self.children)),
        )
        failed = False
        while self.children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            if pid == self.helper_pid:
                self._replace_helper(pid, os.waitstatus_to_exitcode(status))
                continue
            started = self.children.pop(pid, None)
            slot = self.slots.pop(pid, 0)
            if started is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            if self.stopping or not self.replace:
                failed |= code != 0
                continue
            self._replace(pid, code, time.monotonic() - started, slot)
        self._stop_helper()
        logger.info("worker pool stopped replaced=%d", self.replaced)
        return 1 if failed else 0

    def _replace(self, pid: int, code: int, lived: float, slot: int) -> None:
        how = f"exited with {code}" if code >= 0 else f"was killed by signal {-code}"
        if lived < QUICK_EXIT_SECONDS:
            delay = self._restart_delay
            self._restart_delay = min(self._restart_delay * 2, MAX_RESTART_DELAY)
            logger.warning(
                "worker child pid=%d %s %.1fs after it started; replacing it in %.0fs",
                pid,
                how,
                lived,
                delay,
            )
            deadline = time.monotonic() + delay
            while not self.stopping and time.monotonic() < deadline:
                time.sleep(min(0.1, deadline - time.monotonic()))
            if self.stopping:
                return
        else:
            self._restart_delay = QUICK_EXIT_SECONDS
            log = logger.info if code == 0 else logger.error
            log("worker child pid=%d %s; replacing it", pid, how)
        self.replaced += 1
        self._spawn(slot)

    def _replace_helper(self, pid: int, code: int) -> None:
        """The helper exited while the pool runs: started again after a delay that
        doubles (1 s to MAX_RESTART_DELAY) while it keeps exiting, as a failing child's."""
        self.helper_pid = None
        if self.stopping or self.helper is None:
            return
        delay = self._helper_delay
        self._helper_delay = min(self._helper_delay * 2, MAX_RESTART_DELAY)
        logger.warning(
            "pool helper pid=%d exited with %d; starting it again in %.0fs", pid, code, delay
        )
        deadline = time.monotonic() + delay
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.1, deadline - time.monotonic()))
        if not self.stopping:
            self.helper_pid = self._fork(self.helper)

    def _stop_helper(self) -> None:
        pid, self.helper_pid = self.helper_pid, None
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def _spawn(self, slot: int) -> None:
        pid = self._fork(self.run_child, slot)
        self.children[pid] = time.monotonic()
        self.slots[pid] = slot

    def _fork(self, run: Callable[[], int], slot: int | None = None) -> int:
        # The child starts with SIGTERM and SIGINT blocked, and the worker unblocks them
        # once its handlers are in place (stopsignals.StopSignals.install): a signal the
        # parent forwards meanwhile waits for them, instead of killing a child that has
        # not started (which the pool counted as a failed stop).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        pid = os.fork()
        if pid != 0:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if pid == 0:  # the child: run one worker, then leave without the parent's exit
            code = 1
            try:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(signum, signal.SIG_DFL)  # the worker installs its own
                # A process group of its own: a signal sent to the parent's group (a
                # terminal's Ctrl-C, `timeout`, `kill -- -PGID`) reaches the parent
                # only, which passes it on once. In the parent's group, a child got it
                # twice, took the second for "exit now", and left its jobs to the reaper.
                os.setpgid(0, 0)
                stop_with_parent()
                if run is not self.run_child:  # a helper installs no handlers: default
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
                elif self.in_child is not None and slot is not None:
                    self.in_child(slot)
                code = run()
            except BaseException:  # noqa: BLE001  (a child never returns into the parent's code)
                traceback.print_exc()
            finally:
                logging.shutdown()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        return pid

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        # Not the helper: the metrics go on being served while the children drain; it
        # is stopped once the last of them has exited.
        for pid in list(self.children):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
