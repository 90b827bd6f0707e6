"""Supervised threads: one that dies is reported and started again; one that returns is not."""

from __future__ import annotations

import threading

from django_skipqueue.runtime.threads import Supervisor
from tests.processes import wait_until


def test_a_thread_that_dies_is_reported_and_started_again():
    halted, runs, died = threading.Event(), [], []

    def loop() -> None:
        runs.append(threading.current_thread())
        if len(runs) == 1:
            raise SystemExit("dies once")  # a BaseException, not an Exception
        halted.wait(10)

    supervisor = Supervisor(halted=halted, died=died.append)
    supervisor.start("helpers", "t", loop)
    try:
        wait_until(lambda: len(runs) == 2, timeout=10)
        assert died == [runs[0]]
        assert supervisor.group("helpers") == [runs[1]]
    finally:
        halted.set()
        supervisor.join_all(within=5)


def test_a_thread_that_returns_is_not_restarted_and_a_retired_one_leaves_its_group():
    halted, runs = threading.Event(), []
    supervisor = Supervisor(halted=halted, died=lambda thread: None)
    thread = supervisor.start("executors", "t", lambda: runs.append(1))
    thread.join(5)
    supervisor.retire(thread)
    assert runs == [1] and supervisor.group("executors") == []


def test_join_all_never_meets_a_member_not_yet_started():
    """A member added by one thread while another joins them all (an executor's
    replacement after a time limit, during the shutdown) was joined before its start,
    and Thread.join raised "cannot join thread before it is started" (seen in CI)."""
    halted, errors = threading.Event(), []
    supervisor = Supervisor(halted=halted, died=lambda thread: None)

    def starting() -> None:
        for n in range(300):
            supervisor.start("executors", f"t{n}", lambda: None)

    starter = threading.Thread(target=starting)
    starter.start()
    try:
        while starter.is_alive():
            try:
                supervisor.join_all(within=0.01)
            except RuntimeError as error:
                errors.append(error)
    finally:
        starter.join(10)
        halted.set()
    assert errors == []
