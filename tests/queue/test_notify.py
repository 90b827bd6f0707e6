"""NOTIFY on enqueue (T30, T44): delivered at commit only, one per queue per transaction."""

from __future__ import annotations

import os
import threading

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from django_skipqueue.models import Job, JobState, WorkerProcess
from django_skipqueue.queue import sql
from django_skipqueue.runtime import notifier as module
from tests.processes import wait_until
from tests.testapp import tasks


def waiting_worker(*queues: str) -> WorkerProcess:
    """A worker row that waits for its queues' NOTIFY: the trigger notifies only then
    (runtime/waiting.py; test_waiting.py has the workers that write it themselves)."""
    return WorkerProcess.objects.create(
        hostname="test", pid=1, queues=list(queues), waiting_since=timezone.now()
    )


@pytest.fixture
def listener():
    """A raw LISTEN connection on the default and other queues, and a worker row waiting
    for both; yields a drain function."""
    waiting_worker("default", "other")
    wrapper = connections["default"]
    raw = wrapper.get_new_connection(wrapper.get_connection_params())
    raw.autocommit = True
    sql.listen(raw, ["default", "other"])

    def drain(timeout: float = 0.3) -> list:
        return list(raw.notifies(timeout=timeout))

    yield drain
    raw.close()


@pytest.mark.django_db(transaction=True)
def test_t30_the_notify_arrives_only_after_commit(listener):
    with transaction.atomic():
        tasks.add.enqueue(1, 1)
        assert listener() == []  # nothing while the transaction is open
    [note] = listener()
    assert (note.channel, note.payload) == ("skipqueue_default", "")


@pytest.mark.django_db(transaction=True)
def test_t30_a_rolled_back_enqueue_notifies_no_one(listener):
    with pytest.raises(RuntimeError), transaction.atomic():
        tasks.add.enqueue(1, 1)
        raise RuntimeError
    assert listener() == []


@pytest.mark.django_db(transaction=True)
def test_t30_enqueue_works_from_autocommit_and_from_an_on_commit_callback(listener):
    enqueued = []
    with transaction.atomic():
        transaction.on_commit(lambda: enqueued.append(tasks.add.enqueue(2, 2)))
    tasks.add.enqueue(3, 3)
    assert len(enqueued) == 1
    assert len(listener()) == 2


@pytest.mark.django_db(transaction=True)
def test_t44_a_bulk_enqueue_sends_one_notify_per_queue(listener):
    with transaction.atomic():
        tasks.add.enqueue_many([((n, n), {}) for n in range(500)])
        tasks.add.using(queue_name="other").enqueue_many([((n, n), {}) for n in range(100)])
    notes = listener()
    assert sorted(note.channel for note in notes) == ["skipqueue_default", "skipqueue_other"]
    assert all(len(note.payload.encode()) <= 100 for note in notes)  # never job data


@pytest.mark.django_db(transaction=True)
def test_claims_and_acks_send_no_notify(listener):
    from django_skipqueue.models import Job

    tasks.add.enqueue(1, 1)
    listener()
    [job] = Job.objects.claim(queues=["default"])
    Job.objects.ack(job.id, job.attempts, 2)
    assert listener() == []


def test_a_queue_channel_name_is_validated_before_any_sql():
    from django_skipqueue.exceptions import InvalidJobError

    with pytest.raises(InvalidJobError):
        sql.channel_name("new\nline")
    with pytest.raises(InvalidJobError):
        sql.channel_name("q" * 201)
    assert len(sql.channel_name("q" * 48).encode()) <= 63
    assert len(sql.channel_name("q" * 200).encode()) <= 63
    assert threading.current_thread()  # no connection was needed


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "queue", ["emails:high", "emails high", 'x"; DROP TABLE skipqueue_job; --', "é" * 24]
)
def test_a_queue_name_django_accepts_is_a_quoted_channel_that_notifies(queue):
    """Django's Tasks API takes any text as a queue name: the channel is a quoted
    identifier in LISTEN and a parameter of pg_notify(), never SQL text."""
    wrapper = connections["default"]
    raw = wrapper.get_new_connection(wrapper.get_connection_params())
    raw.autocommit = True
    try:
        sql.listen(raw, [queue])
        waiting_worker(queue)
        tasks.add.using(queue_name=queue).enqueue(1, 1)
        [note] = raw.notifies(timeout=2.0, stop_after=1)
    finally:
        raw.close()
    assert note.channel == sql.channel_name(queue) == f"skipqueue_{queue}"
    assert tasks.add.using(queue_name=queue).enqueue(2, 2).queue_name == queue


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "queue", ["q" * 49, "reports.monthly.finance.accounts-receivable." * 4, "é" * 25 + "x"]
)
def test_a_queue_name_over_48_bytes_notifies_on_the_hashed_channel_python_names(queue):
    """Django's Tasks API takes queue names of any length: up to 200 bytes here. Past
    48, "skipqueue_<name>" would pass PostgreSQL's 63-byte identifiers, so the channel
    is a hash of the name; the triggers (skipqueue_channel(), migration 0023) and the
    listener (sql.channel_name) must agree, on INSERT and on UPDATE."""
    wrapper = connections["default"]
    raw = wrapper.get_new_connection(wrapper.get_connection_params())
    raw.autocommit = True
    try:
        sql.listen(raw, [queue])
        waiting_worker(queue)
        job = tasks.add.using(queue_name=queue).enqueue(1, 1)
        [inserted] = raw.notifies(timeout=2.0, stop_after=1)
        Job.objects.filter(id=job.id).update(state=JobState.PENDING)  # 0018's, per row
        [updated] = raw.notifies(timeout=2.0, stop_after=1)
        with connection.cursor() as cursor:
            cursor.execute("SELECT skipqueue_channel(%s)", [queue])
            [in_sql] = cursor.fetchone()
    finally:
        raw.close()
    assert inserted.channel == updated.channel == sql.channel_name(queue) == in_sql
    assert sql.channel_name(queue).startswith("skipqueue_#")
    assert Job.objects.get(id=job.id).queue_name == queue


def slow_notifier(monkeypatch, on_listening=None) -> tuple[module.Notifier, threading.Thread]:
    """A real Notifier of the default queue, whose quiet ticks are a minute apart (only
    its bell, interrupt(), can end it quickly), and its thread, not started."""
    monkeypatch.setattr(module, "HALT_CHECK_SECONDS", 60.0)
    notifier = module.Notifier(
        database="default",
        queues=["default"],
        wake=threading.Event(),
        halted=threading.Event(),
        poll_interval=1.0,
        on_listening=on_listening,
    )
    return notifier, threading.Thread(target=notifier.run, daemon=True)


def stop(notifier: module.Notifier, thread: threading.Thread) -> None:
    """What a stopping worker does (Worker._end_threads), then wait for the thread."""
    notifier.halted.set()
    notifier.interrupt()
    thread.join(timeout=10)  # a minute without the bell


@pytest.fixture
def notifier_thread(monkeypatch):
    """A slow_notifier() listening on its thread. Yields (notifier, thread, listening)."""
    listening = threading.Event()
    notifier, thread = slow_notifier(monkeypatch, lambda works: works and listening.set())
    thread.start()
    yield notifier, thread, listening
    stop(notifier, thread)


@pytest.mark.django_db(transaction=True)
def test_a_rung_notifier_stops_at_once_and_still_hears_notify_until_then(notifier_thread):
    """A stopping worker rings the notifier's bell: its thread ends without waiting for
    the next quiet tick (a burst worker's exit is the end of its drain)."""
    notifier, thread, listening = notifier_thread
    assert listening.wait(10)
    notifier.wake.clear()
    waiting_worker("default")
    tasks.add.enqueue(1, 1)
    assert notifier.wake.wait(10)  # a NOTIFY still wakes the worker through the selector
    notifier.interrupt()  # a ring without a stop: it goes on listening
    notifier.wake.clear()
    tasks.add.enqueue(2, 2)
    assert notifier.wake.wait(10)

    stop(notifier, thread)
    assert not thread.is_alive()
    notifier.interrupt()  # after the end: nothing to ring, no error


@pytest.mark.django_db(transaction=True)
def test_a_notifier_halted_before_it_listens_does_not_wait_for_a_ring(monkeypatch):
    """interrupt() before run() has a bell rings nothing; run() then sees `halted`."""
    notifier, thread = slow_notifier(monkeypatch)
    notifier.halted.set()
    notifier.interrupt()
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.django_db(transaction=True)
def test_a_notifier_whose_socket_is_numbered_past_1024_still_listens(monkeypatch):
    """select() cannot wait on a descriptor past 1,023; a worker with many files open
    (a large app, many connections) gets such a socket, and must neither fail nor
    reconnect in a loop."""
    filler = os.open(os.devnull, os.O_RDONLY)
    taken = [filler]
    while taken[-1] < 1100:  # every lower number too: the next socket gets a higher one
        taken.append(os.dup(filler))
    calls: list[bool] = []
    notifier, thread = slow_notifier(monkeypatch, calls.append)
    try:
        thread.start()
        wait_until(lambda: calls, timeout=10)
        notifier.wake.clear()
        waiting_worker("default")
        tasks.add.enqueue(1, 1)
        assert notifier.wake.wait(10)
        assert calls == [True]  # a failing wait would have reconnected: [True, False, ...]
    finally:
        stop(notifier, thread)
        for fd in taken:
            os.close(fd)
    assert not thread.is_alive()
