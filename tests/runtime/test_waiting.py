"""The NOTIFY of an enqueue goes out only while a worker of its queue waits for it
(runtime/waiting.py, migration 0016): many web processes enqueue without taking the
cluster-wide lock PostgreSQL holds at the commit of a notifying transaction."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import connections, transaction
from django.db.models.functions import Now
from django.utils import timezone

from django_skipqueue.maintenance.reaper import Reaper
from django_skipqueue.models import Job, JobState, WorkerProcess
from django_skipqueue.queue import sql
from tests.locks import migration_held_up_by_a_long_transaction
from tests.processes import wait_until
from tests.testapp import tasks


@pytest.fixture
def notes():
    """A raw LISTEN on the default and other queues; yields a drain function."""
    wrapper = connections["default"]
    raw = wrapper.get_new_connection(wrapper.get_connection_params())
    raw.autocommit = True
    sql.listen(raw, ["default", "other"])

    def drain(timeout: float = 0.3) -> list[str]:
        return [note.channel for note in raw.notifies(timeout=timeout)]

    yield drain
    raw.close()


def worker_row(*queues: str, waiting: bool = True, **columns: object) -> WorkerProcess:
    return WorkerProcess.objects.create(
        hostname="test",
        pid=1,
        queues=list(queues),
        waiting_since=timezone.now() if waiting else None,
        **columns,
    )


@pytest.mark.django_db(transaction=True)
def test_an_enqueue_notifies_only_the_queues_a_live_worker_waits_for(notes):
    tasks.add.enqueue(1, 1)
    assert notes() == []  # no worker at all: no NOTIFY, no lock at commit

    busy = worker_row("default", waiting=False)
    worker_row("other")
    tasks.add.enqueue(1, 1)
    assert notes() == []  # a busy worker of the queue, a waiting one of another

    WorkerProcess.objects.filter(id=busy.id).update(waiting_since=Now())
    with transaction.atomic():
        tasks.add.enqueue(1, 1)
        tasks.add.using(queue_name="other").enqueue_many([((1, 1), {})] * 3)
    assert sorted(notes()) == ["skipqueue_default", "skipqueue_other"]

    WorkerProcess.objects.mark_stopped(busy.id)  # a clean stop: it waits no more
    tasks.add.enqueue(1, 1)
    assert notes() == []


@pytest.mark.django_db(transaction=True)
def test_a_job_set_back_to_pending_notifies_a_waiting_worker(notes):
    """The UPDATE trigger too: a retry or a requeue wakes a waiting worker."""
    job = tasks.add.enqueue(1, 1)
    Job.objects.filter(id=job.id).update(state=JobState.RUNNING)
    worker_row("default")
    notes()
    Job.objects.filter(id=job.id).update(state=JobState.PENDING)
    assert notes() == ["skipqueue_default"]


@pytest.mark.django_db(transaction=True)
def test_an_update_that_leaves_jobs_pending_notifies_each_queue_once(notes):
    """The UPDATE trigger is per row (migration 0018): a change to a pending job (a
    replaced unique job's run_at, here) tells its queue as the statement-level trigger
    did, and 300 rows of two queues set back to pending in one statement notify each
    queue once."""
    job = tasks.add.enqueue(1, 1)
    worker_row("default", "other")
    Job.objects.filter(id=job.id).update(run_at=Now())
    assert notes() == ["skipqueue_default"]

    tasks.add.enqueue_many([((n, n), {}) for n in range(200)])
    tasks.add.using(queue_name="other").enqueue_many([((n, n), {}) for n in range(100)])
    Job.objects.update(state=JobState.RUNNING)
    notes()
    assert Job.objects.update(state=JobState.PENDING) == 301
    assert sorted(notes()) == ["skipqueue_default", "skipqueue_other"]


@pytest.mark.django_db(transaction=True)
def test_a_claim_and_an_ack_call_no_trigger_function():
    """Claims and acks, the statements every job goes through, leave no job pending: the
    UPDATE trigger's WHEN lets none of their rows through, so its function is never
    called (a statement-level trigger ran it for each of them)."""
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        if not cursor.fetchone()[0]:
            pytest.skip("track_functions needs a superuser")
    tasks.add.enqueue_many([((n, n), {}) for n in range(20)])
    worker_row("default")
    with transaction.atomic(), connections["default"].cursor() as cursor:
        cursor.execute("SET LOCAL track_functions = 'pl'")
        claimed = Job.objects.claim(queues=["default"], limit=20)
        acked = Job.objects.ack_many([(job.id, job.attempts, None) for job in claimed[1:]])
        assert len(acked) == 19
        cursor.execute(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
            " WHERE funcname LIKE 'skipqueue_notify_pending%'"
        )
        assert cursor.fetchone()[0] == 0
        Job.objects.filter(id=claimed[0].id).update(state=JobState.PENDING)  # a release
        cursor.execute(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
            " WHERE funcname LIKE 'skipqueue_notify_pending%'"
        )
        assert cursor.fetchone()[0] == 1  # the count works: a row left pending calls it
    assert len(claimed) == 20


@pytest.mark.django_db(transaction=True)
def test_migration_0018_gives_up_on_its_lock_after_two_seconds_and_runs_again_later():
    """Replacing the trigger needs a lock that every write would queue behind: held up
    by a long transaction, the migration fails within its lock_timeout, changing
    nothing, instead of stalling every enqueue; run again, it goes through."""
    from django.core.management import call_command

    def trigger() -> str:
        with connections["default"].cursor() as cursor:
            cursor.execute(
                "SELECT pg_get_triggerdef(oid) FROM pg_trigger"
                " WHERE tgname = 'skipqueue_job_notify_update'"
            )
            return cursor.fetchone()[0]

    try:
        with migration_held_up_by_a_long_transaction("0017"):
            assert "FOR EACH ROW WHEN" in trigger()  # unchanged
        assert "FOR EACH STATEMENT" in trigger()
    finally:
        call_command("migrate", "skipqueue", verbosity=0)
    assert "FOR EACH ROW WHEN" in trigger()


@pytest.mark.django_db(transaction=True)
def test_the_reaper_clears_the_flag_of_a_dead_worker_and_only_its():
    dead = worker_row("default")
    WorkerProcess.objects.filter(id=dead.id).update(heartbeat_at=Now() - timedelta(hours=1))
    alive = worker_row("default")

    Reaper().prune(workers_dead_for=timedelta(days=1))

    dead.refresh_from_db()
    alive.refresh_from_db()
    assert (dead.waiting_since, alive.waiting_since is not None) == (None, True)


def waiting_since(worker: WorkerProcess) -> object:
    return WorkerProcess.objects.values_list("waiting_since", flat=True).get(id=worker.id)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_waits_when_idle_not_while_busy_and_a_notify_still_wakes_it(start_worker):
    """A real runworker: idle, it waits (its row says so); kept busy by a backlog, it
    stops waiting, so that the enqueues of that time send no NOTIFY; idle again, it
    waits, and a NOTIFY alone (the poll is 30 s) brings it the next job at once."""
    handle = start_worker(
        "--poll-interval", "30", "--concurrency", "1", settings={"HEARTBEAT_SECONDS": 0.3}
    )
    handle.wait_for_output("worker listening")
    wait_until(lambda: WorkerProcess.objects.filter(waiting_since__isnull=False).exists())
    worker = WorkerProcess.objects.get()

    tasks.record.enqueue_many([((), {"sleep": 0.05})] * 40)
    wait_until(lambda: waiting_since(worker) is None, timeout=10)  # busy
    wait_until(lambda: not Job.objects.exclude(state=JobState.DONE).exists(), timeout=30)
    wait_until(lambda: waiting_since(worker) is not None, timeout=5)  # idle again

    # An operator (or a restored backup) clears it: the next heartbeat writes it again.
    WorkerProcess.objects.filter(id=worker.id).update(waiting_since=None)
    wait_until(lambda: waiting_since(worker) is not None, timeout=5)

    time.sleep(0.3)
    started = time.monotonic()
    job = tasks.add.enqueue(1, 1)
    wait_until(lambda: Job.objects.get(id=job.id).state == JobState.DONE, timeout=10)
    assert time.monotonic() - started < 1.0

    handle.process.terminate()  # a clean stop (SIGTERM)
    handle.process.wait(timeout=30)
    assert waiting_since(worker) is None  # stopped: it waits for nothing


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_without_listen_never_waits_and_polls(start_worker):
    handle = start_worker("--no-listen", "--poll-interval", "0.3")
    wait_until(lambda: WorkerProcess.objects.exists(), timeout=20)
    job = tasks.add.enqueue(1, 1)
    wait_until(lambda: Job.objects.get(id=job.id).state == JobState.DONE, timeout=10)
    assert not WorkerProcess.objects.filter(waiting_since__isnull=False).exists()
    handle.stop()


@pytest.mark.django_db(transaction=True)
def test_a_worker_stops_waiting_on_a_stream_and_lingers_before_it_waits_again():
    """Waiting.after_claim on a real row and the real clock: the first short claim
    waits (and asks for one more claim at once); one job found keeps it waiting (its
    NOTIFY brought it); two claims in a row that find jobs end it; then it claims every
    tick, unflagged, until LINGER_SECONDS passed with nothing found."""
    from django_skipqueue.runtime.waiting import LINGER_SECONDS, LINGER_TICK_SECONDS, Waiting

    row = worker_row("default", waiting=False)
    waiting = Waiting(database="default")
    waiting.worker_id = row.id
    assert waiting.after_claim(0) is None  # LISTEN not confirmed yet: the usual poll
    waiting.listening(True)

    assert waiting.after_claim(0) == 0.0
    assert waiting_since(row) is not None
    assert waiting.after_claim(1) is None  # one job, announced: still waiting
    assert waiting.after_claim(0) is None
    assert waiting.after_claim(3) is None
    assert waiting.after_claim(2) == LINGER_TICK_SECONDS  # a stream: busy
    assert waiting_since(row) is None
    assert waiting.after_claim(0) == LINGER_TICK_SECONDS
    time.sleep(LINGER_SECONDS + 0.01)
    assert waiting.after_claim(0) == 0.0
    assert waiting_since(row) is not None

    waiting.listening(False)  # the heartbeat no longer says it waits
    assert waiting.columns() == {"waiting_since": None}
