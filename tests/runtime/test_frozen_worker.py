"""A frozen worker and a poison row stop nobody (docs/explanation/failure-model.md, F-cases).

A worker can be stopped anywhere, inside one of its transactions too (SIGSTOP, a paused
VM, a long GC): each lock it takes is taken here by a real child process, which is then
SIGSTOPped, and the others must go on within seconds. A row another client wrote with a
value Python cannot load, or one whose claim fails, fails alone with its reason.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now

from django_skipqueue import Cron
from django_skipqueue.conf.limits import QueueLimit
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.maintenance.scheduler import sync, tick
from django_skipqueue.models import Job, Queue, Schedule
from django_skipqueue.tasks.base import bind_schedules
from tests.processes import start_python, wait_until
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

#: The frozen child's own bound: the server ends its idle transaction after this.
IDLE_SECONDS = 1.0


def every_second(*names: str) -> dict[str, Cron]:
    """Schedules of tasks.add that fire every second, by name."""
    crons = [Cron(expression="* * * * * *", name=name, args=[1, 2]) for name in names]
    return {cron.name: bind_schedules(tasks.add, cron)[0] for cron in crons}


@pytest.fixture
def frozen() -> Iterator:
    """frozen(code): run `code` in a child inside `bounded()`, then SIGSTOP it once it
    prints "held"; the child is killed at teardown."""
    children = []

    def start(code: str):
        settings = json.dumps({"IDLE_IN_TRANSACTION_SECONDS": IDLE_SECONDS})
        child = start_python(
            "import time\n"
            "from django_skipqueue.queue.connections import bounded\n"
            "with bounded('default'):\n"
            + "".join(f"    {line}\n" for line in code.strip().splitlines())
            + "    print('held', flush=True)\n"
            "    time.sleep(120)\n",
            SKIPQUEUE_TEST_SETTINGS=settings,
        )
        children.append(child)
        assert child.stdout.readline().strip() == "held", child.stderr.read()
        child.send_signal(signal.SIGSTOP)
        return child

    yield start
    for child in children:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.communicate(timeout=10)  # waits, and closes its pipes


def test_a_worker_frozen_inside_a_limited_claim_stops_no_other_claim(frozen):
    tasks.add.enqueue_many([((1, 2), {})] * 3)
    tasks.add.using(queue_name="other").enqueue(1, 2)
    limits = {"default": QueueLimit(concurrency=5)}
    Queue.objects.bulk_create([Queue(name="default")])
    frozen("from django_skipqueue.models import Queue\nQueue.objects.locked('default')")

    started = time.monotonic()
    claimed, retry_in = Job.objects.claim_limited(queues=["default"], limits=limits, limit=5)
    assert time.monotonic() - started < 1.0  # skipped, not waited for
    assert claimed == [] and retry_in is not None
    # The unlimited queue is claimed at once.
    assert [job.queue_name for job in Job.objects.claim(queues=["other"], limit=5)] == ["other"]

    # The server ends the frozen transaction; the limited queue is claimed again.
    def claims() -> bool:
        got, _ = Job.objects.claim_limited(queues=["default"], limits=limits, limit=5)
        return len(got) == 3

    wait_until(claims, timeout=IDLE_SECONDS + 5, interval=0.1)


def test_a_worker_frozen_inside_a_tick_holds_back_one_schedule_for_seconds(frozen):
    defined = every_second("frozen", "free")
    sync(defined, database="default")
    Schedule.objects.update(last_occurrence_at=Now() - timedelta(seconds=3))
    frozen(
        "from django_skipqueue.models import Schedule\n"
        "list(Schedule.objects.filter(name='frozen').select_for_update())"
    )

    tick(defined, database="default")
    assert Job.objects.filter(schedule="free").exists()
    assert not Job.objects.filter(schedule="frozen").exists()

    def fired() -> bool:
        tick(defined, database="default")
        return Job.objects.filter(schedule="frozen").exists()

    wait_until(fired, timeout=IDLE_SECONDS + 5, interval=0.1)


def test_the_server_ends_a_frozen_transaction_of_ours_and_frees_its_rows(frozen):
    job = tasks.add.enqueue(1, 2)
    frozen(f"from django_skipqueue.models import Job\nJob.objects.filter(id={job.id}).update()")
    frozen(
        f"from django_skipqueue.models import Job\n"
        f"list(Job.objects.filter(id={job.id}).select_for_update())"
    )  # waits at most LOCK_TIMEOUT_SECONDS behind the first, then is ended too

    def cancel_goes_through() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '200ms'")
            try:
                return Job.objects.cancel([job.id]) == 1
            except Exception:  # noqa: BLE001  (the lock is still held)
                return False
            finally:
                cursor.execute("RESET lock_timeout")

    wait_until(cancel_goes_through, timeout=IDLE_SECONDS + 8, interval=0.2)


# -- poison rows ---------------------------------------------------------------------


@pytest.mark.parametrize("column", ["run_at", "created_at", "scheduled_for"])
def test_a_row_with_a_timestamp_python_cannot_load_fails_alone(column):
    innocent = [job.id for job in tasks.add.enqueue_many([((1, 2), {})] * 20)]
    poison = tasks.add.enqueue(3, 4).id
    value = "-infinity" if column == "run_at" else "infinity"
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE skipqueue_job SET {column} = %s, priority = 10 WHERE id = %s",
            [value, poison],
        )

    claimed = Job.objects.claim(queues=["default"], limit=30)

    assert sorted(job.id for job in claimed) == innocent
    state, error = Job.objects.filter(id=poison).values_list("state", "last_error").get()
    assert state == "failed"
    assert "cannot load" in error and "another client" in error


def test_a_keyed_row_whose_claim_fails_fails_alone_under_limits():
    calls = [((), {"account": n}) for n in range(3)]
    ids = [job.id for job in tasks.per_account.enqueue_many(calls)]
    with connection.cursor() as cursor:  # attempts + 1 overflows int4 in the claim
        most = 2**31 - 1
        cursor.execute(
            "UPDATE skipqueue_job SET attempts = %s, max_attempts = %s WHERE id = %s",
            [most, most, ids[0]],
        )

    claimed, _ = Job.objects.claim_limited(
        queues=["default"], limits={"default": QueueLimit(concurrency=5)}, limit=5
    )

    assert sorted(job.id for job in claimed) == ids[1:]
    state, error = Job.objects.filter(id=ids[0]).values_list("state", "last_error").get()
    assert state == "failed" and "the claim failed" in error


# -- schedules that can never run ---------------------------------------------------


def test_a_cron_expression_that_never_matches_is_refused_at_definition():
    with pytest.raises(ConfigurationError, match="never matches"):
        Cron(expression="0 0 31 2 *")
    Cron(expression="0 0 29 2 *")  # rare, but it comes


@pytest.mark.parametrize(
    "broken", ["last_occurrence_at = 'infinity'", "expression = '0 0 31 2 *'", "grace = -1"]
)
def test_a_schedule_whose_tick_fails_does_not_stop_the_others(caplog, broken):
    defined = every_second("broken", "fine")
    sync(defined, database="default")
    Schedule.objects.update(last_occurrence_at=Now() - timedelta(seconds=3))
    with connection.cursor() as cursor:  # a row another client broke
        cursor.execute(f"UPDATE skipqueue_schedule SET {broken} WHERE name = 'broken'")

    tick(defined, database="default")

    assert Job.objects.filter(schedule="fine").exists()
    assert not Job.objects.filter(schedule="broken").exists()
    if "infinity" not in broken:  # that one loads (clamped) and is simply never due
        assert "schedule failed name=broken" in caplog.text


def test_the_limited_claim_reads_no_payload_while_it_holds_the_queues_lock():
    """A worker frozen while the server sends it a large result cannot be ended by the
    server (the session is busy writing, not idle in a transaction): the transaction that
    holds the queue's row lock returns ids only, and the payloads are read after it
    committed (trial finding: 64 jobs of 250 kB held a limited queue for good)."""
    big = "x" * 200_000
    tasks.send_invoice.using(queue_name="big").enqueue_many(
        [((n,), {"note": big}) for n in range(5)]
    )
    limits = {"big": QueueLimit(concurrency=100)}
    statements: list[tuple[bool, str]] = []

    def record(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        statements.append((connection.in_atomic_block, sql))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        claimed, _ = Job.objects.claim_limited(queues=["big"], limits=limits, limit=10)
    assert len(claimed) == 5 and all(job.kwargs["note"] == big for job in claimed)
    payload = ('"args"', '"kwargs"', '"errors"', '"result"')
    locked = [sql for in_atomic, sql in statements if in_atomic]
    assert locked and not [sql for sql in locked if any(column in sql for column in payload)]
    assert any('"kwargs"' in sql for in_atomic, sql in statements if not in_atomic)


@pytest.mark.parametrize("tokens", [float("-inf"), float("nan"), -1e308])
def test_a_queue_row_with_a_broken_token_bucket_neither_crashes_nor_stops_its_queue(tokens):
    """A rate-limited queue's row written by another client ('-Infinity', 'NaN', a huge
    debt): the bucket counts as empty, refills, and the queue is claimed again."""
    tasks.add.using(queue_name="rl").enqueue(1, 2)
    Queue.objects.create(name="rl", rate_tokens=tokens, rate_refilled_at=Now())
    limits = {"rl": QueueLimit(rate=10, period=1.0)}

    def claims() -> bool:
        got, _ = Job.objects.claim_limited(queues=["rl"], limits=limits, limit=1)
        return len(got) == 1

    wait_until(claims, timeout=5, interval=0.1)
