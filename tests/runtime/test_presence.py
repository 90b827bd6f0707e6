"""Broker consumers and relays keep a worker row: registered, beaten, marked stopped.

Against the real RabbitMQ (tests/rabbitmq.py): the relay runs in a thread of this
process, the consumer as a real `runworker --broker`.
"""

from __future__ import annotations

import json
import signal
import threading
from io import StringIO

import pytest
from django.core.management import call_command

from django_skipqueue.broker import relay_config
from django_skipqueue.broker.relay import Relay
from django_skipqueue.models import WorkerKind, WorkerProcess
from django_skipqueue.stats import queue_stats
from tests.processes import wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]

FAST = {"HEARTBEAT_SECONDS": 0.2, "WORKER_DEAD_AFTER_SECONDS": 1.0}


def live_workers(queue: str) -> int:
    [row] = [row for row in queue_stats(broker=False) if row.queue == queue]
    return row.live_workers


def test_a_running_relay_is_a_live_worker_of_its_queues_until_it_stops(relayed, settings):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, **FAST}
    relay = Relay(relay_config(), listen=False)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        wait_until(lambda: WorkerProcess.objects.filter(kind="relay").exists(), timeout=10)
        row = WorkerProcess.objects.get(kind=WorkerKind.RELAY)
        assert (row.queues, row.stopped_at) == ([relayed], None)
        assert live_workers(relayed) == 1
        first = row.heartbeat_at  # beaten from its loop, not only written at its start
        wait_until(
            lambda: WorkerProcess.objects.get(id=row.id).heartbeat_at > first,
            timeout=10,
            message="the relay's heartbeat was not written",
        )
    finally:
        relay.stop.set()
        relay.wake.set()
        thread.join(20)
    assert not thread.is_alive()
    row.refresh_from_db()
    assert row.stopped_at is not None
    assert live_workers(relayed) == 0


def test_a_broker_consumer_registers_beats_and_stops_cleanly(relayed, settings, start_worker):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, **FAST}
    consumer = start_worker("--broker", "--concurrency", "3", settings=settings.SKIPQUEUE)
    consumer.wait_for_output("broker consumer connected")
    row = WorkerProcess.objects.get(pid=consumer.pid)
    assert (row.kind, row.queues, row.concurrency) == (WorkerKind.CONSUMER, [relayed], 3)
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    [stats] = [q for q in json.loads(out.getvalue())["queues"] if q["queue"] == relayed]
    assert stats["live_workers"] == 1  # it was 0: a consumer kept no row
    beat = row.heartbeat_at
    wait_until(
        lambda: WorkerProcess.objects.get(id=row.id).heartbeat_at > beat,
        timeout=10,
        message="the consumer's heartbeat was not written",
    )
    consumer.signal(signal.SIGTERM)
    assert consumer.wait(20) == 0
    row.refresh_from_db()
    assert row.stopped_at is not None
    assert live_workers(relayed) == 0


def test_a_killed_consumer_is_lost_not_stopped(relayed, settings, start_worker):
    from django_skipqueue.admin.workers import with_status

    settings.SKIPQUEUE = {**settings.SKIPQUEUE, **FAST}
    consumer = start_worker("--broker", settings=settings.SKIPQUEUE)
    consumer.wait_for_output("broker consumer connected")
    consumer.signal(signal.SIGKILL)
    consumer.wait(20)
    rows = with_status(WorkerProcess.objects.filter(pid=consumer.pid))
    wait_until(lambda: rows.get().status == "lost", timeout=10, message="not shown lost")
    assert rows.get().stopped_at is None


def test_relayjobs_registers_a_relay_and_marks_it_stopped_on_sigterm(relayed, settings):
    import subprocess
    import sys

    from tests.processes import REPO_ROOT, child_env

    settings.SKIPQUEUE = {**settings.SKIPQUEUE, **FAST}
    process = subprocess.Popen(
        [sys.executable, "-m", "django", "relayjobs", "--no-listen"],
        env=child_env(SKIPQUEUE_TEST_SETTINGS=json.dumps(settings.SKIPQUEUE)),
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(
            lambda: WorkerProcess.objects.filter(pid=process.pid).exists(),
            timeout=20,
            message="relayjobs did not register",
        )
        row = WorkerProcess.objects.get(pid=process.pid)
        assert (row.kind, row.queues) == (WorkerKind.RELAY, [relayed])
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
    finally:
        process.kill()
        process.wait(10)
    row.refresh_from_db()
    assert row.stopped_at is not None
