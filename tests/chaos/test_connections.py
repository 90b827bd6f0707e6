"""Connections under faults and load: T10 idle kill, T17 connection bound, T18 threads."""

from __future__ import annotations

import signal
import time

import pytest

from django_skipqueue.models import Job
from django_skipqueue.runtime.worker import connection_budget
from tests.chaos.harness import scalar
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import Run

pytestmark = pytest.mark.django_db(transaction=True)

OTHER_BACKENDS = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
)


def test_t10_sessions_killed_while_idle_cost_no_job(supervisor):
    worker = supervisor.start(
        "--concurrency",
        "2",
        "--poll-interval",
        "0.5",
        pg_options="-c idle_session_timeout=1000",
    )
    worker.wait_for_output("worker listening")
    ids = [job.id for job in tasks.probe.enqueue_many([((), {"ms": 1})] * 20)]
    wait_until(lambda: Job.objects.filter(id__in=ids, state="done").count() == 20, timeout=30)
    time.sleep(3)  # idle past the server's idle_session_timeout: every session is killed

    ids = [job.id for job in tasks.probe.enqueue_many([((), {"ms": 1})] * 500)]
    wait_until(lambda: Job.objects.filter(id__in=ids, state="done").count() == 500, timeout=60)

    assert not Job.objects.filter(state="failed").exists()
    assert worker.process.poll() is None
    print(f"\nT10 reconnect warnings={worker.output().count('retrying')}")


def test_t17_t18_n_threads_use_at_most_n_plus_three_connections(supervisor):
    """At most `connection_budget()` at any moment: the executors, the dispatcher, the
    housekeeper, the listener, and the scheduler while it syncs. The scheduler starts
    with the other helpers once the first claim returned, so its one sync can overlap
    busy executors (CI saw 12 once). This project's code has no schedules, so once it
    synced its thread ends: from then on, N + 3."""
    tasks.record.enqueue_many([((), {"sleep": 0.01})] * 3000)
    worker = supervisor.start("--concurrency", "8")
    started = time.monotonic()
    peak = late_peak = 0
    while Job.objects.filter(state="done").count() < 3000:
        assert time.monotonic() < started + 60, "jobs did not finish"
        backends = scalar(OTHER_BACKENDS)
        peak = max(peak, backends)
        if time.monotonic() > started + 2.5:  # the scheduler synced and ended
            late_peak = max(late_peak, backends)
        time.sleep(0.05)
    print(f"\nT17 concurrency=8 peak_backends={peak} after_2.5s={late_peak}")
    assert 8 <= peak <= connection_budget(8, listen=True, schedules=True) == 8 + 4
    assert 8 <= late_peak <= 8 + 3  # executors + dispatcher, housekeeper, listener

    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    wait_until(lambda: scalar(OTHER_BACKENDS) == 0, timeout=10)  # every thread closed its own
    assert "can only be used in that same thread" not in worker.output()
    assert "Traceback" not in worker.output()
    assert Run.objects.count() == 3000
