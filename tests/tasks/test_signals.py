"""Durable signals (issue 55): `send_signal` in the sender's transaction, kept until a
`context.wait_for()` of the job takes it, one wait each, oldest first; a wait parks the
job (pending, no thread, no lease, no attempt spent) until the signal's commit or its
timeout. Real PostgreSQL; jobs run by `run_jobs()` or a worker thread; the races with
real threads and real row locks."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction

from django_skipqueue import send_signal
from django_skipqueue.exceptions import InvalidJobError, SignalNotSentError
from django_skipqueue.models import Job, JobState, Signal, Step
from django_skipqueue.stats import queue_stats
from django_skipqueue.testing import run_jobs
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import StepRun

pytestmark = pytest.mark.django_db(transaction=True)


def parked(job: Job) -> Job:
    job.refresh_from_db()
    assert job.state == JobState.PENDING, job.last_error
    assert job.leased_until is None
    return job


def test_a_wait_parks_the_job_and_the_signal_sent_after_it_wakes_it_with_its_payload():
    job = tasks.durable_kyc.enqueue()
    allowed = job.max_attempts
    run_jobs()
    parked(job)
    assert (job.parked, job.parked_step) == ("signal", "kyc")
    assert (job.attempts, job.max_attempts) == (1, allowed + 1)  # no attempt spent
    assert job.run_at.year > 2026  # no timeout: parked until the signal
    assert [row.awaiting_signal for row in queue_stats() if row.queue == job.queue_name] == [1]
    run_jobs()  # nothing due
    assert Job.objects.get(id=job.id).attempts == 1

    send_signal(job.id, "kyc", {"approved": True})
    woken = Job.objects.get(id=job.id)
    assert woken.state == JobState.PENDING
    assert Job.objects.filter(id=job.id, run_at__lte=time_now()).exists()  # due at once
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.last_error
    assert job.result == {"decisions": [{"approved": True}]}
    assert job.parked == ""  # the claim cleared it
    assert StepRun.objects.filter(job_id=job.id, step="before").count() == 1  # replayed
    assert not Signal.objects.filter(job_id=job.id).exists()  # taken
    wait = Step.objects.get(job_id=job.id, name="kyc")
    assert wait.kind == "signal" and wait.result["outcome"] == "received"


def test_a_signal_sent_before_the_wait_is_kept_and_the_job_never_parks():
    job = tasks.durable_kyc.enqueue()
    send_signal(job.id, "kyc", "early")  # the job has not even started
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.last_error
    assert job.result == {"decisions": ["early"]}
    assert job.releases == 0


def test_a_signal_rolled_back_with_its_senders_transaction_is_never_delivered():
    job = tasks.durable_kyc.enqueue()
    run_jobs()
    parked(job)
    with pytest.raises(RuntimeError), transaction.atomic():
        send_signal(job.id, "kyc", "rolled back")
        raise RuntimeError("the sender's view failed")
    job.refresh_from_db()
    assert job.run_at.year > 2026  # still parked
    assert not Signal.objects.filter(job_id=job.id).exists()
    run_jobs()
    assert Job.objects.get(id=job.id).state == JobState.PENDING


def test_each_signal_is_taken_by_one_wait_oldest_first_and_the_rest_are_kept():
    job = tasks.durable_kyc.enqueue(waits=2)
    for payload in ("first", "second", "third"):
        job.send_signal("kyc", payload)
    run_jobs()
    job.refresh_from_db()
    assert job.result == {"decisions": ["first", "second"]}
    # the third stays: kept for a later wait of that name, deleted with the job
    assert list(Signal.objects.filter(job_id=job.id).values_list("payload", flat=True)) == ["third"]
    Job.objects.filter(id=job.id).delete()
    assert not Signal.objects.filter(job_id=job.id).exists()


def test_a_wait_past_its_timeout_raises_in_the_task_which_may_catch_it():
    job = tasks.durable_kyc.enqueue(timeout=0.5)
    run_jobs()
    parked(job)
    assert 0 < (job.run_at - time_now()).total_seconds() <= 0.6  # parked to its timeout
    time.sleep(0.6)
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.last_error
    assert job.result == {"decisions": ["timed out"]}
    with pytest.raises(SignalNotSentError, match="finished"):
        send_signal(job.id, "kyc", "late")


def test_an_uncaught_timeout_fails_the_job_at_once_and_a_late_signal_cannot_undo_it():
    job = tasks.durable_kyc_uncaught.using(max_attempts=5).enqueue(0.2)
    run_jobs()
    time.sleep(0.3)
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.attempts == 2  # the wait's park spent none; the timeout failed it at once
    assert "SignalTimeoutError" in job.last_error and "'kyc'" in job.last_error
    # Run again past its recorded wait (an operator's restart from step 2): the signal
    # that came late is kept, and the wait replays its recorded timeout.
    assert Job.objects.restart_from_step(job.id, 2)
    send_signal(job.id, "kyc", "late")
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.FAILED and "SignalTimeoutError" in job.last_error
    assert Signal.objects.filter(job_id=job.id).count() == 1


def test_send_signal_refuses_with_words_and_leaves_the_callers_transaction_usable():
    done = tasks.durable_kyc.enqueue()
    send_signal(done.id, "kyc")
    run_jobs()
    with transaction.atomic():
        with pytest.raises(SignalNotSentError, match="no such job"):
            send_signal(10**12, "kyc")
        with pytest.raises(SignalNotSentError, match=r"finished \(done\)"):
            send_signal(done.id, "kyc")
        with pytest.raises(InvalidJobError, match="signal's name"):
            send_signal(done.id, "")
        with pytest.raises(InvalidJobError, match="payload of signal 'kyc'"):
            send_signal(done.id, "kyc", object())
        with pytest.raises(TypeError, match="job_id must be an int"):
            send_signal(str(done.id), "kyc")  # type: ignore[arg-type]
        assert Job.objects.filter(id=done.id).exists()  # the transaction still works
    assert not Signal.objects.filter(job_id=done.id).exists()  # nothing was written


def test_an_async_task_waits_with_await_for():
    job = tasks.durable_kyc_async.enqueue()
    run_jobs()
    parked(job)
    send_signal(job.id, "kyc", [1, 2])
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE and job.result == [1, 2]


def run_jobs_in_a_thread(hook=None) -> threading.Thread:
    """`run_jobs()` in a thread of its own, its statements through `hook` if given."""

    def run() -> None:
        try:
            if hook is None:
                run_jobs()
            else:
                with connections["default"].execute_wrapper(hook):
                    run_jobs()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def send_in_a_thread(job_id: int, payload: object, hold: threading.Event | None = None):
    """send_signal in a transaction of another thread, committed once `hold` is set
    (at once without); the thread, and an event set once the signal is written."""
    sent = threading.Event()

    def send() -> None:
        try:
            with transaction.atomic():
                send_signal(job_id, "kyc", payload)
                sent.set()
                if hold is not None:
                    hold.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=send)
    thread.start()
    return thread, sent


def test_a_signal_committed_between_the_waits_look_and_its_park_wakes_the_job_at_once():
    """The race: the wait looked and found nothing; the sender commits (its own wake-up
    finds the job still running); then the wait parks the job. The park must see the
    signal: the job is due at once, not parked until a timeout that here never comes."""
    job = tasks.durable_kyc.enqueue()
    committed: list[int] = []

    def hook(execute, sql, params, many, context):
        if sql.startswith('UPDATE "skipqueue_job" SET "state"') and '"parked"' in sql:
            if not committed:  # the first park only: the sender commits, then it runs
                sender, _ = send_in_a_thread(job.id, "raced")
                sender.join(10)
                committed.append(job.id)
        return execute(sql, params, many, context)

    run_jobs_in_a_thread(hook).join(20)
    job.refresh_from_db()
    # The park made the job due at once, and run_jobs took it again: its second attempt
    # took the signal. Parked until a timeout, it would be pending still.
    assert committed and job.state == JobState.DONE, (job.state, job.run_at)
    assert job.result == {"decisions": ["raced"]} and (job.attempts, job.releases) == (2, 1)


def test_a_signal_committed_after_the_park_wakes_the_job_through_its_senders_hook():
    """The sender's transaction is open while the wait looks and parks (it locks no row
    of the job, so neither waits); its commit's hook makes the parked job due."""
    tasks.SIGNAL_GATE.clear()
    job = tasks.durable_kyc_gated.enqueue()
    looker = run_jobs_in_a_thread()  # claims the job; its first step waits at the gate
    wait_until(lambda: Job.objects.get(id=job.id).state == JobState.RUNNING)
    hold = threading.Event()
    sender, sent = send_in_a_thread(job.id, "after the park", hold)
    try:
        assert sent.wait(10)
        tasks.SIGNAL_GATE.set()  # the step ends; the wait looks, finds nothing, parks
        looker.join(20)
        assert Job.objects.get(id=job.id).run_at.year > 2026  # parked: no signal yet
    finally:
        hold.set()
        tasks.SIGNAL_GATE.set()
        sender.join(10)
    assert Job.objects.filter(id=job.id, run_at__lte=time_now()).exists()  # due at once
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE and job.result == "after the park"


def test_a_sender_that_holds_its_transaction_holds_up_no_lease_renewal_of_the_job():
    """Outside trial (helper-8): a sender that kept its transaction open after
    send_signal held the job's row, the lease renewals skipped it, the lease ran out and
    a plain step ran twice. The sender now writes nothing of the job's row."""
    tasks.SIGNAL_GATE.clear()
    job = tasks.durable_kyc_gated.enqueue()
    looker = run_jobs_in_a_thread()
    wait_until(lambda: Job.objects.get(id=job.id).state == JobState.RUNNING)
    hold = threading.Event()
    sender, sent = send_in_a_thread(job.id, "held", hold)
    try:
        assert sent.wait(10)
        attempt = Job.objects.get(id=job.id).attempts
        with transaction.atomic():  # as a renewal or an ack would: no wait for a lock
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '200ms'")
            renewed = Job.objects.renewal(job.id, attempt, timedelta(seconds=30))
            assert renewed.name == "RENEWED"
    finally:
        hold.set()
        tasks.SIGNAL_GATE.set()
        sender.join(10)
        looker.join(20)
    assert Job.objects.get(id=job.id).state == JobState.DONE  # run_jobs took it again


def test_the_reaper_wakes_a_parked_job_whose_senders_wake_up_never_ran():
    """A sender that died between its commit and its hook: the signal is kept, the job
    parked; the reaper's pass makes it due."""
    from django_skipqueue.maintenance.reaper import Reaper

    job = tasks.durable_kyc.enqueue()
    run_jobs()
    parked(job)
    Signal.objects.create(job_id=job.id, name="kyc", payload="kept")  # no hook ran
    assert Job.objects.get(id=job.id).run_at.year > 2026
    Reaper().reap()
    assert Job.objects.filter(id=job.id, run_at__lte=time_now()).exists()
    run_jobs()
    assert Job.objects.get(id=job.id).result == {"decisions": ["kept"]}


def test_a_job_parked_past_its_expiry_started_in_time_and_finishes():
    """Outside trial (helper-8): `expires` ended a started durable job that slept or
    waited past it, and a signal sent to it was accepted, then lost with it."""
    from django_skipqueue.maintenance.reaper import Reaper

    job = tasks.durable_kyc.using(expires=timedelta(seconds=1)).enqueue()
    run_jobs()
    parked(job)
    assert job.expires_at is None  # the park cleared it: the job started in time
    time.sleep(1.1)
    send_signal(job.id, "kyc", "late but kept")
    Reaper().reap()
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE and job.result == {"decisions": ["late but kept"]}


@pytest.mark.slow
def test_a_listening_worker_takes_up_a_signalled_job_at_once():
    """The sender's UPDATE of the parked row passes the pending trigger (migration
    0018): the waiting worker's NOTIFY comes with the commit, not at its next poll."""
    from django_skipqueue.runtime.worker import Worker

    job = tasks.durable_kyc.enqueue()
    worker = Worker(concurrency=1, poll_interval=30.0, reap_interval=0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Job.objects.get(id=job.id).parked == "signal", timeout=20)
        time.sleep(0.3)  # the worker back in its wait for a NOTIFY
        sent = time.monotonic()
        send_signal(job.id, "kyc", "go")
        wait_until(lambda: Job.objects.get(id=job.id).state == JobState.DONE, timeout=20)
        took = time.monotonic() - sent
    finally:
        worker.stop()
        thread.join(timeout=20)
    assert Job.objects.get(id=job.id).result == {"decisions": ["go"]}
    assert took < 10  # not its 30 s poll


def time_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


def wait_until_blocked_on_a_lock(seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            if cursor.fetchone()[0]:
                return
        time.sleep(0.02)
    raise AssertionError("no session waited for a lock")


def test_parked_jobs_are_counted_apart_and_shown_on_their_page(admin_client, client):
    from django.core.management import call_command
    from django.urls import reverse

    from tests.admin.test_admin import staff

    napping = tasks.durable_nap.enqueue(60.0)
    waiting = tasks.durable_kyc.enqueue(timeout=3600)
    later = tasks.durable_nap.using(run_after=timedelta(minutes=10)).enqueue(1.0)  # not parked
    run_jobs()
    assert Job.objects.get(id=napping.id).parked == "sleep"
    waiting.send_signal("other", {"note": "by-ann"})  # kept: no wait of it
    (row,) = [row for row in queue_stats() if row.queue == napping.queue_name]
    assert (row.scheduled, row.sleeping, row.awaiting_signal) == (1, 1, 1)
    assert later.id  # the scheduled one

    from io import StringIO

    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    assert '"awaiting_signal": 1' in out.getvalue() and '"sleeping": 1' in out.getvalue()

    url = reverse("admin:skipqueue_job_change", args=[waiting.id])
    page = admin_client.get(url).content.decode()
    assert "Waiting for the signal kyc until" in page
    assert "signals not yet taken" in page.lower() and "by-ann" in page
    assert "awaiting the signal kyc (or its timeout, in 60 min" in page  # why it waits
    viewer = staff(client).get(url).content.decode()
    assert "Waiting for the signal kyc" in viewer and "by-ann" not in viewer
    page = admin_client.get(reverse("admin:skipqueue_job_change", args=[later.id]))
    assert "scheduled: due in" in page.content.decode()
    forever = tasks.durable_kyc.enqueue()
    run_jobs()
    page = admin_client.get(reverse("admin:skipqueue_job_change", args=[forever.id]))
    assert "awaiting the signal kyc (no timeout)" in page.content.decode()  # helper-8
    listed = admin_client.get(reverse("admin:skipqueue_job_changelist") + "?health=sleeping")
    assert f">{napping.id}<" in listed.content.decode()
    assert f">{waiting.id}<" not in listed.content.decode()


def test_a_cancel_ends_a_job_parked_on_a_wait_and_its_signals_are_then_refused():
    job = tasks.durable_kyc.enqueue()
    run_jobs()
    parked(job)
    assert Job.objects.cancel([job.id], by="ops") == 1
    assert Job.objects.get(id=job.id).state == JobState.CANCELLED
    with pytest.raises(SignalNotSentError, match=r"finished \(cancelled\)"):
        send_signal(job.id, "kyc")


@pytest.mark.slow
def test_parked_jobs_hold_no_thread_and_no_connection():
    """A parked job is a pending row: 400 of them (sleeps and waits) leave a worker's
    threads where a few left them, and its connections within its budget."""
    from django_skipqueue.runtime.worker import Worker, connection_budget

    def sessions() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            )
            return cursor.fetchone()[0]

    def all_parked(count: int) -> bool:
        return Job.objects.filter(state=JobState.PENDING).exclude(parked="").count() == count

    before = sessions()
    worker = Worker(concurrency=2, poll_interval=0.05, reap_interval=0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        for _ in range(2):  # each worker thread has run a job and holds its connection
            tasks.durable_nap.enqueue(3600.0)
            tasks.durable_kyc.enqueue()
        wait_until(lambda: all_parked(4), timeout=20)
        time.sleep(0.5)
        threads = threading.active_count()
        tasks.durable_nap.enqueue_many([((3600.0,), {})] * 200)
        tasks.durable_kyc.enqueue_many([((), {})] * 200)
        wait_until(lambda: all_parked(404), timeout=120)
        time.sleep(0.5)
        # No more threads than with 4 parked (fewer, if one another test left behind
        # has ended meanwhile: the suite's process is shared).
        assert threading.active_count() <= threads
        assert sessions() - before <= connection_budget(2, listen=True, schedules=False)
        (row,) = [row for row in queue_stats() if row.queue == "default"]
        assert (row.sleeping, row.awaiting_signal, row.pending_due) == (202, 202, 0)
    finally:
        worker.stop()
        thread.join(timeout=20)


def test_a_sender_in_a_repeatable_read_transaction_sends_while_the_jobs_row_changes():
    """Outside trial (helper-8): the send's UPDATE of the job's row, which a running
    job's renewals rewrite all the time, failed a REPEATABLE READ sender's transaction
    (could not serialize access). The send writes nothing of the row now."""
    job = tasks.durable_kyc.enqueue()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute("SELECT 1")  # the transaction's snapshot

        def renew_elsewhere() -> None:
            Job.objects.filter(id=job.id).update(priority=5)
            connection.close()

        other = threading.Thread(target=renew_elsewhere)
        other.start()
        other.join(10)
        send_signal(job.id, "kyc", "repeatable")
        assert Job.objects.filter(id=job.id).exists()  # the transaction still works
    run_jobs()
    assert Job.objects.get(id=job.id).result == {"decisions": ["repeatable"]}
