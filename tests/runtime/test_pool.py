"""`runworker --processes N`: real parent and child processes on the test database."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from django_skipqueue.models import Job, JobState, WorkerProcess
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import Run

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def children(worker) -> list[int]:
    return [child.pid for child in psutil.Process(worker.pid).children()]


def test_each_child_has_its_own_worker_row_and_every_job_runs_once(start_worker):
    tasks.record.enqueue_many([((), {})] * 200)
    worker = start_worker("--processes", "2", "--concurrency", "2")
    wait_until(lambda: Job.objects.filter(state=JobState.DONE).count() == 200, timeout=60)

    pids = children(worker)
    rows = WorkerProcess.objects.alive()
    assert len(pids) == 2 and worker.pid not in pids
    assert sorted(rows.values_list("pid", flat=True)) == sorted(pids)
    assert set(Run.objects.values_list("pid", flat=True)) <= set(pids)
    assert Run.objects.count() == 200  # each job ran once
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0


def test_one_sigterm_drains_every_child(start_worker):
    tasks.record.enqueue_many([((), {"sleep": 1.0})] * 4)
    worker = start_worker("--processes", "2", "--concurrency", "2", "--grace", "10")
    wait_until(lambda: Run.objects.count() == 4, timeout=30)
    pids = children(worker)

    worker.signal(signal.SIGTERM)

    assert worker.wait(timeout=15) == 0
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.DONE}
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in pids)  # fmt: skip
    assert not WorkerProcess.objects.alive().exists()  # each child marked itself stopped
    assert worker.output().count("worker stopped reason=signal SIGTERM") == 2


def test_a_child_that_dies_is_replaced_and_its_jobs_are_taken_back(start_worker):
    tasks.record.using(lease=1.0).enqueue_many([((), {"sleep": 30})] * 2)
    worker = start_worker("--processes", "2", "--reap-interval", "0.2")
    wait_until(lambda: Run.objects.count() == 2, timeout=30)
    victim = Run.objects.first().pid
    before = set(children(worker))

    os.kill(victim, signal.SIGKILL)

    wait_until(lambda: len(set(children(worker)) - before) == 1, timeout=15)
    assert len(children(worker)) == 2 and victim not in children(worker)
    assert "was killed by signal 9" in worker.output()
    wait_until(lambda: Run.objects.count() == 3, timeout=30)  # its job ran again elsewhere
    assert WorkerProcess.objects.alive().count() == 3  # the dead one's row is not renewed
    worker.signal(signal.SIGTERM)  # the jobs sleep 30 s: the children drain...
    wait_until(lambda: worker.output().count("worker stopping reason=signal") == 2, timeout=10)
    worker.signal(signal.SIGTERM)  # ...until a second signal: they exit at once
    assert worker.wait(timeout=15) == 1  # as a single worker does after a second signal
    assert "second signal: exiting now" in worker.output()


def test_job_and_memory_limits_count_per_child_and_a_child_past_one_is_replaced(start_worker):
    tasks.record.enqueue_many([((), {})] * 30)
    worker = start_worker("--processes", "2", "--max-jobs", "5")
    wait_until(lambda: Job.objects.filter(state=JobState.DONE).count() == 30, timeout=60)
    assert WorkerProcess.objects.count() >= 6  # each child stopped after its own 5 jobs
    assert worker.output().count("max jobs reached (5)") >= 4
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0

    spinning = start_worker("--processes", "2", "--max-memory", "1")
    stops = "worker stopping reason=max memory reached"
    wait_until(lambda: spinning.output().count(stops) >= 3, timeout=30)
    assert "replacing it" in spinning.output()  # each child measures itself, and is replaced
    assert len(children(spinning)) <= 2 and spinning.process.poll() is None
    spinning.signal(signal.SIGTERM)
    assert spinning.wait(timeout=15) == 0


def test_in_burst_mode_the_children_are_not_replaced_and_the_parent_exits(start_worker):
    tasks.add.enqueue_many([((1, 2), {})] * 50)
    worker = start_worker("--processes", "2", "--burst")
    assert worker.wait(timeout=30) == 0, worker.output()[-4000:]
    assert Job.objects.filter(state=JobState.DONE).count() == 50
    assert worker.output().count("worker stopped reason=burst: no due job left") == 2
    assert "worker pool stopped replaced=0" in worker.output()
    time.sleep(0.1)


def test_children_stop_when_their_parent_is_killed(start_worker):
    tasks.record.enqueue_many([((), {"sleep": 0.5})] * 2)
    worker = start_worker("--processes", "2", "--grace", "5")
    wait_until(lambda: Run.objects.count() == 2, timeout=30)
    pids = children(worker)

    worker.signal(signal.SIGKILL)

    def gone() -> bool:
        return not any(
            psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            for pid in pids
        )

    wait_until(gone, timeout=15)
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.DONE}  # drained


def test_a_tests_stop_ends_a_pools_children_at_once(start_worker):
    """WorkerHandle.stop() (every start_worker's teardown) kills the children too, not
    only the parent: left to drain their jobs, they raced the test database's flush."""
    tasks.record.enqueue_many([((), {"sleep": 10.0})] * 2)
    worker = start_worker("--processes", "2", "--grace", "30")
    wait_until(lambda: Run.objects.count() == 2, timeout=30)
    pids = children(worker)
    assert len(pids) == 2

    worker.stop()

    def gone() -> bool:
        return not any(
            psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            for pid in pids
        )

    wait_until(gone, timeout=3, message="a child went on running its 10 s job")


# A child that is slow to install its handlers (Django's start, say): SIGTERM forwarded in
# that window must wait for them, not kill the child (the pool counted that as failed).
SLOW_CHILD = """
import sys, threading, time
from django_skipqueue.runtime.pool import WorkerPool
from django_skipqueue.runtime.stopsignals import StopSignals

def run_child():
    print("child starting", flush=True)
    time.sleep(1.5)  # the parent's SIGTERM arrives here
    stop = threading.Event()
    StopSignals(lambda signum: stop.set()).install()
    return 0 if stop.wait(10) else 3  # the pending signal is handled now

sys.exit(WorkerPool(1, run_child).run())
"""


def test_a_sigterm_before_the_child_installed_its_handlers_waits_for_them():
    from tests.processes import start_python

    pool = start_python(SLOW_CHILD)
    try:
        assert pool.stdout.readline().strip() == "child starting"
        time.sleep(0.3)
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(timeout=20) == 0, pool.stderr.read()
    finally:
        if pool.poll() is None:
            pool.kill()
        pool.communicate()


def test_a_sigterm_to_the_whole_process_group_drains_each_child_once(tmp_path):
    """`timeout`, a terminal's Ctrl-C and `kill -- -PGID` signal the whole group: each
    child (a process group of its own) hears it once, from the parent, and drains; in
    the parent's group it heard it twice and exited at once, leaving its jobs running."""
    import subprocess
    import sys

    from tests.processes import REPO_ROOT, child_env

    jobs = tasks.record.enqueue_many([((), {"sleep": 1.5})] * 4)
    log = tmp_path / "pool.log"
    with open(log, "w") as out:
        pool = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "django",
                "runworker",
                "--processes",
                "2",
                "--concurrency",
                "2",
                "--grace",
                "20",
                "-v",
                "2",
            ],
            env=child_env(),
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group, as a shell gives a job
        )
        try:
            wait_until(lambda: Run.objects.count() == 4, timeout=30)
            os.killpg(pool.pid, signal.SIGTERM)
            assert pool.wait(timeout=30) == 0
        finally:
            if pool.poll() is None:
                os.killpg(pool.pid, signal.SIGKILL)
    text = log.read_text()
    assert "second signal" not in text, text[-2000:]
    states = set(Job.objects.filter(id__in=[j.id for j in jobs]).values_list("state", flat=True))
    assert states == {JobState.DONE}  # drained, not left to the reaper
