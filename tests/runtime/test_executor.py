"""Running one claimed job: lookup, call, and the fenced outcome."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.utils import timezone

from django_skipqueue import Retry, signals
from django_skipqueue.models import Job, JobState
from django_skipqueue.runtime.executor import Outcome, execute
from tests.conftest import set_lease
from tests.factories import JobFactory
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import Run


def claim_one() -> Job:
    [job] = Job.objects.claim(queues=["default"])
    return job


def run() -> tuple[Job, Outcome]:
    claimed = claim_one()
    execution = execute(claimed)
    claimed.refresh_from_db()
    return claimed, execution.outcome


def run_when_due(deadline: float = 10.0) -> tuple[Job, Outcome]:
    """Run the next job once its retry backoff (on the database clock) has passed."""
    give_up = time.monotonic() + deadline
    while not Job.objects.due().exists():
        assert time.monotonic() < give_up, "no job became due in time"
        time.sleep(0.01)
    return run()


@pytest.fixture
def received():
    """Every job signal sent during the test, as (signal name, kwargs)."""
    seen: list[tuple[str, dict]] = []
    receivers = {}
    for name in (
        "job_started",
        "job_succeeded",
        "job_retried",
        "job_failed",
        "job_released",
        "job_lost",
        "job_outcome_unknown",
    ):

        def receiver(sender, _name=name, **kwargs):
            kwargs.pop("signal")
            seen.append((_name, kwargs))

        receivers[name] = receiver
        getattr(signals, name).connect(receiver, weak=False)
    yield seen
    for name, receiver in receivers.items():
        getattr(signals, name).disconnect(receiver)


@pytest.mark.django_db(transaction=True)
def test_a_task_that_returns_is_acked_with_its_result(received):
    tasks.add.enqueue(2, 3)

    job, outcome = run()

    assert outcome is Outcome.SUCCEEDED
    assert (job.state, job.result) == (JobState.DONE, 5)
    assert [name for name, _ in received] == ["job_started", "job_succeeded"]
    assert received[1][1]["result"] == 5


@pytest.mark.django_db(transaction=True)
def test_a_context_task_gets_its_job_id_attempt_and_a_stable_key():
    job = tasks.record.enqueue()

    done, outcome = run()

    assert outcome is Outcome.SUCCEEDED
    assert done.result == {"job_id": job.id, "attempt": 1, "key": f"skipqueue-job-{job.id}"}
    assert done.idempotency_key == done.result["key"]


@pytest.mark.django_db(transaction=True)
def test_an_async_task_runs_to_completion():
    tasks.async_add.enqueue(4, 5)
    job, outcome = run()
    assert (outcome, job.result) == (Outcome.SUCCEEDED, 9)


@pytest.mark.django_db(transaction=True)
def test_a_raising_task_is_retried_after_a_backoff_then_fails(received):
    tasks.always_fails.enqueue("bad gateway")  # max_attempts=3, base 0.01 s

    job, outcome = run()
    assert outcome is Outcome.RETRYING
    assert job.state == JobState.PENDING
    assert job.errors[0]["type"] == "builtins.RuntimeError"
    assert "bad gateway" in job.errors[0]["traceback"]
    assert job.last_error == "builtins.RuntimeError: bad gateway"

    outcomes = [run_when_due()[1], run_when_due()[1]]
    job.refresh_from_db()
    assert outcomes == [Outcome.RETRYING, Outcome.FAILED]
    assert (job.state, job.attempts) == (JobState.FAILED, 3)
    assert [entry["attempt"] for entry in job.errors] == [1, 2, 3]
    names = [name for name, _ in received]
    assert names.count("job_retried") == 2 and names.count("job_failed") == 1


@pytest.mark.django_db(transaction=True)
def test_the_retry_delay_follows_the_tasks_policy():
    tasks.always_fails.using().enqueue()
    job = claim_one()
    execute(job)
    job.refresh_from_db()
    # base 0.01 s +/- 10 %, measured on the database clock from the failure entry's time.
    assert Job.objects.filter(id=job.id, run_at__lte=Now() + timedelta(seconds=0.011)).exists()


@pytest.mark.django_db(transaction=True)
def test_a_non_retryable_error_fails_at_once():
    tasks.rejects_input.enqueue("x")  # max_attempts=5
    job, outcome = run()
    assert (outcome, job.state, job.attempts) == (Outcome.FAILED, JobState.FAILED, 1)
    assert job.last_error == "builtins.ValueError: cannot use 'x'"


@pytest.mark.django_db(transaction=True)
def test_retry_gives_the_attempt_back_and_runs_again(received):
    tasks.retry_once.enqueue()

    job, outcome = run()
    assert outcome is Outcome.RELEASED
    assert (job.state, job.attempts, job.max_attempts, job.releases) == (
        JobState.PENDING,
        1,
        job.max_attempts,
        1,
    )
    assert "job_released" in [name for name, _ in received]

    job, outcome = run()
    assert (outcome, job.result, job.attempts) == (Outcome.SUCCEEDED, "second time", 2)


@pytest.mark.django_db(transaction=True)
def test_retry_with_a_delay_is_not_claimed_before_it():
    tasks.retry_once.enqueue(delay=3600)
    run()
    assert Job.objects.claim(queues=["default"]) == []
    assert Job.objects.scheduled().count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_unknown_task_name_fails_that_attempt_with_a_clear_error(caplog):
    JobFactory(task="os.system", args=["touch /tmp/pwned"], max_attempts=2)

    job, outcome = run()

    assert outcome is Outcome.RETRYING  # a newer worker may know it (rolling deploy)
    assert job.errors[0]["type"] == "django_skipqueue.exceptions.UnknownTaskError"
    assert "no task named 'os.system' is registered" in job.last_error
    assert "job task unknown" in caplog.text
    job, outcome = run_when_due()
    assert (outcome, job.state) == (Outcome.FAILED, JobState.FAILED)


@pytest.mark.django_db(transaction=True)
def test_malformed_arguments_in_a_row_fail_without_retry():
    JobFactory(args={"not": "a list"})
    job, outcome = run()
    assert (outcome, job.state, job.attempts) == (Outcome.FAILED, JobState.FAILED, 1)
    assert "malformed arguments" in job.last_error


@pytest.mark.django_db(transaction=True)
def test_a_return_value_that_is_not_json_fails_the_job():
    tasks.returns_object.enqueue()
    job, outcome = run()
    assert (outcome, job.state) == (Outcome.FAILED, JobState.FAILED)
    assert "the return value is a builtins.object" in job.last_error
    assert "Object of type object is not JSON serializable" in job.last_error  # json's words
    assert job.result is None


@pytest.mark.django_db(transaction=True)
def test_system_exit_from_a_task_is_recorded_as_a_failure():
    tasks.exits.enqueue()
    job, outcome = run()
    assert outcome is Outcome.RETRYING
    assert job.errors[0]["type"] == "builtins.SystemExit"


@pytest.mark.django_db(transaction=True)
def test_an_attempt_that_lost_its_lease_is_not_reported_done(received):
    tasks.record.enqueue()
    job = claim_one()
    set_lease(job.id, -1)
    Job.objects.reap()
    newer = claim_one()

    execution = execute(job)  # the body runs, but its ack is refused by the fence

    assert execution.outcome is Outcome.LOST
    newer.refresh_from_db()
    assert (newer.state, newer.attempts) == (JobState.RUNNING, 2)
    assert [name for name, _ in received] == ["job_started", "job_lost"]
    assert Run.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_task_can_extend_its_own_lease():
    tasks.extends_lease.enqueue(3600)  # its own lease is 1 s
    job, outcome = run()
    assert (outcome, job.result) == (Outcome.SUCCEEDED, True)


@pytest.mark.django_db(transaction=True)
def test_logs_carry_id_task_and_attempt_but_never_arguments_or_results(caplog):
    caplog.set_level(logging.DEBUG, logger="django_skipqueue")
    job = tasks.add.enqueue("zq9x-", "vw7k")  # returns the joined secret
    tasks.always_fails.enqueue("boom")

    run()
    run()

    assert f"job succeeded id={job.id} task=tests.testapp.tasks.add attempt=1" in caplog.text
    assert "job raised" in caplog.text
    assert "zq9x" not in caplog.text and "vw7k" not in caplog.text


@pytest.mark.django_db(transaction=True)
def test_s14_a_return_value_over_the_payload_limit_fails_and_is_not_stored(settings):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "MAX_PAYLOAD_BYTES": 100}
    tasks.repeats.enqueue("ab", 100)  # small arguments, a 202-byte result
    job, outcome = run()
    assert outcome is Outcome.FAILED  # not retried: it would fail the same way
    assert (job.state, job.attempts, job.result) == (JobState.FAILED, 1, None)
    assert "the return value takes 202 bytes as stored" in job.last_error


# -- issue 12, item 1: no job runs inside another job's transaction --------------------


def _failed_as_left_open(leaky: Job) -> Job:
    """The next job run, which must be `leaky`, failed at its first attempt with
    TransactionLeftOpenError."""
    job, outcome = run()
    assert job.id == leaky.id
    assert (outcome, job.state, job.attempts) == (Outcome.FAILED, JobState.FAILED, 1)
    assert "TransactionLeftOpenError" in job.errors[0]["type"]
    return job


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("fail_in_it", [False, True], ids=["open", "failed"])
def test_a_raw_transaction_left_open_is_rolled_back_and_fails_the_job(fail_in_it):
    from django.db import connection

    leaky = tasks.begins_raw_transaction.enqueue(fail_in_it=fail_in_it)
    after = [tasks.record.enqueue() for _ in range(3)]

    job = _failed_as_left_open(leaky)
    assert "its writes were rolled back" in job.last_error
    assert int(connection.connection.info.transaction_status) == 0  # IDLE: nothing open
    for _ in after:  # later jobs on this thread commit their own writes
        assert run()[1] is Outcome.SUCCEEDED
    connection.close()  # read from a new session: only committed rows are there
    assert not Run.objects.filter(job_id=leaky.id).exists()
    assert set(Run.objects.values_list("job_id", flat=True)) == {job.id for job in after}


@pytest.mark.django_db(transaction=True)
def test_a_statement_left_running_in_autocommit_is_not_said_to_be_rolled_back():
    """A task that returns while its autocommit INSERT is still running (a time limit's
    interrupt right after the send leaves one so): the job fails, the connection is
    closed, and the error does not say that the writes were rolled back, for the
    INSERT may commit (found by an outside trial: the runner said so, and the row was
    there)."""
    from django.db import connection

    leaky = tasks.leaves_a_statement_running.enqueue()
    after = tasks.record.enqueue()
    job = _failed_as_left_open(leaky)
    assert "a statement still running in autocommit on 'default'" in job.last_error
    assert "may have committed" in job.last_error
    assert "its writes were rolled back" not in job.last_error
    assert run()[1] is Outcome.SUCCEEDED
    connection.close()
    # The server goes on with the INSERT after the close, and commits it: waited for,
    # so that its row cannot land in a later test's tables.
    wait_until(lambda: Run.objects.filter(job_id=leaky.id).exists(), timeout=10)
    assert set(Run.objects.values_list("job_id", flat=True)) == {leaky.id, after.id}


@pytest.mark.django_db(transaction=True)
def test_a_task_that_turns_autocommit_off_and_leaves_its_writes_uncommitted_fails():
    """set_autocommit(False), a write, no commit: the write is rolled back and the job
    fails, named (before, the worker acked a success on another connection and the
    write vanished when the thread's connection was recycled; found by an outside
    trial). Committed but left off, the job succeeds with its write, and the next jobs on
    the thread run in autocommit again."""
    from django.db import connection

    leaky = tasks.turns_autocommit_off.enqueue()
    committed = tasks.turns_autocommit_off.enqueue(commit=True)
    after = tasks.record.enqueue()

    job = _failed_as_left_open(leaky)
    assert "set_autocommit(False) on 'default'" in job.last_error
    job, outcome = run()
    assert (job.id, outcome) == (committed.id, Outcome.SUCCEEDED)
    connection.close()  # as the worker's refresh after a job does: autocommit was left off
    assert run()[1] is Outcome.SUCCEEDED
    connection.close()  # read from a new session: only committed rows are there
    assert set(Run.objects.values_list("job_id", flat=True)) == {committed.id, after.id}


@pytest.fixture
def second_alias():
    """A second alias on this thread: another connection to the same PostgreSQL database
    (made here, not in DATABASES, so that the test case's guard of other aliases lets it
    connect)."""
    from django.db import connections
    from django.db.utils import load_backend

    settings_dict = connections.settings["default"]
    other = load_backend(settings_dict["ENGINE"]).DatabaseWrapper({**settings_dict}, "second")
    connections["second"] = other
    yield "second"
    other.close()
    del connections["second"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["set", "one"])
def test_a_transaction_left_open_after_a_session_change_still_fails_the_job(how):
    """A session change (a SET, several statements in one call) made the watch close the
    connection before the check for an open transaction looked at it: the task's writes
    vanished and the job succeeded (found by an outside trial)."""
    leaky = tasks.turns_autocommit_off.enqueue(how=how)
    job, outcome = run()
    assert (job.id, outcome, job.state) == (leaky.id, Outcome.FAILED, JobState.FAILED)
    assert "TransactionLeftOpenError" in job.errors[0]["type"]
    assert not Run.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_transaction_left_open_that_only_read_is_ended_quietly():
    """No transaction id was assigned: nothing was written, nothing is lost; the job
    succeeds, and the next one runs in autocommit."""
    tasks.turns_autocommit_off.enqueue(how="read")
    job, outcome = run()
    assert (outcome, job.state) == (Outcome.SUCCEEDED, JobState.DONE)
    tasks.record.enqueue()
    assert run()[1] is Outcome.SUCCEEDED
    assert Run.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_alias_configured_without_autocommit_never_carries_a_jobs_writes_to_the_next(
    second_alias,
):
    """Such an alias's code commits its own writes. Uncommitted ones are rolled back and
    fail the job (before, the next job's commit carried them, or they vanished); a job
    that only read there succeeds, and its transaction is ended."""
    from django.db import connections

    other = connections[second_alias]
    other.settings_dict["AUTOCOMMIT"] = False
    uncommitted = tasks.turns_autocommit_off.enqueue(how="plain", alias=second_alias)
    reads = tasks.turns_autocommit_off.enqueue(how="read", alias=second_alias)
    committed = tasks.turns_autocommit_off.enqueue(how="plain", alias=second_alias, commit=True)
    job, outcome = run()
    assert (job.id, outcome) == (uncommitted.id, Outcome.FAILED)
    assert "on an alias whose AUTOCOMMIT is off on 'second'" in job.last_error
    job, outcome = run()
    assert (job.id, outcome) == (reads.id, Outcome.SUCCEEDED)
    job, outcome = run()
    assert (job.id, outcome) == (committed.id, Outcome.SUCCEEDED)
    assert list(Run.objects.values_list("job_id", flat=True)) == [committed.id]


@pytest.mark.django_db(transaction=True)
def test_an_atomic_block_left_open_on_another_alias_is_rolled_back_and_fails_the_job(
    second_alias,
):
    """Before, only the job's own alias was looked at: the block stayed open on the
    thread's other connection, its write never committed, the job succeeded, and every
    later job's writes on that alias joined the same transaction (found by an outside
    trial)."""
    from django.db import connections

    leaky = tasks.leaves_atomic_open_on.enqueue(second_alias)
    job, outcome = run()
    assert (job.id, outcome, job.state) == (leaky.id, Outcome.FAILED, JobState.FAILED)
    assert "1 atomic() block(s) on 'second', entered and never exited" in job.last_error
    other = connections[second_alias]
    assert not other.in_atomic_block and other.atomic_blocks == []
    Run.objects.using(second_alias).create(job_id=-1, attempt=1, pid=0)  # autocommit again
    other.close()
    assert list(Run.objects.values_list("job_id", flat=True)) == [-1]  # not the task's


@pytest.mark.django_db(transaction=True)
def test_a_task_that_returns_inside_its_own_atomic_block_is_still_caught():
    tasks.leaves_transaction_open.enqueue()
    job, outcome = run()
    assert outcome is Outcome.FAILED  # not retried: it would leave it open again
    assert "1 atomic() block(s) on 'default'" in job.last_error


# -- issue 12, item 4: errors that cannot be stored as they are ------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("kind", "shown"),
    [
        ("nul", "bad byte \\x00 in the input"),
        ("surrogate", "half a character: \\udc80"),
        ("unprintable", "<str() of the exception raised RuntimeError>"),
    ],
)
def test_an_error_whose_text_cannot_be_stored_is_stored_escaped_and_not_retried(kind, shown):
    tasks.raises_unstorable.enqueue(kind)
    job, outcome = run()
    assert (outcome, job.state, job.attempts) == (Outcome.FAILED, JobState.FAILED, 1)
    [entry] = job.errors
    assert entry["message"] == shown
    assert entry["type"].endswith("Error")
    assert "raises_unstorable" in entry["traceback"]  # the real traceback, not a lease expiry
    assert job.last_error.endswith(shown)


# -- issue 14, item 3: an outcome that could not be written is unknown, not lost -------


@pytest.mark.django_db(transaction=True)
def test_an_ack_with_no_answer_within_a_lease_is_unknown_not_refused(received, caplog):
    from django.db import connection

    job = tasks.fails_over_before_its_ack.enqueue()
    [claimed] = Job.objects.claim(queues=["default"])
    try:
        execution = execute(claimed)
    finally:
        connection.close()
        with connection.cursor() as cursor:  # the failover ends
            cursor.execute("SET default_transaction_read_only = off")  # this session first
            cursor.execute("SELECT current_database()")
            name = cursor.fetchone()[0]
            cursor.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
        connection.close()
    assert execution.outcome is Outcome.UNKNOWN
    assert "job outcome unknown" in caplog.text and "job lease lost" not in caplog.text
    assert [name for name, _ in received][-1] == "job_outcome_unknown"
    assert Job.objects.get(id=job.id).state == JobState.RUNNING  # the reaper's, now


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("raw", [False, True])
def test_a_task_that_changes_its_session_does_not_poison_the_jobs_after_it(raw, caplog):
    from django_skipqueue.runtime.worker import Worker
    from tests.testapp import tasks as more

    more.changes_its_session.enqueue("SET search_path TO pg_catalog", raw=raw)
    failing = [more.always_fails.using(max_attempts=1).enqueue("own error") for _ in range(5)]
    Worker(concurrency=1, burst=True, listen=False, reap_interval=0).run()

    for job in failing:
        job.refresh_from_db()
        assert job.state == "failed"
        assert "own error" in job.last_error  # its own error, not a lost lease
    assert "could not record" not in caplog.text


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("statement", "params"),
    [
        ("/* x */ SET search_path TO pg_catalog", None),
        ("-- a note\nset search_path to pg_catalog", None),
        ("SELECT set_config('search_path', 'pg_catalog', %s)", [False]),
        ("DO $$BEGIN EXECUTE 'SET search_path TO pg_catalog'; END$$", None),
        ("SELECT 1; SET search_path TO pg_catalog", None),
    ],
    ids=["comment", "line comment", "set_config with a parameter", "DO block", "two statements"],
)
def test_session_changes_in_other_forms_do_not_poison_later_jobs(statement, params, caplog):
    """Trial finding F6: each of these slipped past the SET check."""
    from django_skipqueue.runtime.worker import Worker
    from tests.testapp import tasks as more

    more.changes_its_session.enqueue(statement, params=params)
    innocent = [more.probe.using(max_attempts=1).enqueue() for _ in range(3)]
    Worker(concurrency=1, burst=True, listen=False, reap_interval=0).run()
    for job in innocent:  # each writes through the ORM: it needs our search_path
        job.refresh_from_db()
        assert (job.id, job.state, job.last_error) == (job.id, "done", "")


@pytest.mark.django_db(transaction=True)
def test_a_temporary_table_that_hides_ours_does_not_swallow_later_writes():
    """A task's temporary table named like one of the project's hid it for every later
    job on that thread: their writes went to the temporary table and vanished."""
    from django_skipqueue.runtime.worker import Worker
    from tests.testapp import tasks as more
    from tests.testapp.models import Run

    more.changes_its_session.enqueue(
        "CREATE TEMP TABLE testapp_run (LIKE public.testapp_run INCLUDING ALL)"
    )
    probes = [more.probe.enqueue() for _ in range(3)]
    Worker(concurrency=1, burst=True, listen=False, reap_interval=0).run()
    assert set(Run.objects.values_list("job_id", flat=True)) == {job.id for job in probes}


@pytest.mark.parametrize(
    ("sql", "changes"),
    [
        ("UPDATE skipqueue_job SET state = 'done' WHERE id = 1", False),
        ("SELECT * FROM t WHERE note = 'SET x'", False),
        ("SET LOCAL statement_timeout = 1000", False),
        ("SELECT pg_advisory_xact_lock(1)", False),
        ("SELECT pg_advisory_lock(1)", True),
        ("LISTEN anything", True),
        ("CREATE TEMPORARY VIEW v AS SELECT 1", True),
        ("DECLARE c CURSOR WITH HOLD FOR SELECT 1", True),
        ("SELECT 1;", False),
    ],
)
def test_which_statements_count_as_changing_the_session(sql, changes):
    from django_skipqueue.runtime.runner import changes_session

    assert changes_session(sql) is changes


@pytest.mark.django_db(transaction=True)
def test_a_counted_retry_spends_attempts_then_fails_with_its_cause(received):
    """Retry's default is Celery's self.retry(countdown=...): it counts against the
    job's attempts, waits its own delay (not the backoff policy's), and after the last
    attempt the job ends failed with the retry and the exception it was raised from."""
    tasks.retry_counted.enqueue()  # max_attempts=3, asks for a retry every time

    for attempt in (1, 2):
        job, outcome = run()
        assert (outcome, job.state, job.attempts, job.max_attempts) == (
            Outcome.RETRYING,
            JobState.PENDING,
            attempt,
            3,
        )
        assert job.releases == 0
        assert job.run_at <= timezone.now()  # delay 0: not the policy's backoff
    job, outcome = run()
    assert (outcome, job.state, job.attempts) == (Outcome.FAILED, JobState.FAILED, 3)
    assert [e["type"] for e in job.errors] == ["django_skipqueue.exceptions.Retry"] * 3
    assert "after the last attempt (3 of 3" in job.last_error
    assert "ConnectionError: the provider is down" in job.errors[-1]["traceback"]
    assert [name for name, _ in received].count("job_retried") == 2


@pytest.mark.django_db(transaction=True)
def test_a_counted_retry_waits_its_own_delay_and_can_succeed_later():
    tasks.retry_counted.enqueue(delay=3600, until=2)
    job, outcome = run()
    assert outcome is Outcome.RETRYING
    assert job.run_at > timezone.now() + timedelta(minutes=59)
    assert Job.objects.claim(queues=["default"]) == []
    Job.objects.filter(id=job.id).update(run_at=Now())
    job, outcome = run()
    assert (outcome, job.state, job.result, job.attempts) == (
        Outcome.SUCCEEDED,
        JobState.DONE,
        2,
        2,
    )


def test_retry_refuses_a_spend_attempt_that_is_not_a_bool():
    from django_skipqueue.exceptions import InvalidJobError

    with pytest.raises(InvalidJobError, match="spend_attempt must be True or False"):
        Retry(1, spend_attempt="no")


def test_the_check_for_a_transaction_left_open_reads_a_sqlite_connection_too():
    """A task may use another alias of another backend (a SQLite file beside the
    PostgreSQL database): the check after the task reads SQLite's own flag instead of
    failing on psycopg's attributes (which broke the worker's thread for every later
    job), and leaves a driver that says nothing alone."""
    import sqlite3

    from django_skipqueue.runtime.runner import _transaction_status

    raw = sqlite3.connect(":memory:", isolation_level=None)  # Django's autocommit
    try:
        assert _transaction_status(raw) == 0
        raw.execute("BEGIN")
        assert _transaction_status(raw) == 2  # INTRANS: closed by the check
        raw.execute("ROLLBACK")
        assert _transaction_status(raw) == 0
    finally:
        raw.close()
    assert _transaction_status(object()) is None


@pytest.mark.django_db(transaction=True)
def test_an_atomic_block_a_job_started_receiver_leaves_open_fails_that_job_only():
    """A receiver of job_started that enters atomic() and never exits: its block is
    rolled back after the task like the task's own (before, it counted as the caller's
    and the outcome's write retried for ever), and the next jobs run as usual."""
    from django.db import transaction

    def leaves_atomic_open(sender, job, **kwargs):
        if job.task == tasks.add.name:
            transaction.atomic().__enter__()

    signals.job_started.connect(leaves_atomic_open, weak=False)
    try:
        tasks.add.enqueue(1, 2)
        job, outcome = run()
    finally:
        signals.job_started.disconnect(leaves_atomic_open)
    assert (outcome, job.state) == (Outcome.FAILED, JobState.FAILED)
    assert "1 atomic() block(s) on 'default'" in job.last_error
    tasks.record.enqueue()
    assert run()[1] is Outcome.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_a_job_started_receiver_that_raises_fails_the_attempt_and_the_task_is_not_called():
    """A receiver's exception is the attempt's failure, retried by the task's policy, as
    the task raising it would be (before, it escaped execute() and the job waited for its
    lease to run out). One that also left atomic() open has that block rolled back and
    named, and the job failed."""
    from django.db import transaction

    def raises(sender, job, **kwargs):
        if job.task == tasks.record.name:
            if job.kwargs.get("first_only"):  # the second job: leaves atomic() open too
                transaction.atomic().__enter__()
            raise ValueError("tenant not found")

    signals.job_started.connect(raises, weak=False)
    try:
        tasks.record.enqueue()
        job, outcome = run()
        assert (outcome, job.state) == (Outcome.RETRYING, JobState.PENDING)
        assert job.errors[0]["type"] == "builtins.ValueError"
        assert "tenant not found" in job.last_error
        assert not Run.objects.exists()  # the task never ran
        Job.objects.all().delete()
        tasks.record.enqueue(first_only=True)
        job, outcome = run()
        assert (outcome, job.state) == (Outcome.FAILED, JobState.FAILED)
        assert "1 atomic() block(s) on 'default'" in job.last_error
    finally:
        signals.job_started.disconnect(raises)
    tasks.record.enqueue()
    assert run()[1] is Outcome.SUCCEEDED and Run.objects.count() == 1


# -- issue 52, point 7 ------------------------------------------------------------------


def _boom(sender, job, **kwargs):
    raise RuntimeError("the receiver's own bug")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("signal_name", ["job_failed", "job_succeeded"])
def test_an_outcome_receiver_that_raises_changes_nothing_but_a_line_naming_it(caplog, signal_name):
    """The outcome is written before its signal: a receiver that raises changed the
    worker's word to "could not record job" (false) and dropped the attempt from its
    counts. Now its execution is returned as any other, and one line names the
    receiver."""
    caplog.set_level(logging.INFO, logger="django_skipqueue")
    getattr(signals, signal_name).connect(_boom, weak=False)
    try:
        if signal_name == "job_failed":
            tasks.always_fails.using(max_attempts=1).enqueue()
        else:
            tasks.add.enqueue(1, 2)
        job, outcome = run()
    finally:
        getattr(signals, signal_name).disconnect(_boom)
    expected = Outcome.FAILED if signal_name == "job_failed" else Outcome.SUCCEEDED
    assert outcome == expected
    lines = [r.getMessage() for r in caplog.records if "receiver raised" in r.getMessage()]
    assert len(lines) == 1 and f"signal={signal_name}" in lines[0] and "_boom" in lines[0]


@pytest.mark.django_db(transaction=True)
def test_a_retry_the_task_asks_for_is_one_info_line_not_an_error(caplog):
    """`raise Retry(delay=5)` is the task's plan: Celery logs it at INFO; an ERROR with a
    traceback made every planned retry an error event (Sentry)."""
    caplog.set_level(logging.DEBUG, logger="django_skipqueue")
    tasks.retry_counted.enqueue(delay=5.0, until=2)
    job, outcome = run()
    assert (outcome, job.state) == (Outcome.RETRYING, JobState.PENDING)
    ours = [r for r in caplog.records if r.name.startswith("django_skipqueue")]
    assert not [r for r in ours if r.levelno >= logging.ERROR], [r.getMessage() for r in ours]
    [line] = [r for r in ours if "job retry requested" in r.getMessage()]
    assert line.levelno == logging.INFO and "in=5.000s" in line.getMessage()
