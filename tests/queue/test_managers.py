"""The queue protocol against a real PostgreSQL: claim, ack, renew, fail, release, reap."""

from __future__ import annotations

import logging
import re
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_skipqueue.db import direct, hooks
from django_skipqueue.models import Job, JobState
from django_skipqueue.queue import sql
from django_skipqueue.queue.base import ErrorInfo, _ack_parameters
from tests.conftest import set_lease
from tests.factories import BULK_BATCH, JobFactory
from tests.guard import setting_up
from tests.processes import start_python

ERROR = ErrorInfo("builtins.RuntimeError", "boom", "Traceback ...")


def claim_one(**kwargs: object) -> Job:
    [job] = Job.objects.claim(queues=["default"], **kwargs)
    return job


@pytest.mark.django_db(transaction=True)
def test_claim_marks_job_running_with_attempt_lease_and_worker(worker_process):
    JobFactory(lease=timedelta(seconds=60))

    job = claim_one(worker=worker_process)

    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert job.attempts == 1
    assert job.worker_id == worker_process.id
    assert job.started_at is not None
    lease_left = Job.objects.filter(id=job.id, leased_until__gt=Now() + timedelta(seconds=55))
    assert lease_left.exists()


@pytest.mark.django_db(transaction=True)
def test_a_workers_bound_claim_is_its_own_and_quotes_any_queue_name():
    """A worker's claiming statement is bound once, its parameters quoted in
    (JobManager._bound_claim): each worker claims in its own name, a lease given to one
    claim is that claim's, and a queue name with quotes and percent signs is quoted."""
    from django_skipqueue.models import WorkerProcess

    odd = "it's 100% \\ %s"
    first, second = (WorkerProcess.objects.register(queues=[odd], concurrency=1) for _ in range(2))
    for _ in range(4):
        JobFactory(queue_name=odd, lease=timedelta(seconds=60))
    JobFactory()  # another queue: never claimed below

    [one] = Job.objects.claim(queues=[odd], worker=first)
    [two] = Job.objects.claim(queues=[odd], worker=second)
    [three] = Job.objects.claim(queues=[odd], worker=first, lease=timedelta(hours=1))
    [four] = Job.objects.claim(queues=[odd], worker=first)

    assert Job.objects.claim(queues=[odd], worker=second) == []
    rows = {job.id: job for job in Job.objects.filter(queue_name=odd)}
    assert [rows[job.id].worker_ids for job in (one, two, three, four)] == [
        [str(first.id)],
        [str(second.id)],
        [str(first.id)],
        [str(first.id)],
    ]
    assert {rows[job.id].state for job in (one, two, three, four)} == {JobState.RUNNING}
    long_lease = Job.objects.filter(leased_until__gt=Now() + timedelta(minutes=50))
    assert list(long_lease.values_list("id", flat=True)) == [three.id]
    assert Job.objects.get(queue_name="default").state == JobState.PENDING


@pytest.mark.django_db(transaction=True)
def test_each_claim_records_who_claimed_it_and_the_first_start_is_kept(worker_process):
    from django_skipqueue.queue.base import in_process_claimer

    JobFactory()
    first = claim_one(worker=worker_process)
    assert Job.objects.release(first.id, first.attempts)
    second = claim_one()  # no worker: run_jobs, a script

    second.refresh_from_db()
    assert second.worker_ids == [str(worker_process.id), in_process_claimer()]
    assert second.first_started_at == first.started_at < second.started_at
    assert len(second.worker_ids) == second.attempts == 2


def fields_of(job: Job) -> dict:
    return {field.attname: getattr(job, field.attname) for field in Job._meta.concrete_fields}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("receiver", [False, True], ids=["fast path", "post_init receiver"])
def test_a_claimed_job_equals_the_row_as_the_orm_loads_it(worker_process, receiver):
    from django.db.models.signals import post_init

    seen = []

    def count(sender, instance, **kwargs):
        seen.append(instance)

    JobFactory(args=[1, {"a": [2, None]}], kwargs={"k": "é"}, errors=[{"attempt": 1}])
    if receiver:
        post_init.connect(count, sender=Job)
    try:
        job = claim_one(worker=worker_process)
    finally:
        post_init.disconnect(count, sender=Job)
    assert len(seen) == (1 if receiver else 0)
    assert fields_of(job) == fields_of(Job.objects.get(id=job.id))
    assert job.args == [1, {"a": [2, None]}] and job.errors == [{"attempt": 1}]
    assert not job._state.adding and job._state.db == "default"


@pytest.mark.django_db(transaction=True)
def test_claim_orders_by_priority_then_run_at_then_id():
    low = JobFactory(priority=-5)
    first_high = JobFactory(priority=50)
    second_high = JobFactory(priority=50)
    earlier = JobFactory(priority=0, run_at=Now() - timedelta(hours=1))
    later = JobFactory(priority=0)

    claimed = [job.id for job in Job.objects.claim(queues=["default"], limit=10)]

    assert claimed == [first_high.id, second_high.id, earlier.id, later.id, low.id]


@pytest.mark.django_db(transaction=True)
def test_claim_takes_only_due_pending_jobs_of_the_given_queues():
    due = JobFactory()
    JobFactory(run_at=Now() + timedelta(minutes=5))
    JobFactory(queue_name="other")
    JobFactory(running=True)
    JobFactory(done=True)

    claimed = Job.objects.claim(queues=["default"], limit=10)

    assert [job.id for job in claimed] == [due.id]


@pytest.mark.django_db(transaction=True)
def test_claim_from_several_queues_takes_from_each():
    a, b = JobFactory(queue_name="a"), JobFactory(queue_name="b")
    claimed = Job.objects.claim(queues=["a", "b"], limit=10)
    assert {job.id for job in claimed} == {a.id, b.id}


@pytest.mark.django_db(transaction=True)
def test_claim_honours_limit():
    JobFactory.create_batch(30)  # 1 + 7 + 16 leaves 6 unclaimed
    for limit in (1, 7, 16):
        assert len(Job.objects.claim(queues=["default"], limit=limit)) == limit


@pytest.mark.django_db(transaction=True)
def test_claim_costs_one_statement_for_one_job_or_fifty():
    JobFactory.create_batch(102)
    for limit in (1, 50):  # the first claim of a limit compiles its QuerySet (once)
        Job.objects.claim(queues=["default"], limit=limit)

    def statements(limit: int) -> list[str]:
        with CaptureQueriesContext(connection) as queries:
            assert len(Job.objects.claim(queues=["default"], limit=limit)) == limit
        return [query["sql"] for query in queries]

    one, fifty = statements(1), statements(50)
    assert len(one) == len(fifty) == 1
    assert "FOR NO KEY UPDATE SKIP LOCKED" in one[0] and "RETURNING" in one[0]


@pytest.mark.django_db(transaction=True)
def test_claim_commits_before_returning():
    JobFactory()
    claim_one()
    assert not connection.in_atomic_block
    # Another connection sees the claim at once: nothing is held open.
    seen: list[str] = []

    def look() -> None:
        try:
            seen.append(Job.objects.get().state)
        finally:
            connection.close()

    thread = threading.Thread(target=look)
    thread.start()
    thread.join(10)
    assert seen == [JobState.RUNNING]


@pytest.mark.django_db(transaction=True)
def test_eight_threads_claim_each_job_exactly_once(worker_process):
    Job.objects.bulk_create(JobFactory.build_batch(2000), batch_size=BULK_BATCH)
    start, lock, claimed = threading.Barrier(8), threading.Lock(), []

    def claimer() -> None:
        try:
            start.wait(timeout=10)
            while batch := Job.objects.claim(queues=["default"], worker=worker_process, limit=10):
                with lock:
                    claimed.extend(job.id for job in batch)
        finally:
            connection.close()

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert len(claimed) == len(set(claimed)) == 2000
    assert Job.objects.filter(state=JobState.RUNNING, attempts=1).count() == 2000


CLAIMER = """
import os, time
from pathlib import Path
from django_skipqueue.models import Job
go = Path(os.environ["GO_FILE"])
deadline = time.monotonic() + 30
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
ids = []
while batch := Job.objects.claim(queues=["default"], limit=5):
    ids.extend(job.id for job in batch)
print(" ".join(map(str, ids)))
"""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_four_processes_claim_each_job_exactly_once(tmp_path: Path):
    Job.objects.bulk_create(JobFactory.build_batch(2000), batch_size=BULK_BATCH)
    go = tmp_path / "go"
    children = [start_python(CLAIMER, GO_FILE=str(go)) for _ in range(4)]
    try:
        time.sleep(0.5)  # let the interpreters start; the go file releases them together
        go.touch()
        outputs = [child.communicate(timeout=90) for child in children]
    finally:
        for child in children:
            child.kill()
    assert [child.returncode for child in children] == [0, 0, 0, 0], [err for _, err in outputs]
    claimed = [int(word) for out, _ in outputs for word in out.split()]
    assert len(claimed) == len(set(claimed)) == 2000
    assert sum(1 for out, _ in outputs if out.strip()) >= 2  # the work was really shared


@pytest.mark.django_db(transaction=True)
def test_ack_marks_done_with_result():
    JobFactory()
    job = claim_one()

    assert Job.objects.ack(job.id, job.attempts, {"sent": True}) is True

    job.refresh_from_db()
    assert (job.state, job.result, job.leased_until) == (JobState.DONE, {"sent": True}, None)
    assert job.finished_at is not None


@pytest.mark.django_db(transaction=True)
def test_stale_attempt_cannot_ack_fail_renew_or_release_but_the_new_one_can():
    JobFactory()
    stale = claim_one()
    set_lease(stale.id, -1)
    assert Job.objects.reap().requeued == 1
    fresh = claim_one()
    assert fresh.attempts == stale.attempts + 1

    assert Job.objects.ack(stale.id, stale.attempts) is False
    assert Job.objects.fail(stale.id, stale.attempts, error=ERROR, retry_in=None) is None
    assert Job.objects.renew(stale.id, stale.attempts) is False
    assert Job.objects.release(stale.id, stale.attempts) is False
    assert Job.objects.get(id=fresh.id).state == JobState.RUNNING

    assert Job.objects.renew(fresh.id, fresh.attempts) is True
    assert Job.objects.ack(fresh.id, fresh.attempts, 7) is True
    assert Job.objects.get(id=fresh.id).result == 7


@pytest.mark.django_db(transaction=True)
def test_ack_after_the_lease_ran_out_is_refused_even_before_a_reap():
    JobFactory()
    job = claim_one()
    set_lease(job.id, -0.001)

    assert Job.objects.ack(job.id, job.attempts) is False
    assert Job.objects.get(id=job.id).state == JobState.RUNNING


@pytest.mark.django_db(transaction=True)
def test_a_short_real_lease_runs_out():
    JobFactory()
    job = claim_one(lease=timedelta(seconds=0.3))
    assert Job.objects.renew(job.id, job.attempts, timedelta(seconds=0.3)) is True
    time.sleep(0.5)  # the lease itself is what runs out here, not a synchronisation
    assert Job.objects.ack(job.id, job.attempts) is False
    assert Job.objects.reap().requeued == 1


@pytest.mark.django_db(transaction=True)
def test_ack_of_a_finished_job_is_refused():
    JobFactory()
    job = claim_one()
    assert Job.objects.ack(job.id, job.attempts)
    assert Job.objects.ack(job.id, job.attempts) is False


@pytest.mark.django_db(transaction=True)
def test_renew_moves_the_lease_end_on_the_database_clock():
    JobFactory(lease=timedelta(seconds=5))
    job = claim_one()

    assert Job.objects.renew(job.id, job.attempts, timedelta(hours=1))

    assert Job.objects.filter(id=job.id, leased_until__gt=Now() + timedelta(minutes=59)).exists()


@pytest.mark.django_db(transaction=True)
def test_fail_schedules_a_retry_while_attempts_remain():
    JobFactory(max_attempts=2)
    job = claim_one()

    state = Job.objects.fail(job.id, job.attempts, error=ERROR, retry_in=timedelta(minutes=10))

    assert state == JobState.PENDING
    job.refresh_from_db()
    assert job.leased_until is None
    assert job.last_error == "builtins.RuntimeError: boom"
    assert job.errors[0]["attempt"] == 1
    assert job.errors[0]["traceback"] == "Traceback ..."
    assert Job.objects.scheduled().filter(id=job.id, run_at__gt=Now() + timedelta(minutes=9))


@pytest.mark.django_db(transaction=True)
def test_fail_at_the_last_attempt_ends_failed():
    JobFactory(max_attempts=1)
    job = claim_one()

    state = Job.objects.fail(job.id, job.attempts, error=ERROR, retry_in=timedelta(0))

    assert state == JobState.FAILED
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.finished_at is not None


@pytest.mark.django_db(transaction=True)
def test_fail_without_retry_ends_failed_even_with_attempts_left():
    JobFactory(max_attempts=5)
    job = claim_one()
    assert Job.objects.fail(job.id, job.attempts, error=ERROR, retry_in=None) == JobState.FAILED


@pytest.mark.django_db(transaction=True)
def test_error_history_is_capped_to_the_latest_entries(settings):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "ERROR_HISTORY_LENGTH": 3}
    JobFactory(max_attempts=6)
    for attempt in range(1, 6):
        job = claim_one()
        assert job.attempts == attempt
        error = ErrorInfo("E", f"failure {attempt}")
        Job.objects.fail(job.id, attempt, error=error, retry_in=timedelta(0))

    errors = Job.objects.get().errors
    assert [entry["message"] for entry in errors] == ["failure 3", "failure 4", "failure 5"]


@pytest.mark.django_db(transaction=True)
def test_release_gives_the_attempt_back_without_lowering_attempts():
    JobFactory(max_attempts=3)
    job = claim_one()

    assert Job.objects.release(job.id, job.attempts) is True

    job.refresh_from_db()
    assert (job.state, job.attempts, job.max_attempts, job.releases) == (JobState.PENDING, 1, 4, 1)
    again = claim_one()
    assert again.attempts == 2  # a new fence value: the released attempt 1 stays stale
    assert Job.objects.ack(job.id, 1) is False


@pytest.mark.django_db(transaction=True)
def test_reap_requeues_expired_leases_and_counts_each_expiry():
    expired = JobFactory(expired=True)
    held = JobFactory(running=True)
    done = JobFactory(done=True)

    result = Job.objects.reap()

    assert (result.requeued, result.failed) == (1, 0)
    expired.refresh_from_db()
    assert (expired.state, expired.expirations, expired.attempts) == (JobState.PENDING, 1, 1)
    assert expired.errors[-1]["type"] == "django_skipqueue.exceptions.LeaseExpiredError"
    assert Job.objects.get(id=held.id).state == JobState.RUNNING
    assert Job.objects.get(id=done.id).state == JobState.DONE


@pytest.mark.django_db(transaction=True)
def test_reap_fails_an_expired_job_on_its_last_attempt():
    job = JobFactory(expired=True, attempts=3, max_attempts=3)

    result = Job.objects.reap()

    assert (result.requeued, result.failed) == (0, 1)
    job.refresh_from_db()
    assert (job.state, job.expirations) == (JobState.FAILED, 1)
    assert job.finished_at is not None


@pytest.mark.django_db(transaction=True)
def test_two_reapers_at_once_count_nothing_twice():
    Job.objects.bulk_create(JobFactory.build_batch(3000, expired=True), batch_size=BULK_BATCH)
    start, results = threading.Barrier(2), []

    def reaper() -> None:
        try:
            start.wait(timeout=10)
            results.append(Job.objects.reap())
        finally:
            connection.close()

    threads = [threading.Thread(target=reaper) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert sum(result.requeued for result in results) == 3000
    assert set(Job.objects.values_list("expirations", flat=True)) == {1}


@pytest.mark.django_db(transaction=True)
def test_reap_never_revives_a_job_acked_meanwhile():
    JobFactory()
    job = claim_one()
    assert Job.objects.ack(job.id, job.attempts)
    with setting_up():
        set_lease(job.id, -60)  # even with a lease end in the past, done is final

    assert Job.objects.reap().total == 0
    assert Job.objects.get(id=job.id).state == JobState.DONE


@pytest.mark.django_db(transaction=True)
def test_attempts_can_never_exceed_max_attempts_in_the_database():
    from django.db import IntegrityError

    with pytest.raises(IntegrityError, match="skipqueue_job_attempt_budget"):
        JobFactory(attempts=6, max_attempts=5)


@pytest.mark.django_db(transaction=True)
def test_claim_uses_the_claim_index_with_100000_done_and_10000_pending_rows():
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
                lease, attempts, max_attempts, expirations, releases, last_error, errors,
                created_at, finished_at)
            SELECT 'tests.testapp.tasks.add', '[]', '{}', 'default', 0,
                   CASE WHEN n <= 100000 THEN 'done' ELSE 'pending' END,
                   now() - (n * interval '1 millisecond'), interval '5 minutes',
                   CASE WHEN n <= 100000 THEN 1 ELSE 0 END, 5, 0, 0, '', '[]', now(),
                   CASE WHEN n <= 100000 THEN now() END
            FROM generate_series(1, 110000) AS n
            """
        )
        cursor.execute("ANALYZE skipqueue_job")
    with transaction.atomic(), connection.cursor() as cursor:
        statement, params = Job.objects.claim_statement(["default"], limit=10)
        cursor.execute("EXPLAIN " + statement, params)  # plans; changes nothing
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "skipqueue_job_claim_idx" in plan, plan
    assert "Seq Scan" not in plan, plan
    assert "Sort" not in plan, plan  # the index gives the claim's order
    assert Job.objects.filter(state=JobState.RUNNING).count() == 0


@pytest.mark.django_db(transaction=True)
def test_reap_reads_only_the_running_jobs_by_an_index():
    """The reaper's expired() (a lease ended, or none) reads an index over running jobs
    only: skipqueue_job_lease_idx or skipqueue_job_worker_run_idx, which hold the same
    rows (an empty table leaves the planner no reason to prefer one). Whether it walks
    the index or builds a bitmap from it depends on what earlier tests left in the
    table's statistics; either reads only running jobs."""
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")  # an empty table: ask whether it can
        plan = Job.objects.expired().explain()
        cursor.execute("RESET enable_seqscan")
    assert "Seq Scan" not in plan, plan
    read = set(
        re.findall(r"(?:Index Scan using|Index Only Scan using|Bitmap Index Scan on) (\w+)", plan)
    )
    assert read, plan
    assert read <= {"skipqueue_job_lease_idx", "skipqueue_job_worker_run_idx"}, plan


@pytest.mark.django_db(transaction=True)
def test_every_index_of_the_job_table_but_its_primary_key_is_partial():
    """A full index takes an entry at every insert, claim and ack of every job (a claim
    and an ack each write a new row version): migration 0017 made the foreign keys'
    indexes partial. An index added later should say which rows it needs."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.relname FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
            WHERE i.indrelid = 'skipqueue_job'::regclass AND i.indpred IS NULL
            """
        )
        full = sorted(row[0] for row in cursor.fetchall())
    assert full == ["skipqueue_job_pkey"]


def _job_indexes() -> dict[str, tuple[str, bool]]:
    """The job table's indexes on worker_id or workflow_id: name -> (definition, valid)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.relname, pg_get_indexdef(i.indexrelid), i.indisvalid
            FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
            WHERE i.indrelid = 'skipqueue_job'::regclass
              AND (pg_get_indexdef(i.indexrelid) LIKE '%(worker_id%'
                   OR pg_get_indexdef(i.indexrelid) LIKE '%(workflow_id%'
                   OR c.relname LIKE 'skipqueue_job_worker%')
            """
        )
        return {name: (definition, valid) for name, definition, valid in cursor.fetchall()}


def _leave_an_invalid_index(name: str) -> None:
    """What an interrupted CREATE INDEX CONCURRENTLY leaves: an INVALID index of that
    name (here a unique one that two rows break, which needs no superuser)."""
    from django.db import IntegrityError

    with pytest.raises(IntegrityError), connection.cursor() as cursor:
        cursor.execute(f"CREATE UNIQUE INDEX CONCURRENTLY {name} ON skipqueue_job (task)")
    assert _job_indexes()[name][1] is False


DJANGOS = {"skipqueue_job_worker_id_bc0c95a5", "skipqueue_job_workflow_id_f391eb28"}


@pytest.mark.django_db(transaction=True)
def test_migration_0017_drops_djangos_foreign_key_indexes_both_ways_and_keeps_a_projects_own():
    """Only Django's own names go, exactly: a project's index on the same column stays,
    even when its name starts as Django's do."""
    from django.core.management import call_command

    own = "skipqueue_job_worker_id_reporting"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE INDEX {own} ON skipqueue_job (worker_id)")
    try:
        call_command("migrate", "skipqueue", "0016", verbosity=0)
        assert DJANGOS <= set(_job_indexes())
        assert "skipqueue_job_worker_run_idx" not in _job_indexes()
        call_command("migrate", "skipqueue", verbosity=0)
        assert not DJANGOS & set(_job_indexes())
        assert {"skipqueue_job_worker_run_idx", own} <= set(_job_indexes())
    finally:
        call_command("migrate", "skipqueue", verbosity=0)
        with connection.cursor() as cursor:
            cursor.execute(f"DROP INDEX IF EXISTS {own}")


@pytest.mark.django_db(transaction=True)
def test_migration_0017_run_again_after_an_interruption_rebuilds_what_it_left_invalid():
    from django.core.management import call_command

    from tests.testapp.tasks import add

    add.enqueue(1, 1)
    add.enqueue(2, 2)  # two rows of one task: the unique index below fails on them
    try:
        call_command("migrate", "skipqueue", "0016", verbosity=0)
        _leave_an_invalid_index("skipqueue_job_worker_run_idx")
        call_command("migrate", "skipqueue", verbosity=0)
        definition, valid = _job_indexes()["skipqueue_job_worker_run_idx"]
        assert valid and "(worker_id) WHERE" in definition, definition

        call_command("migrate", "skipqueue", "0017", verbosity=0)  # back over 0018 only
        _leave_an_invalid_index("skipqueue_job_worker_id_bc0c95a5")
        call_command("migrate", "skipqueue", "0016", verbosity=0)
        definition, valid = _job_indexes()["skipqueue_job_worker_id_bc0c95a5"]
        assert valid and definition.endswith("(worker_id)"), definition
    finally:
        call_command("migrate", "skipqueue", verbosity=0)
    assert not DJANGOS & set(_job_indexes())


def updates(captured: CaptureQueriesContext) -> list[str]:
    """The UPDATE statements among the captured queries (not the transaction's own)."""
    return [q["sql"] for q in captured.captured_queries if q["sql"].lstrip().startswith("UPDATE")]


@pytest.mark.django_db(transaction=True)
def test_writes_that_name_jobs_by_id_find_them_by_the_primary_key_with_many_running():
    """ANALYZE saw 3,000 finished and 5,000 pending jobs, none running; then 3,000 run.
    A plan that walks an index over running jobs reads all 3,000 entries for each ack,
    renewal or cancel ("Rows Removed by Filter" counts them), and one that joins a batch
    of acks to the job table read the whole batch for each row (a nested loop over a
    sequential scan, 449,850 rows removed for 150 acks): each of these writes must find
    its rows by the primary key alone."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
                lease, attempts, max_attempts, expirations, releases, last_error, errors,
                created_at)
            SELECT 'tests.testapp.tasks.add', '[]', '{}', 'default', 0,
                   CASE WHEN n <= 3000 THEN 'done' ELSE 'pending' END, now(),
                   interval '5 minutes', CASE WHEN n <= 3000 THEN 1 ELSE 0 END, 5, 0, 0, '',
                   '[]', now()
            FROM generate_series(1, 8000) AS n
            """
        )
        cursor.execute("ANALYZE skipqueue_job")
        cursor.execute(
            """
            UPDATE skipqueue_job SET state = 'running', attempts = 1, started_at = now(),
                leased_until = now() + interval '1 hour'
            WHERE id IN (SELECT id FROM skipqueue_job WHERE state = 'pending'
                         ORDER BY id LIMIT 3000)
            """
        )
    running = list(Job.objects.running().order_by("id").values_list("id", flat=True))
    job_id = running[1500]
    batch = [(other, 1, None) for other in running[:150]]  # a worker's batch of acks
    with CaptureQueriesContext(connection) as renewal:
        assert Job.objects.renew(job_id, 1)
    with CaptureQueriesContext(connection) as progress:
        assert Job.objects.report_progress(job_id, 1, {"done": 1})
    with CaptureQueriesContext(connection) as cancel:
        assert Job.objects.cancel([job_id]) == 1
    # The ack prepared, as a pooler or a server-binding connection may run it: its generic
    # plan, which PostgreSQL keeps where it costs no more than a custom one.
    numbered = direct._positional(sql.ACK_MANY)[0].decode()
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        cursor.execute("PREPARE skipqueue_ack_under_test AS " + numbered)
    generic = "EXPLAIN ANALYZE EXECUTE skipqueue_ack_under_test(%(results)s, %(ids)s, %(attempts)s)"

    def quoted(params: dict[str, str]) -> str:  # EXECUTE takes no bound parameters
        return hooks.quote_parameters(connection, generic, params)

    statements = [
        (quoted(_ack_parameters([(job_id, 1, None)], [None])), None),
        (quoted(_ack_parameters(batch, ["[1]"] * 150)), None),
        ("EXPLAIN ANALYZE " + sql.ACK_MANY, _ack_parameters([(job_id, 1, None)], [None])),
        ("EXPLAIN ANALYZE " + sql.ACK_MANY, _ack_parameters(batch, ["[1]"] * 150)),
        ("EXPLAIN ANALYZE " + renewal.captured_queries[0]["sql"], None),
        ("EXPLAIN ANALYZE " + progress.captured_queries[0]["sql"], None),
        ("EXPLAIN ANALYZE " + updates(cancel)[-1], None),
    ]
    for statement, params in statements:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(statement, params)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            transaction.set_rollback(True)
        assert re.search(r"Index Scan (using|on) skipqueue_job_pkey", plan), plan
        assert "Seq Scan" not in plan and "Join" not in plan, plan
        assert all(
            int(n) <= 1 for n in re.findall(r"Rows Removed by (?:Join )?Filter: (\d+)", plan)
        ), plan
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE skipqueue_ack_under_test")
        cursor.execute("RESET plan_cache_mode")
    assert Job.objects.ack(job_id, 1)


@pytest.mark.django_db(transaction=True)
def test_a_workers_running_jobs_and_a_workflows_jobs_are_read_by_their_partial_indexes():
    import uuid

    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")  # an empty table: ask whether it can
        by_worker = Job.objects.running().filter(worker_id=uuid.uuid4()).explain()
        by_workflow = Job.objects.filter(workflow_id=1).explain()
        cursor.execute("RESET enable_seqscan")
    assert "skipqueue_job_worker_run_idx" in by_worker, by_worker
    assert "skipqueue_job_workflow_idx" in by_workflow, by_workflow


@pytest.mark.django_db(transaction=True)
def test_a_job_enqueued_in_a_rolled_back_transaction_never_exists():
    from tests.testapp.tasks import add

    with pytest.raises(RuntimeError), transaction.atomic():
        add.enqueue(1, 2)
        raise RuntimeError("the business write failed")

    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_job_in_an_open_transaction_cannot_be_claimed_until_commit():
    from tests.testapp.tasks import add

    claimed_before: list[list[Job]] = []

    def claim_elsewhere() -> None:
        try:
            claimed_before.append(Job.objects.claim(queues=["default"]))
        finally:
            connection.close()

    with transaction.atomic():
        job = add.enqueue(1, 2)
        thread = threading.Thread(target=claim_elsewhere)
        thread.start()
        thread.join(10)

    assert claimed_before == [[]]
    assert [claimed.id for claimed in Job.objects.claim(queues=["default"])] == [job.id]


@pytest.mark.django_db(transaction=True)
def test_a_claim_never_returns_more_rows_than_its_limit():
    """T39 (Oban 3990921): the LIMIT of the locking subquery holds for every batch size."""
    Job.objects.bulk_create(JobFactory.build_batch(3000), batch_size=BULK_BATCH)
    claimed = 0
    for _ in range(30):
        for limit in range(1, 17):
            batch = Job.objects.claim(queues=["default"], limit=limit)
            assert len(batch) <= limit
            claimed += len(batch)
    assert claimed == Job.objects.filter(state=JobState.RUNNING).count()
    assert not Job.objects.filter(attempts__gt=1).exists()


@pytest.mark.django_db(transaction=True)
def test_t19_a_locking_select_outside_a_transaction_is_refused():
    """Why the claim opens its own transaction, and why race tests use transaction=True."""
    from django.db.transaction import TransactionManagementError

    with pytest.raises(TransactionManagementError):
        list(Job.objects.due().select_for_update(skip_locked=True))


# -- issue 12: no row's state, put there by hand or by another writer, stops a verb ------


def insert_raw(**columns: object) -> int:
    """A job row as another service (or a DBA) would write it, bypassing our checks."""
    row = {
        "task": "'tests.testapp.tasks.add'",
        "args": "'[1, 2]'",
        "kwargs": "'{}'",
        "queue_name": "'default'",
        "priority": "0",
        "state": "'pending'",
        "run_at": "now()",
        "lease": "'30 s'",
        "attempts": "0",
        "max_attempts": "5",
        "expirations": "0",
        "releases": "0",
        "last_error": "''",
        "errors": "'[]'",
        "created_at": "now()",
    } | {name: str(value) for name, value in columns.items()}
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO skipqueue_job ({', '.join(row)}) VALUES ({', '.join(row.values())}) "
            "RETURNING id"
        )
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_a_failed_job_set_back_to_pending_by_hand_is_claimed_with_one_more_attempt():
    JobFactory(failed=True)
    Job.objects.filter(state="failed").update(state="pending")  # attempts == max_attempts

    job = claim_one()

    job.refresh_from_db()
    assert (job.state, job.attempts, job.max_attempts) == (JobState.RUNNING, 6, 6)


@pytest.mark.django_db(transaction=True)
def test_a_lease_out_of_bounds_in_a_row_is_clamped_by_the_claim_and_the_renewal():
    huge = insert_raw(lease="'999999999 days'")  # timedelta.max, by another writer
    tiny = insert_raw(lease="'1 microsecond'")

    claimed = {job.id: job for job in Job.objects.claim(queues=["default"], limit=2)}

    assert set(claimed) == {huge, tiny}
    assert claimed[huge].lease == timedelta(days=7)  # the worker renews by this one
    week = Now() + timedelta(days=7)
    assert Job.objects.filter(id=huge, leased_until__lte=week).exists()
    assert Job.objects.filter(id=tiny, leased_until__gte=Now() + timedelta(seconds=0.2)).exists()
    assert Job.objects.renew(huge, 1) and Job.objects.renew(tiny, 1)
    assert Job.objects.filter(id=huge, leased_until__lte=week).exists()


@pytest.mark.django_db(transaction=True)
def test_a_column_added_by_a_later_migration_does_not_reach_the_claim():
    JobFactory.create_batch(3)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE skipqueue_job ADD COLUMN from_the_future integer DEFAULT 7")
    try:
        claimed = Job.objects.claim(queues=["default"], limit=3)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE skipqueue_job DROP COLUMN from_the_future")
    assert len(claimed) == 3
    assert all(Job.objects.ack(job.id, job.attempts, job.args[0]) for job in claimed)


@pytest.mark.django_db(transaction=True)
def test_a_row_whose_claim_fails_ends_failed_and_the_others_are_claimed():
    from tests.conftest import refusing

    good = [JobFactory(priority=1).id for _ in range(4)]
    poison = JobFactory(kwargs={"poison": True}).id
    with refusing("claim"):
        claimed = Job.objects.claim(queues=["default"], limit=10)
    assert sorted(job.id for job in claimed) == good
    job = Job.objects.get(id=poison)
    assert (job.state, job.attempts) == (JobState.FAILED, 0)
    assert "the claim failed" in job.last_error
    assert f"job {poison} is poison to this claim" in job.last_error


@pytest.mark.django_db(transaction=True)
def test_a_row_whose_ack_fails_is_reported_and_the_others_are_acked():
    from django.db import IntegrityError

    from tests.conftest import refusing

    for _ in range(4):
        JobFactory()
    JobFactory(kwargs={"poison": True})
    claimed = Job.objects.claim(queues=["default"], limit=5)
    poison = next(job.id for job in claimed if job.kwargs)
    errors: dict = {}
    with refusing("ack"):
        done = Job.objects.ack_many([(job.id, job.attempts, 3) for job in claimed], errors=errors)
        with pytest.raises(IntegrityError, match="poison to this ack"):
            Job.objects.ack(poison, 1)  # one row, no `errors`: raised
    assert done == {job.id for job in claimed} - {poison}
    assert list(errors) == [poison]
    assert isinstance(errors[poison], IntegrityError)
    assert Job.objects.filter(state=JobState.DONE).count() == 4


@pytest.mark.django_db(transaction=True)
def test_an_expired_row_with_a_history_that_is_not_an_array_is_reaped_and_keeps_it():
    broken = JobFactory(expired=True, errors={"from": "a hand edit"})
    other = JobFactory(expired=True)

    result = Job.objects.reap()

    assert result.requeued == 2
    broken.refresh_from_db()
    assert broken.state == JobState.PENDING
    assert broken.errors[0] == {"from": "a hand edit"}  # kept, not lost
    assert broken.errors[1]["type"].endswith("LeaseExpiredError")
    assert Job.objects.get(id=other.id).state == JobState.PENDING


@pytest.mark.django_db(transaction=True)
def test_a_row_whose_reap_fails_ends_failed_and_the_others_are_reaped():
    from tests.conftest import refusing

    others = [JobFactory(expired=True).id for _ in range(3)]
    poison = JobFactory(expired=True, kwargs={"poison": True}).id
    with refusing("reap"):
        result = Job.objects.reap()
    assert (result.requeued, result.failed) == (3, 1)
    assert Job.objects.filter(id__in=others, state=JobState.PENDING).count() == 3
    job = Job.objects.get(id=poison)
    assert job.state == JobState.FAILED
    assert "the reap failed" in job.last_error


@pytest.mark.django_db(transaction=True)
def test_a_renewal_never_shortens_a_lease_the_task_extended():
    JobFactory(lease=timedelta(seconds=3))
    job = claim_one()
    assert Job.objects.renew(job.id, job.attempts, timedelta(seconds=60))  # extend_lease(60)

    assert Job.objects.renew(job.id, job.attempts)  # the worker's own renewal

    assert Job.objects.filter(id=job.id, leased_until__gt=Now() + timedelta(seconds=55)).exists()


# -- issue 14, item 1: the claim takes exactly what its QuerySet describes ---------------


ROW = st.tuples(
    st.sampled_from(["default", "other", "third"]),  # queue
    st.integers(min_value=-2, max_value=2),  # priority
    st.integers(min_value=-3, max_value=2),  # run_at: seconds ago, or (> 0) minutes ahead
    st.sampled_from(["pending", "pending", "pending", "running", "done"]),  # state
)


@pytest.mark.django_db(transaction=True)
@hypothesis_settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    rows=st.lists(ROW, max_size=25),
    queues=st.lists(st.sampled_from(["default", "other", "third"]), min_size=1, unique=True),
    limit=st.integers(min_value=1, max_value=8),
)
def test_the_claim_takes_exactly_the_rows_and_order_its_queryset_describes(rows, queues, limit):
    Job.objects.all().delete()
    jobs = [
        Job(
            task="tests.testapp.tasks.add",
            args=[1, 2],
            queue_name=queue,
            priority=priority,
            run_at=Now()
            + (timedelta(minutes=offset) if offset > 0 else timedelta(seconds=offset - 1))
            + timedelta(milliseconds=index),
            state=state,
            lease=timedelta(seconds=30),
            max_attempts=5,
            attempts=0 if state == "pending" else 1,
        )
        for index, (queue, priority, offset, state) in enumerate(rows)
    ]
    Job.objects.bulk_create(jobs)
    with transaction.atomic():  # the QuerySet, evaluated (and locked) the ORM's way
        described = list(Job.objects.claimable(queues).values_list("id", flat=True)[:limit])
        transaction.set_rollback(True)

    claimed = [job.id for job in Job.objects.claim(queues=queues, limit=limit)]

    assert claimed == described
    assert Job.objects.filter(id__in=claimed, state="running", attempts=1).count() == len(claimed)


@pytest.mark.django_db(transaction=True)
def test_renew_many_renews_each_held_attempt_in_one_statement_and_only_those():
    """The housekeeper's batched renewal fences each row as `renewal` does: a stale
    attempt, a lease already run out, a finished job and a cancel request are left as
    they are; the others get now + their own lease (clamped), never less."""
    JobFactory.create_batch(6, lease=timedelta(seconds=2))
    held, stale, expired, finished, cancelled, extended = Job.objects.claim(
        queues=["default"], limit=6
    )
    set_lease(expired.id, -1)
    Job.objects.ack(finished.id, finished.attempts)
    Job.objects.filter(id=cancelled.id).update(cancel_requested_at=Now())
    assert Job.objects.renew(extended.id, extended.attempts, timedelta(minutes=5))
    time.sleep(0.5)  # the renewed leases must end later than the claim's did
    pairs = [(job.id, job.attempts) for job in (held, expired, finished, cancelled, extended)]

    with CaptureQueriesContext(connection) as queries:
        renewed = Job.objects.renew_many([*pairs, (stale.id, stale.attempts - 1)])

    assert renewed == {held.id, extended.id}
    assert len(queries) == 1
    soon = Now() + timedelta(seconds=1.8)
    assert Job.objects.filter(id=held.id, leased_until__gt=soon).exists()
    assert Job.objects.filter(id=stale.id, leased_until__lt=soon).exists()
    assert Job.objects.filter(id=cancelled.id, leased_until__lt=soon).exists()
    assert Job.objects.filter(id=expired.id, leased_until__lt=Now()).exists()
    assert Job.objects.filter(id=extended.id, leased_until__gt=Now() + timedelta(minutes=4))
    assert Job.objects.get(id=finished.id).state == JobState.DONE
    assert Job.objects.renew_many([]) == set()


@pytest.mark.django_db(transaction=True)
def test_release_many_gives_back_each_held_attempt_in_one_statement_and_only_those():
    """A stop's release of its buffered jobs: pending again and due, no attempt spent
    (`max_attempts` + 1), counted in `releases`; a stale attempt, a lease run out, a
    finished job and a cancel request are left to the one-by-one path."""
    JobFactory.create_batch(5, lease=timedelta(seconds=30), max_attempts=3)
    held, stale, expired, finished, cancelled = Job.objects.claim(queues=["default"], limit=5)
    set_lease(expired.id, -1)
    Job.objects.ack(finished.id, finished.attempts)
    Job.objects.filter(id=cancelled.id).update(cancel_requested_at=Now())
    pairs = [(job.id, job.attempts) for job in (held, expired, finished, cancelled)]

    with CaptureQueriesContext(connection) as queries:
        released = Job.objects.release_many([*pairs, (stale.id, stale.attempts - 1)])

    assert released == {held.id}
    assert len(queries) == 1
    held.refresh_from_db()
    assert (held.state, held.attempts, held.max_attempts, held.releases) == ("pending", 1, 4, 1)
    assert held.leased_until is None
    assert Job.objects.due().filter(id=held.id).exists()
    assert set(Job.objects.filter(releases=0).values_list("state", flat=True)) == {
        "running",
        "done",
    }
    assert Job.objects.release(cancelled.id, cancelled.attempts)  # one by one: cancelled
    assert Job.objects.get(id=cancelled.id).state == JobState.CANCELLED
    assert Job.objects.release_many([]) == set()


@pytest.mark.django_db(transaction=True)
def test_a_stop_releases_its_held_jobs_in_one_statement_and_cancels_the_one_asked_to(caplog):
    from django_skipqueue.runtime.executor import release_on_shutdown

    caplog.set_level(logging.INFO, logger="django_skipqueue")
    JobFactory.create_batch(200, lease=timedelta(seconds=30))
    claimed = Job.objects.claim(queues=["default"], limit=200)
    asked = claimed[7]
    Job.objects.filter(id=asked.id).update(cancel_requested_at=Now())

    with CaptureQueriesContext(connection) as queries:
        released = release_on_shutdown([(job, job.attempts) for job in claimed], "default")

    assert released == 199  # the one asked to stop ends cancelled: not counted as released
    updates = [q for q in queries if q["sql"].lstrip().upper().startswith("UPDATE")]
    assert len(updates) <= 3  # the batch; then the one asked to stop: release, end_cancelled
    assert Job.objects.filter(state=JobState.PENDING, releases=1).count() == 199
    assert Job.objects.get(id=asked.id).state == JobState.CANCELLED
    said = [r.getMessage() for r in caplog.records if "on shutdown" in r.getMessage()]
    assert said == [
        "jobs released on shutdown count=199 ids="
        + ",".join([str(job.id) for job in claimed if job.id != asked.id][:20])
        + ",...",
        f"jobs cancelled on shutdown (a cancel was requested) count=1 ids={asked.id}",
    ]


@pytest.mark.django_db(transaction=True)
def test_a_stop_whose_connection_was_ended_releases_its_jobs_on_a_new_one():
    """The worker's session was ended (a restart, pg_terminate_backend) before its stop:
    the release goes through on a new connection instead of leaving every held job to
    the reaper (an outside trial: 301 jobs left running to expire)."""
    from django_skipqueue.runtime.executor import release_on_shutdown

    JobFactory.create_batch(30, lease=timedelta(seconds=30))
    claimed = Job.objects.claim(queues=["default"], limit=30)
    pid = connection.connection.info.backend_pid
    other = connection.get_new_connection(connection.get_connection_params())
    try:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    finally:
        other.close()

    released = release_on_shutdown([(job, job.attempts) for job in claimed], "default")

    assert released == 30
    assert Job.objects.filter(state=JobState.PENDING, releases=1).count() == 30
