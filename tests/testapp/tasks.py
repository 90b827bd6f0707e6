"""Module-level tasks the tests enqueue and run."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time

from django.db.models.functions import Now

from django_skipqueue import Retry, RetryPolicy, TaskContext, task
from django_skipqueue.exceptions import SoftTimeLimitExceeded
from tests.testapp.models import Run, Span


@task
def add(a: int, b: int) -> int:
    return a + b


@task
def collector_state() -> dict[str, object]:
    """The worker process's garbage collector, as a job sees it (runworker's gc.freeze)."""
    import gc

    return {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}


@task(name="tests.named", queue_name="other", priority=10)
def named() -> str:
    return "named"


@task(takes_context=True)
def record(context: TaskContext, sleep: float = 0.0, first_only: bool = False) -> dict[str, object]:
    """Log this execution (before the ack), then sleep (on the first attempt only, if asked)."""
    Run.objects.create(job_id=context.job_id, attempt=context.attempt, pid=os.getpid())
    if sleep and not (first_only and context.attempt > 1):
        time.sleep(sleep)
    return {"job_id": context.job_id, "attempt": context.attempt, "key": context.idempotency_key}


@task(retry=RetryPolicy(base=0.01, cap=0.05, jitter=0.1), max_attempts=3)
def always_fails(message: str = "boom") -> None:
    raise RuntimeError(message)


@task(non_retryable=(ValueError,), max_attempts=5)
def rejects_input(value: object) -> None:
    raise ValueError(f"cannot use {value!r}")


@task(takes_context=True)
def retry_once(context: TaskContext, delay: float = 0.0) -> str:
    if Run.objects.filter(job_id=context.job_id).exists():
        return "second time"
    Run.objects.create(job_id=context.job_id, attempt=context.attempt, pid=os.getpid())
    raise Retry(delay, reason="not yet", spend_attempt=False)


@task(takes_context=True, max_attempts=3)
def retry_counted(context: TaskContext, delay: float = 0.0, until: int = 99) -> int:
    """Asks for a counted retry (Celery's self.retry) until attempt `until`."""
    Run.objects.create(job_id=context.job_id, attempt=context.attempt, pid=os.getpid())
    if context.attempt < until:
        try:
            raise ConnectionError("the provider is down")
        except ConnectionError as error:
            raise Retry(delay, reason="provider down") from error
    return context.attempt


@task
def returns_object() -> object:
    return object()


@task
def exits() -> None:
    raise SystemExit(3)


@task
async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@task(takes_context=True, lease=1.0)
def extends_lease(context: TaskContext, seconds: float) -> bool:
    return context.extend_lease(seconds)


@task
def drops_its_connection() -> str:
    """Kill every session on this database, this thread's too, so that the ack that
    follows meets a dead connection (the worker acks on its dispatcher's connection)."""
    from django.db import OperationalError, connection

    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND backend_type = 'client backend' "
                "ORDER BY pid = pg_backend_pid()"
            )
    except OperationalError:
        pass  # the session is gone; the task itself succeeded
    return "acked anyway"


@task(takes_context=True, max_attempts=10)
def probe(context: TaskContext, ms: int = 0, mode: str = "ok", jitter_ms: float = 0) -> int:
    """The fault tests' task (docs/explanation/failure-model.md, "The harness"): log
    the run, misbehave per mode, then write a unique effect; a second effect for the
    same job is logged as a duplicate.

    Sleeps `ms` +/- `jitter_ms`; with mode "boundary", until the lease ends +/- `jitter_ms`
    (T3: aimed at the boundary whatever the claim-to-start delay under load); with mode
    "late-exit", ends its process after the sleep (a poison that kills only late)."""
    import signal

    from django.db import connection

    from tests.testapp.models import DuplicateEffect

    Run.objects.create(job_id=context.job_id, attempt=context.attempt, pid=os.getpid())
    if mode == "exit":
        os._exit(1)
    if mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "raise":
        raise RuntimeError(f"probe {context.job_id} raised on attempt {context.attempt}")
    if mode == "boundary":  # sleep to this attempt's lease end by the database's clock
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT extract(epoch FROM leased_until - clock_timestamp()) * 1000 "
                "FROM skipqueue_job WHERE id = %s",
                [context.job_id],
            )
            ms = float(cursor.fetchone()[0] or 0)  # None: already taken back
    time.sleep(max(ms + random.uniform(-jitter_ms, jitter_ms), 0) / 1000)
    if mode == "late-exit":  # kills its process only after `ms`
        os._exit(1)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO testapp_effect (job_id) VALUES (%s) ON CONFLICT DO NOTHING RETURNING id",
            [context.job_id],
        )
        if cursor.fetchone() is None:
            DuplicateEffect.objects.create(job_id=context.job_id, attempt=context.attempt)
    return context.attempt


@task
def leaves_transaction_open() -> None:
    from django.db import transaction

    transaction.atomic().__enter__()  # never exited
    Run.objects.create(job_id=0, attempt=0, pid=os.getpid())  # must be rolled back


@task(takes_context=True)
def leaves_atomic_open_on(context: TaskContext, alias: str) -> None:
    """Enter atomic() on another alias, write there, never exit: must be rolled back."""
    from django.db import transaction

    transaction.atomic(using=alias).__enter__()  # never exited
    Run.objects.using(alias).create(job_id=context.job_id, attempt=context.attempt, pid=0)


@task(retry=RetryPolicy(base=0.2, cap=2.0, jitter=0.1), max_attempts=5)
def t22_always_raises() -> None:
    raise RuntimeError("always")


@task(timeout=1.0, lease=0.6, max_attempts=3, retry=RetryPolicy(base=0.01, cap=0.01))
def t23_hangs(seconds: float) -> None:
    time.sleep(seconds)  # ignores every request to stop


@task(max_attempts=1)
def call_partner(url: str, password: str, retries: int = 3) -> None:
    """A secret passed positionally: the admin masks it by its parameter's name."""


@task(max_attempts=1)
def leaks_a_secret(dsn: str) -> None:
    raise ConnectionError(f"could not connect to {dsn} with token=abc123")


@task(max_attempts=2)
def fan_out() -> None:
    """Enqueue two copies of itself: without MAX_PENDING_PER_QUEUE, a job bomb."""
    fan_out.enqueue()
    fan_out.enqueue()


@task(timeout=0.3, lease=0.6, max_attempts=1)
def outlives_its_timeout() -> str:
    """Runs past its timeout and its lease, then returns: the late success is refused."""
    time.sleep(0.9)
    return "late"


@task(takes_context=True)
def turns_autocommit_off(
    context: TaskContext, commit: bool = False, how: str = "orm", alias: str = "default"
) -> str:
    """Leave a transaction open on `alias` and write in it (`how`): "orm", after Django's
    set_autocommit(False); "set", the same with a SET first (a session change); "one",
    a raw BEGIN and an INSERT in one statement; "read", set_autocommit(False) and a read
    only; "plain", a write in the alias's own mode (for one configured without
    autocommit). Commits only if asked, and never turns autocommit back on. Its Run row
    must commit only when it commits."""
    from django.db import connections, transaction

    connection = connections[alias]
    if how in ("orm", "set", "read"):
        transaction.set_autocommit(False, using=alias)
    if how == "set":
        with connection.cursor() as cursor:
            cursor.execute("SET statement_timeout = 5000")
    if how == "one":
        with connection.cursor() as cursor:
            cursor.execute(
                f"BEGIN; INSERT INTO {Run._meta.db_table} (job_id, attempt, pid) "
                f"VALUES ({int(context.job_id)}, {int(context.attempt)}, 0)"
            )
    elif how == "read":
        list(Run.objects.using(alias).all()[:1])
    else:
        Run.objects.using(alias).create(job_id=context.job_id, attempt=context.attempt, pid=0)
    if commit:
        transaction.commit(using=alias)
    return "autocommit off"


@task
def repeats(text: str, times: int) -> str:
    return text * times


@task(takes_context=True)
def begins_raw_transaction(context: TaskContext, fail_in_it: bool = False) -> str:
    """Open a transaction behind Django's back (a raw BEGIN) and return inside it; with
    `fail_in_it`, leave it failed too. Its Run row must never commit."""
    from django.db import DatabaseError, connection

    with connection.cursor() as cursor:
        cursor.execute("BEGIN")
    Run.objects.create(job_id=context.job_id, attempt=context.attempt, pid=os.getpid())
    if fail_in_it:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1 / 0")
        except DatabaseError:
            pass  # swallowed: the transaction stays open, and failed
    return "left open"


@task(takes_context=True)
def leaves_a_statement_running(context: TaskContext) -> str:
    """Send an INSERT of its Run row in autocommit and return before its reply is read,
    as a time limit's interrupt landing right after the send leaves it: the statement
    may still commit, and the worker must not say that it was rolled back."""
    from django.db import connection

    connection.ensure_connection()
    connection.connection.pgconn.send_query(
        b"SELECT pg_sleep(0.3); INSERT INTO testapp_run (job_id, attempt, pid) "
        b"VALUES (%d, %d, %d)" % (context.job_id, context.attempt, os.getpid())
    )
    return "sent"


class UnprintableError(ValueError):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


@task(non_retryable=(ValueError,), max_attempts=5)
def raises_unstorable(kind: str) -> None:
    """Raise a non-retryable error whose text PostgreSQL cannot store as it is."""
    if kind == "nul":
        raise ValueError("bad byte \x00 in the input")
    if kind == "surrogate":
        raise ValueError("half a character: \udc80")
    raise UnprintableError()


@task(max_attempts=5)
def returns_value(value: object) -> object:
    return value


@task(takes_context=True)
def echoes_arguments(context: TaskContext, *args: object, **kwargs: object) -> object:
    """Return the arguments exactly as the worker loaded them, with their types."""
    return {"args": list(args), "kwargs": kwargs}


@task
def returns_huge_floats(count: int) -> list[float]:
    """A small call whose result is 7 bytes a number as JSON and 310 as stored (jsonb)."""
    return [1e308] * count


@task(takes_context=True, lease=1.0)
def extends_then_waits(context: TaskContext, seconds: float, wait: float) -> float:
    """Extend the lease, outlive a few of the worker's renewals, return what is left."""
    from django.db import connection

    context.extend_lease(seconds=seconds)
    time.sleep(wait)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT extract(epoch FROM leased_until - now()) FROM skipqueue_job WHERE id = %s",
            [context.job_id],
        )
        return float(cursor.fetchone()[0])


@task(lease=1.0)
def fails_over_before_its_ack() -> str:
    """The primary becomes a standby right after the body: every new session is
    read-only, and this one is cut. The test turns it back."""
    from django.db import OperationalError, connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT current_database()")
        name = cursor.fetchone()[0]
        cursor.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    except OperationalError:
        pass
    return "done, but who will say so?"


@task(unique_key=("invoice_id",))
def send_invoice(invoice_id: int, note: str = "") -> int:
    """A unique job per invoice: its key is made of the invoice_id argument."""
    return invoice_id


@task(unique_key=lambda account, **_: f"account:{account}", on_conflict="replace")
def sync_account(account: str, full: bool = False) -> str:
    """A unique job per account whose later enqueues replace a pending one's arguments."""
    return account


# Set by a test: the threads of one worker meet here, so that they finish together.
MEETING: threading.Barrier | None = None


@task
def meet() -> None:
    """Wait until every party of `MEETING` has arrived, then return at once."""
    assert MEETING is not None
    MEETING.wait(timeout=10)


def _occupy(job_id: int, seconds: float, key: str) -> None:
    span = Span.objects.create(job_id=job_id, key=key)
    try:
        time.sleep(seconds)
    finally:  # the end of its code, even when a time limit stops it
        Span.objects.filter(id=span.id).update(ended_at=Now())


@task(takes_context=True)
def occupy(context: TaskContext, seconds: float = 0.2) -> None:
    """Hold a worker thread for `seconds`, recording when (a Span)."""
    _occupy(context.job_id, seconds, "")


@task(takes_context=True, concurrency_key=("account",), concurrency_limit=1)
def per_account(context: TaskContext, account: str, seconds: float = 0.1) -> None:
    """One at a time per account, across every worker."""
    _occupy(context.job_id, seconds, account)


@task(takes_context=True, lease=1.5)
def cancellable(context: TaskContext, how: str = "flag", seconds: float = 20.0) -> str:
    """Work in small steps until cancelled: watching `context.cancel_requested` ("flag"),
    calling `extend_lease()` ("extend"), or ignoring the request ("ignore")."""
    Run.objects.create(job_id=context.job_id, attempt=context.attempt, pid=os.getpid())
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if how == "flag" and context.cancel_requested:
            context.check_cancelled()
        if how == "extend":
            context.extend_lease(1.5)
        time.sleep(0.05)
    return "finished"


@task
def changes_its_session(statement: str, raw: bool = False, params: list | None = None) -> None:
    """Run a session-level statement (`SET search_path TO pg_catalog`, say), through
    Django's cursor or, with `raw`, on the psycopg connection behind Django's back."""
    from django.db import connection

    if raw:
        connection.ensure_connection()
        connection.connection.execute(statement, params)
    else:
        with connection.cursor() as cursor:
            cursor.execute(statement, params)


def _sleep_long() -> None:
    time.sleep(60)


@task
def leaks_a_process(pid_file: str) -> None:
    """Start a non-daemon multiprocessing child that outlives the job, and say its pid."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_sleep_long, daemon=False)
    child.start()
    with open(pid_file, "w") as out:
        out.write(str(child.pid))


@task(
    takes_context=True,
    concurrency_key=("account",),
    concurrency_limit=1,
    timeout=0.3,
    lease=1.0,
    max_attempts=1,
)
def outlives_its_timeout_per_account(context: TaskContext, account: str, seconds: float) -> None:
    """Runs past its time limit under a concurrency limit of 1 per account, blocked in C
    (the interrupt lands when its sleep ends)."""
    _occupy(context.job_id, seconds, account)


# -- workflows (tests/queue/test_workflows.py) ------------------------------------------------


@task
def total(values: list[int], extra: int = 0) -> int:
    """A chord's body: the sum of its group's results."""
    return sum(values) + extra


@task
def double(value: int) -> int:
    return 2 * value


@task
def pair(value: object, label: str = "") -> list[object]:
    """What it was given, to see a step's input."""
    return [value, label]


@task(max_attempts=1)
def breaks(message: str = "broken") -> None:
    raise ValueError(message)


@task(max_attempts=1)
def breaks_unless_file(path: str, value: int = 7) -> int:
    """Fails until `path` exists: an operator's retry after the file is made succeeds."""
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing")
    return value


@task
def note_failure(job_id: int, error: str, where: str) -> list[object]:
    """An on_error callback: returns what it was told."""
    return [job_id, error, where]


@task(takes_context=True, lease=3.0, max_attempts=10)
def chord_body(context: TaskContext, results: list[object]) -> list[object]:
    """A chord's callback under faults: logs each run, returns what it received."""
    Run.objects.create(job_id=context.job_id, attempt=context.attempt, pid=os.getpid())
    return results


@task(
    takes_context=True, concurrency_key=("account",), concurrency_limit=1, lease=1.0, max_attempts=3
)
def per_account_ignores_cancel(context: TaskContext, account: str, seconds: float) -> None:
    """Runs its full time whatever an operator asks, under a limit of 1 per account."""
    _occupy(context.job_id, seconds, account)


# -- time limits (tests/runtime/test_timelimits.py) ---------------------------------------------


@task(takes_context=True, soft_time_limit=0.3, time_limit=20.0)
def soft_limited(context: TaskContext) -> dict[str, object]:
    """Works in steps, checking at each; past its soft limit it cleans up and returns."""
    first = context.time_left
    steps = 0
    try:
        while steps < 1000:
            time.sleep(0.05)
            steps += 1
            context.check_cancelled()
    except SoftTimeLimitExceeded:
        return {"first": first, "left": context.time_left, "steps": steps, "stopped": True}
    return {"stopped": False}


@task(takes_context=True)
def no_limits(context: TaskContext) -> object:
    return context.time_left


@task(
    takes_context=True,
    time_limit=0.5,
    lease=10.0,
    max_attempts=2,
    retry=RetryPolicy(base=0, cap=0, jitter=0, retry_time_limits=True),
)
def loops_forever(context: TaskContext) -> None:
    """Loops in Python, checking at its safe point: stopped there at its hard limit, and
    retried (its policy says so)."""
    while True:
        sum(range(100))
        context.check_cancelled()


@task(takes_context=True, time_limit=0.5, lease=10.0, max_attempts=3)
def checks_past_its_limit(context: TaskContext) -> None:
    """Loops, checking at its safe point: stopped there at its hard limit; the default
    policy does not retry it (Celery's)."""
    while True:
        time.sleep(0.01)
        context.check_cancelled()


@task(takes_context=True, soft_time_limit=0.3, time_limit=5.0, max_attempts=3)
def ignores_its_soft_limit(context: TaskContext) -> None:
    """Lets SoftTimeLimitExceeded out of its safe point: a failure, not retried."""
    while True:
        time.sleep(0.01)
        context.check_cancelled()


@task(time_limit=0.3, lease=30.0, max_attempts=1)
def returns_just_past_its_limit() -> str:
    """Returns 0.3 s past its limit, inside the grace: the attempt still fails with
    TimeLimitExceeded, and its worker goes on."""
    time.sleep(0.6)
    return "late"


@task(takes_context=True, time_limit=0.5, lease=30.0, max_attempts=1)
def logs_past_its_limit(context: TaskContext, seconds: float = 60.0) -> None:
    """Logs in a tight loop, never at a safe point: an exception raised into its thread
    from outside lands inside logging's handler lock and leaves it held for ever."""
    Run.objects.create(job_id=context.job_id, attempt=context.attempt, pid=os.getpid())
    log = logging.getLogger("tests.testapp.chatty")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        log.warning("still working job=%s", context.job_id)


@task(
    takes_context=True,
    concurrency_key=("account",),
    concurrency_limit=1,
    time_limit=1.0,
    lease=30.0,
    max_attempts=1,
)
def reads_a_silent_socket(context: TaskContext, account: str, seconds: float = 60.0) -> None:
    """Blocked in C, a socket read that no data comes to, under a concurrency limit of 1
    per account; records when its code runs (a Span, ended only if it returns)."""
    import socket

    Span.objects.create(job_id=context.job_id, key=account)
    ours, theirs = socket.socketpair()
    try:
        if seconds > 0:
            ours.settimeout(seconds)
            with contextlib.suppress(TimeoutError):
                ours.recv(1)
    finally:
        ours.close()
        theirs.close()
    Span.objects.filter(job_id=context.job_id).update(ended_at=Now())


def _log_signal(path: str, name: str) -> object:
    def receiver(sender: object, job: object, **kwargs: object) -> None:
        with open(path, "a") as log:
            log.write(f"{name} {job.pk}\n")  # type: ignore[attr-defined]

    return receiver


if os.environ.get("SKIPQUEUE_TEST_SIGNAL_LOG"):  # a worker process's outcome signals
    from django_skipqueue import signals as _signals

    for _name in ("job_failed", "job_retried"):
        getattr(_signals, _name).connect(
            _log_signal(os.environ["SKIPQUEUE_TEST_SIGNAL_LOG"], _name), weak=False
        )


@task(time_limit=0.5, lease=2.0, max_attempts=1)
def sleeps_past_its_limit(seconds: float = 30.0) -> None:
    """Blocked in C (time.sleep), never at a safe point."""
    time.sleep(seconds)


# -- rate limits per task (tests/queue/test_rate_limits.py) -------------------------------------


@task(rate_limit="5/s", takes_context=True)
def five_a_second(context: TaskContext, n: int = 0) -> int:
    Span.objects.create(job_id=context.job_id, key="five", ended_at=Now())
    return n


@task(rate_limit="3/m")
def three_a_minute(n: int = 0) -> int:
    return n


@task
def enqueues_three() -> None:
    """Enqueues from inside a task, as a fan-out does (tests/db/test_compat.py)."""
    for n in range(3):
        add.enqueue(n, n)


@task(rate_limit="1/s", concurrency_key=("account",), concurrency_limit=1)
def rated_and_keyed(account: str) -> str:
    return account


@task(rate_limit="2/m", rate_key=("tenant",))
def two_a_minute_per_tenant(tenant: str, n: int = 0) -> int:
    return n


# -- the outside trial of issue 27 (tests/integration/test_celery_port_trial.py) -----


@task(rate_limit="2/h")
def trial_rated(n: int = 0) -> int:
    return n


@task(concurrency_key=("account",), concurrency_limit=5)
def trial_keyed(account: str) -> str:
    return account


@task(unique_key=("key",), expires=1)
def trial_unique_expiring(key: str, n: int = 0) -> int:
    return n


@task(time_limit=1.0, lease=30.0, max_attempts=1)
async def trial_async_loops(seconds: float = 30.0) -> str:
    """Async, looping in Python with awaits: a time limit should stop it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return "ran to the end"


#: Set by tests/tasks/test_context.py to let `reports_progress` finish.
progress_release = threading.Event()


@task(takes_context=True, lease=2.0)
def reports_progress(context: TaskContext, steps: int = 5000) -> int:
    """Reports progress in a tight loop (far more often than it is written), then waits
    for the test to look at it, then reports once more and returns."""
    for done in range(steps):
        context.set_progress(done + 1, steps, note=f"step {done + 1}")
    progress_release.wait(timeout=20)
    context.set_progress(steps, steps, note="finished")
    return steps


@task(takes_context=True)
async def async_progress(context: TaskContext, steps: int) -> int:
    for done in range(steps):
        await asyncio.sleep(0)
        context.set_progress(done + 1, steps)
    return steps


@task(takes_context=True, time_limit=0.5, lease=30.0, max_attempts=1)
def holds_its_own_row(context: TaskContext, seconds: float = 20.0) -> None:
    """Locks its own job's row in a transaction, then blocks past its limit: the
    worker's failure of it would wait on that lock for as long as the code runs."""
    from django.db import transaction

    from django_skipqueue.models import Job

    with transaction.atomic():
        Job.objects.select_for_update().filter(id=context.job_id).exists()
        time.sleep(seconds)


@task
def takes_secrets(user: str, *passwords: str) -> None:
    """A variadic parameter named like a secret (the admin masks what fills it)."""


@task
def ends_its_process(how: str = "exit", after: float = 0.0, pid_file: str = "") -> str:
    """Touches no database. After `after` seconds: "exit" ends the process with code 7,
    "kill" SIGKILLs it, "return" returns its pid (what runs it in a process of its own
    may be checked); its pid is written to `pid_file` first, if given."""
    import signal

    if pid_file:
        with open(pid_file, "w") as out:
            out.write(str(os.getpid()))
    time.sleep(after)
    if how == "exit":
        os._exit(7)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return str(os.getpid())


@task(max_attempts=1)
def waits_inside(allow: bool = False) -> object:
    """Waits, inside its task, on a job it enqueues (tests/queue/test_job_wait.py)."""
    return add.enqueue(1, 1).wait(timeout=0.5, allow_in_task=allow)


# -- durable steps (issue 55: tests/tasks/test_durable.py, tests/chaos/test_durable.py) --


def _step_run(context: TaskContext, step: str) -> None:
    from tests.testapp.models import StepRun

    StepRun.objects.create(job_id=context.job_id, step=step, attempt=context.attempt)


@task(takes_context=True, max_attempts=3, retry=RetryPolicy(base=0.0, cap=0.0, jitter=0.0))
def durable_onboarding(context: TaskContext, user: str, fail_at: str = "") -> dict:
    """Three steps: an account (plain), a welcome mail (plain; fails on attempt 1 when
    `fail_at` names it), an activation (atomic)."""

    def create_account() -> str:
        _step_run(context, "create_account")
        return f"acct-{user}"

    def welcome() -> None:
        _step_run(context, "welcome")
        if fail_at == "welcome" and context.attempt == 1:
            raise RuntimeError("the mail server is down")

    def activate() -> dict:
        _step_run(context, "activate")
        return {"active": True}

    account = context.step("create_account", create_account)
    context.step("welcome", welcome)
    return {"account": account, **context.atomic_step("activate", activate)}


@task(takes_context=True)
def durable_loop(context: TaskContext, pages: int) -> list:
    """A step in a loop: one occurrence per page; returns each run's step key."""
    return [context.step("page", lambda: context.step_key) for _ in range(pages)]


@task(takes_context=True)
def atomic_after_losing(context: TaskContext) -> None:
    """An atomic step whose attempt loses its lease inside it (an operator's requeue,
    as a reaper would after a freeze): its row must not survive."""
    from django_skipqueue.models import Job

    def write_then_lose() -> None:
        _step_run(context, "write")
        with connection_for_others() as other:
            other.execute(
                "UPDATE skipqueue_job SET leased_until = now() - interval '1 second' WHERE id = %s",
                [context.job_id],
            )
        assert Job.objects.filter(id=context.job_id).exists()

    context.atomic_step("write", write_then_lose)


@contextlib.contextmanager
def connection_for_others():
    """A connection of its own, in autocommit: what another process would do."""
    from django.db import connections

    wrapper = connections["default"]
    raw = wrapper.get_new_connection(wrapper.get_connection_params())
    raw.autocommit = True
    try:
        yield raw
    finally:
        raw.close()


@task(takes_context=True)
def durable_nap(context: TaskContext, seconds: float) -> str:
    context.step("before", lambda: _step_run(context, "before"))
    context.sleep("nap", seconds)
    context.step("after", lambda: _step_run(context, "after"))
    return "awake"


@task(takes_context=True, lease=2.0, max_attempts=50)
def durable_storm(context: TaskContext, steps: int = 20, ms: int = 60) -> int:
    """The durable fault test's job: `steps` steps, every other one atomic; each step
    body writes a StepRun row and sleeps `ms`. Plain rows may repeat (at least once);
    atomic rows must not (exactly once)."""

    def body(index: int, kind: str) -> int:
        _step_run(context, f"{kind}-{index}")
        time.sleep(ms / 1000)
        return index

    for index in range(steps):
        if index % 2:
            context.atomic_step("write", body, index, "atomic")
        else:
            context.step("call", body, index, "plain")
    return steps


@task(takes_context=True)
async def durable_async(context: TaskContext, n: int) -> list:
    """The async twins: plain steps of a coroutine, an atomic step, a sleep of 0."""

    async def double(value: int) -> int:
        await asyncio.sleep(0)
        return value * 2

    values = [await context.astep("double", double, i) for i in range(n)]
    await context.aatomic_step("save", _step_run, context, "save")
    await context.asleep("blink", 0)
    return values


@task(takes_context=True, max_attempts=1)
def durable_bad_step(context: TaskContext) -> None:
    import datetime

    context.step("when", datetime.datetime.now)


@task
def echo_input(value: object) -> object:
    """A chain step that returns what its parent returned."""
    return value


# -- durable steps: the outside trial's cases (helper-7) --------------------------------


@task(takes_context=True, max_attempts=3, retry=RetryPolicy(base=0.0, cap=0.0, jitter=0.0))
def durable_caught(context: TaskContext) -> list:
    """A step that raises on attempt 1 and is caught; a later step recorded; then the
    attempt fails. Attempt 2 must run the first step again at its own position."""

    def flaky() -> str:
        _step_run(context, "a")
        if context.attempt == 1:
            raise KeyError("x")
        return "a"

    try:
        first = context.step("a", flaky)
    except KeyError:
        first = None
    second = context.step("b", lambda: "b")
    if context.attempt == 1:
        raise RuntimeError("fail after b")
    return [first, second]


@task(takes_context=True, max_attempts=1)
def durable_misuse(context: TaskContext, how: str) -> object:
    """The ways a durable task can be written wrong, each refused with words."""
    from django.db import transaction

    if how == "nested":
        return context.step("outer", lambda: context.step("inner", lambda: 1))
    if how == "sleep-in-atomic":
        with transaction.atomic():
            context.sleep("nap", 0.3)
    if how == "huge-sleep":
        context.sleep("nap", 1e300)
    if how == "caught-sleep":
        try:
            context.sleep("nap", 3600)
        except Exception:  # noqa: BLE001, S110  (the mistake under test)
            pass
        return "returned"
    if how == "caught-sleep-then-step":
        try:
            context.sleep("nap", 3600)
        except Exception:  # noqa: BLE001, S110
            pass
        return context.step("after", lambda: _step_run(context, "after"))
    if how == "nul-name":
        return context.step("a\x00b", lambda: _step_run(context, "nul"))
    if how == "stored-form":
        return context.step("value", lambda: {"z": 1e20, "neg": -0.0, "a": [1, 2]})
    raise ValueError(how)


@task(takes_context=True, max_attempts=1)
async def durable_gathered(context: TaskContext) -> list:
    async def slow(value: int) -> int:
        await asyncio.sleep(0.02)
        return value

    return await asyncio.gather(context.astep("s", slow, 1), context.astep("s", slow, 2))


# -- durable signals -----------------------------------------------------------------


@task(takes_context=True, max_attempts=3, retry=RetryPolicy(base=0.0, cap=0.0, jitter=0.0))
def durable_kyc(context: TaskContext, timeout: float | None = None, waits: int = 1) -> dict:
    """A step, then `waits` waits for the signal "kyc" (a timeout caught and said in the
    result), then a step."""
    from django_skipqueue.exceptions import SignalTimeoutError

    context.step("before", lambda: _step_run(context, "before"))
    decisions: list = []
    for _ in range(waits):
        try:
            decisions.append(context.wait_for("kyc", timeout=timeout))
        except SignalTimeoutError:
            decisions.append("timed out")
    context.step("after", lambda: _step_run(context, "after"))
    return {"decisions": decisions}


@task(takes_context=True, max_attempts=1)
def durable_kyc_uncaught(context: TaskContext, timeout: float) -> object:
    return context.wait_for("kyc", timeout=timeout)


@task(takes_context=True)
async def durable_kyc_async(context: TaskContext) -> object:
    await context.astep("before", lambda: 1)
    return await context.await_for("kyc")


#: Holds durable_kyc_gated's first step until a test sets it (the signal race test).
SIGNAL_GATE = threading.Event()


@task(takes_context=True)
def durable_kyc_gated(context: TaskContext) -> object:
    context.step("gate", lambda: SIGNAL_GATE.wait(10))
    return context.wait_for("kyc")


# -- fair share (tests/queue/test_fair_share.py) -----------------------------------------


@task(queue_name="tenants", fair_key=lambda tenant, n=0, seconds=0.0: tenant, takes_context=True)
def tenant_job(context: TaskContext, tenant: str, n: int = 0, seconds: float = 0.0) -> int:
    """A tenant's job: records when it started (Span), then sleeps `seconds`."""
    Span.objects.create(job_id=context.job_id, key=tenant, ended_at=Now())
    if seconds:
        time.sleep(seconds)
    return n


@task(queue_name="tenants")
def keyless_tenant_job(n: int = 0) -> int:
    return n


@task(
    queue_name="tenants",
    rate_limit="20/s",
    rate_key=("tenant",),
    fair_key=lambda tenant, n=0: tenant,
    takes_context=True,
)
def rated_tenant_job(context: TaskContext, tenant: str, n: int = 0) -> int:
    """A tenant's job under a rate per tenant, in the fair queue (tests/chaos)."""
    Span.objects.create(job_id=context.job_id, key=f"rated-{tenant}", ended_at=Now())
    return n


# -- debounce and throttle (tests/queue/test_coalesce.py) ----------------------------------


@task(debounce=0.5, debounce_key=("user_id",), debounce_max_wait=2)
def digest(user_id: int, changes: int = 0) -> int:
    return changes


@task(throttle=1, throttle_key=("user_id",))
def throttled_sync(user_id: int, n: int = 0) -> int:
    return n


# -- strict order per key (tests/queue/test_ordered.py) ------------------------------------


@task(ordered_key=("account",), takes_context=True, max_attempts=1)
def ordered_step(
    context: TaskContext, account: str, n: int, seconds: float = 0.0, fail: bool = False
) -> int:
    """An account's n-th event: records its start (Span), sleeps, fails if asked."""
    Span.objects.create(job_id=context.job_id, key=f"order-{account}:{n}")
    if seconds:
        time.sleep(seconds)
    Span.objects.filter(job_id=context.job_id).update(ended_at=Now())
    if fail:
        raise RuntimeError(f"event {n} of {account} failed")
    return n


@task(ordered_key=("account",), order_failed="skip", max_attempts=1)
def ordered_skipping(account: str, n: int, fail: bool = False) -> int:
    if fail:
        raise RuntimeError(f"event {n} of {account} failed")
    return n
