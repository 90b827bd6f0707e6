"""The database's payload ceiling (T28, migration 0020): 4 MiB of JSON text for a job's
arguments and for its result, refused where a write sets them, and never measured again
by the writes that do not (claims, renewals, acks without a result). Several cases here
came from an outside trial of a first version (BEFORE triggers, one transaction)."""

from __future__ import annotations

import importlib
import threading

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, connections, transaction

from django_skipqueue.models import Job, JobState
from tests.locks import migration_held_up_by_a_long_transaction
from tests.processes import wait_until
from tests.testapp import tasks

CEILING = 4 * 1024 * 1024
OVER = "x" * CEILING  # its JSON text adds the quotes: over the ceiling by two bytes
TRIGGERS = {"skipqueue_job_payload_size", "skipqueue_job_result_size"}


def _constraint_and_triggers() -> tuple[bool | None, set[str]]:
    """Whether 0003's CHECK is there (and validated), and the payload triggers."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT convalidated FROM pg_constraint WHERE conname = 'skipqueue_job_payload_size'"
        )
        row = cursor.fetchone()
        cursor.execute(
            "SELECT tgname FROM pg_trigger WHERE tgname IN"
            " ('skipqueue_job_payload_size', 'skipqueue_job_result_size')"
        )
        return (row[0] if row else None), {name for (name,) in cursor.fetchall()}


def _store_over_the_ceiling() -> int:
    """A pending job whose arguments are over the ceiling, as no write could store it
    now: written with the trigger off (a row from before a lower ceiling, say)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("ALTER TABLE skipqueue_job DISABLE TRIGGER skipqueue_job_payload_size")
        job = tasks.add.enqueue(1, 2)
        cursor.execute(
            "UPDATE skipqueue_job SET args = jsonb_build_array(%s::text) WHERE id = %s",
            [OVER, job.id],
        )
        cursor.execute("ALTER TABLE skipqueue_job ENABLE ALWAYS TRIGGER skipqueue_job_payload_size")
    return job.id


@pytest.mark.django_db(transaction=True)
def test_an_update_that_sets_a_payload_over_the_ceiling_is_refused_and_the_row_kept():
    job = tasks.add.enqueue(1, 2)
    with transaction.atomic():
        for columns in ({"args": [OVER]}, {"kwargs": {"a": OVER}}, {"result": OVER}):
            with (
                pytest.raises(IntegrityError, match="skipqueue_job_payload_size") as raised,
                transaction.atomic(),
            ):
                Job.objects.filter(id=job.id).update(**columns)
            what = "result takes" if "result" in columns else "args and kwargs take"
            assert f"job {job.id}: its {what} " in str(raised.value)
        # the caller's transaction goes on, and a payload at the ceiling is taken
        # ('[]' and '{"a": "..."}': 11 bytes around the text)
        assert Job.objects.filter(id=job.id).update(args=[], kwargs={"a": "x" * (CEILING - 11)})
        assert Job.objects.filter(id=job.id).update(result="x" * (CEILING - 2))
    job.refresh_from_db()
    assert (job.args, len(job.kwargs["a"]), len(job.result)) == ([], CEILING - 11, CEILING - 2)


def _insert_raw(args_sql: str, result_sql: str, value: str) -> None:
    """A job row written by raw SQL (another service's), `value` its one parameter."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO skipqueue_job (task, args, kwargs, result, queue_name, priority,"
            " state, lease, attempts, max_attempts, expirations, releases, last_error, errors)"
            f" VALUES ('t', {args_sql}, '{{}}', {result_sql}, 'default', 0, 'pending',"
            " '1 minute', 0, 1, 0, 0, '', '[]')",
            [value],
        )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("args_sql", "result_sql", "around"),
    # bytes of JSON text around the value: '["..."]' and '{}' (kwargs), or '"..."'
    [("jsonb_build_array(%s::text)", "NULL", 6), ("'[]'", "to_jsonb(%s::text)", 2)],
    ids=["arguments", "result"],
)
def test_t28_the_database_refuses_an_oversized_payload_written_by_raw_sql(
    args_sql, result_sql, around
):
    with pytest.raises(IntegrityError, match="skipqueue_job_payload_size") as raised:
        _insert_raw(args_sql, result_sql, "x" * (CEILING - around + 1))
    assert "a new job of task 't': its " in str(raised.value)  # it has no id to name
    assert not Job.objects.exists()
    _insert_raw(args_sql, result_sql, "x" * (CEILING - around))  # at the ceiling
    assert Job.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_claim_renew_and_ack_do_not_measure_the_stored_payload_again():
    """0003's CHECK turned the arguments back into text on every write of the row: a
    job stored over the ceiling could not be claimed at all, and each write of one
    under it paid for the conversion (benchmarks/large_payloads.py)."""
    job_id = _store_over_the_ceiling()
    [claimed] = Job.objects.claim(queues=["default"])
    assert claimed.id == job_id and len(claimed.args[0]) == CEILING
    assert Job.objects.renew(claimed.id, claimed.attempts)
    assert Job.objects.ack(claimed.id, claimed.attempts, result={"ok": True})
    assert Job.objects.get(id=job_id).state == JobState.DONE


@pytest.mark.django_db(transaction=True)
def test_migration_0020_back_and_forth_keeps_the_ceiling():
    assert _constraint_and_triggers() == (None, TRIGGERS)
    job = tasks.add.enqueue(1, 2)
    try:
        call_command("migrate", "skipqueue", "0019", verbosity=0)
        assert _constraint_and_triggers() == (True, set())
        with pytest.raises(IntegrityError, match="skipqueue_job_payload_size"):
            Job.objects.filter(id=job.id).update(result=OVER)
    finally:
        call_command("migrate", "skipqueue", verbosity=0)
    assert _constraint_and_triggers() == (None, TRIGGERS)
    with pytest.raises(IntegrityError, match="skipqueue_job_payload_size"):
        Job.objects.filter(id=job.id).update(result=OVER)


@pytest.mark.django_db(transaction=True)
def test_migration_0020_gives_up_on_its_lock_after_two_seconds_and_runs_again_later():
    """Dropping the constraint needs a lock that every write would queue behind: held up
    by a long transaction, the migration fails within its lock_timeout, changing
    nothing; run again, it goes through."""
    call_command("migrate", "skipqueue", "0019", verbosity=0)
    try:
        with migration_held_up_by_a_long_transaction("0020"):
            assert _constraint_and_triggers() == (True, set())  # unchanged
    finally:
        call_command("migrate", "skipqueue", verbosity=0)
    assert _constraint_and_triggers() == (None, TRIGGERS)


def _superuser() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        return bool(cursor.fetchone()[0])


@pytest.mark.django_db(transaction=True)
def test_a_payload_grown_by_a_trigger_of_the_projects_own_is_refused():
    """The check sees the row as stored: after a BEFORE trigger of the project's, here one
    whose name sorts after ours (BEFORE triggers fire in the order of their names)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION zz_grow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            f" NEW.args := jsonb_build_array(repeat('x', {CEILING})); RETURN NEW; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER zz_grow BEFORE INSERT OR UPDATE ON skipqueue_job"
            " FOR EACH ROW EXECUTE FUNCTION zz_grow()"
        )
    try:
        with pytest.raises(IntegrityError, match="skipqueue_job_payload_size"):
            tasks.add.enqueue(1, 2)
        assert not Job.objects.exists()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER zz_grow ON skipqueue_job")
            cursor.execute("DROP FUNCTION zz_grow()")


@pytest.mark.django_db(transaction=True)
def test_the_ceiling_holds_for_a_writer_in_replica_mode():
    """Logical replication's apply and restores with --disable-triggers write with
    session_replication_role = replica, which skips ordinary triggers (not constraints)."""
    if not _superuser():
        pytest.skip("session_replication_role needs a superuser")
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")
        with (
            pytest.raises(IntegrityError, match="skipqueue_job_payload_size"),
            transaction.atomic(),
        ):
            _insert_raw("jsonb_build_array(%s::text)", "NULL", OVER)
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_migration_0020_waits_for_a_transaction_that_read_the_job_table_and_then_writes_it():
    """A transaction that read the job table (an atomic() block that looked before it
    enqueues) and writes it while the migration waits for its lock: the migration takes
    the table's strongest lock before anything else, so it waits for that transaction
    instead of holding a weaker lock that the write would wait on (a deadlock, which
    PostgreSQL settled by aborting the user's transaction or the migration)."""
    call_command("migrate", "skipqueue", "0019", verbosity=0)
    wrapper = connections["default"]
    other = wrapper.get_new_connection(wrapper.get_connection_params())
    other.autocommit = True
    failures: list[BaseException] = []

    def migrate() -> None:
        try:
            call_command("migrate", "skipqueue", "0020", verbosity=0)
        except BaseException as error:  # noqa: BLE001 - asserted below
            failures.append(error)
        finally:
            connections.close_all()

    migrating = threading.Thread(target=migrate)
    try:
        other.execute("BEGIN")
        other.execute("SELECT count(*) FROM skipqueue_job")
        migrating.start()
        wait_until(
            lambda: (
                other.execute(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted"
                    " AND relation = 'skipqueue_job'::regclass"
                ).fetchone()[0]
                > 0
            ),
            timeout=10,
        )
        other.execute(
            "INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state,"
            " lease, attempts, max_attempts, expirations, releases, last_error, errors)"
            " VALUES ('t', '[]', '{}', 'default', 0, 'pending', '1 minute', 0, 1, 0, 0, '',"
            " '[]')"
        )
        other.execute("COMMIT")
        migrating.join(30)
        assert not migrating.is_alive() and not failures, failures
        assert _constraint_and_triggers() == (None, TRIGGERS)
        assert Job.objects.count() == 1
    finally:
        other.close()
        migrating.join(30)
        call_command("migrate", "skipqueue", verbosity=0)


@pytest.mark.django_db(transaction=True)
def test_going_back_over_0020_names_a_job_over_the_ceiling_before_changing_anything():
    job_id = _store_over_the_ceiling()
    try:
        named = f"job {job_id}: its args and kwargs take {CEILING + 6} bytes of JSON text"
        with pytest.raises(IntegrityError, match=named):
            call_command("migrate", "skipqueue", "0019", verbosity=0)
        assert _constraint_and_triggers() == (None, TRIGGERS)  # nothing changed
        Job.objects.filter(id=job_id).delete()
        call_command("migrate", "skipqueue", "0019", verbosity=0)
        assert _constraint_and_triggers() == (True, set())
    finally:
        call_command("migrate", "skipqueue", verbosity=0)
    assert _constraint_and_triggers() == (None, TRIGGERS)


@pytest.mark.django_db(transaction=True)
def test_going_back_over_0020_interrupted_between_its_steps_runs_again():
    """Going back is two transactions (the validation must not hold the lock that blocks
    every write): stopped after the first, with 0020 still recorded, `migrate skipqueue
    0019` runs both again and ends as 0019 does."""
    migration = importlib.import_module(
        "django_skipqueue.migrations.0020_payload_ceiling_on_change"
    )
    tasks.add.enqueue(1, 2)
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(migration.BACKWARD)
        assert _constraint_and_triggers() == (False, set())  # the constraint holds already
        with pytest.raises(IntegrityError, match="skipqueue_job_payload_size"):
            _insert_raw("jsonb_build_array(%s::text)", "NULL", OVER)
        call_command("migrate", "skipqueue", "0019", verbosity=0)
        assert _constraint_and_triggers() == (True, set())
    finally:
        call_command("migrate", "skipqueue", verbosity=0)
    assert _constraint_and_triggers() == (None, TRIGGERS)
