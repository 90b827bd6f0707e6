"""The task API: @task, Task.using/enqueue/enqueue_many/call, argument checks."""

from __future__ import annotations

import decimal
import uuid
from datetime import datetime, timedelta

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_skipqueue import task
from django_skipqueue.exceptions import ConfigurationError, InvalidJobError
from django_skipqueue.models import Job, JobState
from django_skipqueue.tasks.registry import registry
from tests.testapp import tasks


def test_bare_decorator_registers_under_the_dotted_path():
    assert registry.get("tests.testapp.tasks.add") is tasks.add
    assert tasks.add.name == "tests.testapp.tasks.add"


def test_decorator_with_options_registers_under_an_explicit_name():
    assert registry.get("tests.named") is tasks.named
    assert (tasks.named.queue_name, tasks.named.priority) == ("other", 10)


def test_calling_a_task_runs_the_function_in_process():
    assert tasks.add(2, 3) == 5
    assert tasks.add.call(2, 3) == 5


def test_nested_functions_are_refused():
    def outer() -> None:
        @task
        def inner() -> None: ...

    with pytest.raises(ConfigurationError, match="module-level function"):
        outer()


def test_a_second_function_under_a_registered_name_is_refused():
    def other() -> None: ...

    other.__module__, other.__qualname__ = "tests.elsewhere", "other"
    with pytest.raises(ConfigurationError, match="two tasks are named 'tests.named'"):
        task(name="tests.named")(other)


def test_using_returns_a_configured_copy_and_leaves_the_task_alone():
    urgent = tasks.add.using(priority=90, queue_name="urgent", max_attempts=2)
    assert (urgent.priority, urgent.queue_name, urgent.max_attempts) == (90, "urgent", 2)
    assert (tasks.add.priority, tasks.add.queue_name, tasks.add.max_attempts) == (
        0,
        "default",
        None,
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"priority": 101}, "priority 101 is out of range"),
        ({"priority": -101}, "priority -101 is out of range"),
        ({"queue_name": ""}, "queue name '' is invalid"),
        ({"queue_name": "q" * 201}, "at most 200"),
        ({"run_after": timedelta(seconds=-1)}, "negative delay"),
        ({"run_after": datetime(2030, 1, 1)}, "naive datetime while USE_TZ is on"),  # noqa: DTZ001
        ({"max_attempts": 0}, "max_attempts must be a positive integer"),
        ({"lease": -5}, "lease -5 is out of bounds: use 0.25 seconds to 7 days"),
    ],
)
def test_bad_options_are_refused_with_a_message_naming_the_problem(options, message):
    with pytest.raises(InvalidJobError, match=message):
        tasks.add.using(**options)


@pytest.mark.django_db
def test_enqueue_writes_a_pending_job_with_the_project_defaults(settings):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "MAX_ATTEMPTS": 7, "LEASE_SECONDS": 42}

    job = tasks.add.enqueue(1, b=2)

    job.refresh_from_db()
    assert (job.task, job.args, job.kwargs, job.state) == (
        "tests.testapp.tasks.add",
        [1],
        {"b": 2},
        JobState.PENDING,
    )
    assert (job.max_attempts, job.lease, job.attempts) == (7, timedelta(seconds=42), 0)
    assert job.run_at == job.created_at  # both the database's now()


@pytest.mark.django_db
def test_run_after_as_a_timedelta_counts_from_the_database_clock():
    job = tasks.add.using(run_after=timedelta(hours=2)).enqueue(1, 2)
    job.refresh_from_db()
    assert job.run_at - job.created_at == timedelta(hours=2)
    assert not Job.objects.due().exists()


@pytest.mark.django_db
def test_run_after_as_an_aware_datetime_is_stored_as_given():
    when = (timezone.now() + timedelta(days=30)).replace(microsecond=0)
    job = tasks.add.using(run_after=when).enqueue(1, 2)
    job.refresh_from_db()
    assert job.run_at == when


@pytest.mark.django_db
def test_tuples_come_back_as_lists():
    job = tasks.add.enqueue((1, 2), {"nested": (3,)})
    job.refresh_from_db()
    assert job.args == [[1, 2], {"nested": [3]}]


NOT_JSON = [
    (object(), "argument 0 is a builtins.object"),
    ({1, 2}, "argument 0 is a builtins.set"),
    (b"raw", "argument 0 is a builtins.bytes"),
    (decimal.Decimal("1.5"), "argument 0 is a decimal.Decimal"),
    (datetime.fromisoformat("2030-01-01T00:00:00+00:00"), "argument 0 is a datetime.datetime"),
    (uuid.UUID(int=1), "argument 0 is a uuid.UUID"),
    (float("nan"), "argument 0 is nan"),
    (float("inf"), "argument 0 is inf"),
    ("a\x00b", "argument 0 contains a NUL character"),
    ("\ud800", "argument 0 is not valid Unicode"),
    ({1: "a"}, "argument 0 has the key 1"),
    ([{"deep": object()}], r"argument 0\[0\]\['deep'\] is a builtins.object"),
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("value", "message"), NOT_JSON)
def test_arguments_that_are_not_json_are_refused_before_any_sql(value, message):
    """T27: each refused naming the argument, before any SQL, the caller's atomic() usable."""
    with transaction.atomic():
        with (
            CaptureQueriesContext(connection) as queries,
            pytest.raises(InvalidJobError, match=message),
        ):
            tasks.add.enqueue(value, 1)
        assert [q for q in queries if "INSERT" in q["sql"]] == []
        assert Job.objects.count() == 0  # the caller's transaction is still usable


@pytest.mark.django_db
def test_a_keyword_argument_is_named_in_the_error():
    with pytest.raises(InvalidJobError, match="argument 'when' is a datetime.datetime"):
        tasks.echoes_arguments.enqueue(1, when=datetime.fromisoformat("2030-01-01T00:00:00+00:00"))


@pytest.mark.django_db
def test_payload_at_the_limit_round_trips_and_one_byte_more_is_refused(settings):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "MAX_PAYLOAD_BYTES": 100}
    overhead = len('["' + '"]' + "{}")  # args and kwargs as jsonb prints them
    exact = "x" * (100 - overhead)

    job = tasks.returns_value.enqueue(exact)
    job.refresh_from_db()
    assert job.args == [exact]
    with connection.cursor() as cursor:  # the size counted is the size stored
        cursor.execute(
            "SELECT octet_length(args::text) + octet_length(kwargs::text) FROM skipqueue_job"
        )
        assert cursor.fetchone()[0] == 100

    with pytest.raises(InvalidJobError, match="101 bytes as stored .*, over the limit of 100"):
        tasks.returns_value.enqueue(exact + "x")
    assert Job.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_enqueue_many_writes_all_calls_in_one_insert():
    calls = [((n, n), {}) for n in range(500)]
    with CaptureQueriesContext(connection) as queries:
        jobs = tasks.add.enqueue_many(calls)
    assert len([q for q in queries if "INSERT INTO skipqueue_job" in q["sql"]]) == 1
    assert len({job.id for job in jobs}) == 500
    assert Job.objects.due().count() == 500
    assert [job.args for job in jobs] == [[n, n] for n in range(500)]  # ids follow the calls


def fields_of(job: Job) -> dict:
    return {field.attname: getattr(job, field.attname) for field in Job._meta.concrete_fields}


@pytest.mark.django_db
@pytest.mark.parametrize("receiver", [False, True], ids=["fast path", "post_init receiver"])
def test_enqueue_many_returns_jobs_exactly_as_the_orm_loads_them(receiver):
    from django.db.models.signals import post_init

    seen = []

    def count(sender, instance, **kwargs):
        seen.append(instance)

    if receiver:
        post_init.connect(count, sender=Job)
    try:
        jobs = tasks.add.using(priority=3).enqueue_many([((1, 2), {}), (("é", "x"), {})])
    finally:
        post_init.disconnect(count, sender=Job)
    assert len(seen) == (2 if receiver else 0)  # receivers see every instance
    for job in jobs:
        loaded = Job.objects.get(id=job.id)
        assert fields_of(job) == fields_of(loaded)
        assert not job._state.adding and job._state.db == "default"
    job = jobs[0]
    job.priority = 7
    job.save(update_fields=["priority"])  # an ordinary model instance
    assert Job.objects.get(id=job.id).priority == 7


@pytest.mark.django_db
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"priority": -4, "max_attempts": 2, "lease": 12},
        {"run_after": timedelta(minutes=5)},
        {"run_after": "in 30 days"},
        {"expires": timedelta(hours=1)},
        {"expires": "in 30 days"},
    ],
    ids=["plain", "options", "delay", "at", "expires in", "expires at"],
)
def test_enqueue_returns_the_job_exactly_as_the_orm_loads_it(options):
    """One enqueue takes its own statement (sql.ENQUEUE_ONE), not enqueue_many's: what
    it hands back must still be the row as stored, every column."""
    later = timezone.now() + timedelta(days=30)
    options = {name: later if value == "in 30 days" else value for name, value in options.items()}
    job = tasks.add.using(**options).enqueue(1, b="é")
    loaded = Job.objects.get(id=job.id)
    assert fields_of(job) == fields_of(loaded)
    assert not job._state.adding and job._state.db == "default"


@pytest.mark.django_db
def test_each_enqueue_writes_its_own_options_and_any_queue_name_as_given():
    """Calls of one task with other options, and a queue name with quotes, a backslash,
    percent signs and a placeholder's spelling, are written exactly as given, beside
    their own arguments (the options are cached per task, the statement per form)."""
    odd = "it's 100% \\ %(args)s é"
    calls = [(1, "default"), (2, odd), (1, odd), (2, "default"), (1, odd)]
    jobs = [tasks.add.using(priority=p, queue_name=q).enqueue(p, b=q) for p, q in calls]
    rows = Job.objects.in_bulk([job.id for job in jobs])
    assert [
        (rows[job.id].priority, rows[job.id].queue_name, rows[job.id].args, rows[job.id].kwargs)
        for job in jobs
    ] == [(p, q, [p], {"b": q}) for p, q in calls]


@pytest.mark.django_db
def test_an_enqueue_follows_the_settings_of_the_moment(settings):
    """A task keeps its resolved options beside the settings they came from: a change
    of SKIPQUEUE (override_settings, a test's `settings`) is seen by the next enqueue."""
    first = tasks.add.enqueue(1, 2)
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "MAX_ATTEMPTS": 9, "LEASE_SECONDS": 77}
    second = tasks.add.enqueue(1, 2)
    assert first.max_attempts != 9
    second.refresh_from_db()
    assert (second.max_attempts, second.lease) == (9, timedelta(seconds=77))


@pytest.mark.django_db
def test_a_task_in_a_module_workers_never_import_is_refused_at_enqueue():
    """Defined after start-up outside every tasks module and TASK_MODULES: a worker would
    fail each attempt with UnknownTaskError, so the enqueue says why instead."""
    from tests.testapp import undiscovered_tasks

    with pytest.raises(ConfigurationError, match=r"workers do not import.*TASK_MODULES"):
        undiscovered_tasks.late_native.enqueue()
    with pytest.raises(ConfigurationError, match="tests.testapp.undiscovered_tasks"):
        undiscovered_tasks.late_native.enqueue_many([((), {})])
    assert not Job.objects.exists()
    assert undiscovered_tasks.late_native.call() is None  # still callable in-process


@pytest.mark.django_db
def test_a_task_module_listed_in_task_modules_may_be_imported_late(settings):
    import importlib
    import sys

    from django_skipqueue.tasks.registry import autodiscover

    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "TASK_MODULES": ["tests.testapp.late_but_listed"]}
    discovered = registry.discovered_modules
    try:
        autodiscover()  # as a worker starting with this setting does
        module = importlib.import_module("tests.testapp.late_but_listed")
        module.listed.enqueue()
        assert Job.objects.filter(task="tests.testapp.late_but_listed.listed").exists()
    finally:
        registry.discovered_modules = discovered
        registry.unregister("tests.testapp.late_but_listed.listed")
        sys.modules.pop("tests.testapp.late_but_listed", None)


@pytest.mark.django_db
def test_the_one_statement_insert_writes_the_model_fields_defaults():
    from django.db.models.signals import pre_save

    def noop(sender, instance, **kwargs):
        pass

    fast = tasks.add.enqueue(1, 2)
    pre_save.connect(noop, sender=Job)  # a receiver sends enqueue through Model.save()
    try:
        saved = tasks.add.enqueue(1, 2)
    finally:
        pre_save.disconnect(noop, sender=Job)
    varying = {"id", "run_at", "created_at"}
    rows = Job.objects.filter(id__in=[fast.id, saved.id]).order_by("id").values()
    assert [{k: v for k, v in row.items() if k not in varying} for row in rows] == [
        {k: v for k, v in rows[1].items() if k not in varying}
    ] * 2


@pytest.mark.django_db
def test_the_payload_limit_counts_utf8_bytes_in_bulk_too(settings):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "MAX_PAYLOAD_BYTES": 20}
    tasks.returns_value.enqueue_many([(("a" * 14,), {})])  # ["aaaaaaaaaaaaaa"] and {}: 20 bytes
    with pytest.raises(InvalidJobError, match="take 21 bytes as stored"):
        tasks.returns_value.enqueue_many([(("é" * 7 + "a",), {})])  # 8 characters, 21 bytes stored
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_enqueue_many_writes_nothing_when_one_call_is_bad():
    calls = [((1, 2), {}), ((object(), 2), {})]
    with pytest.raises(InvalidJobError, match="argument 0 is a builtins.object"):
        tasks.add.enqueue_many(calls)
    assert not Job.objects.exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("ids_only", [False, True])
def test_enqueue_many_names_a_call_that_is_not_an_args_kwargs_pair(ids_only):
    """`[(1, 2)]` for add(1, 2) raised "object of type 'int' has no len()", and
    `[("ab", {})]` enqueued add("a", "b"): each is refused by its index and shape,
    nothing of the call is written, and the caller's transaction goes on."""
    good = ((1, 2), {})
    for bad in [(1, 2), ("ab", {}), ((1, 2), None), ((1,), {"b": 2}, 3), None, ()]:
        with transaction.atomic():
            with pytest.raises(InvalidJobError) as raised:
                tasks.add.enqueue_many([good, good, bad], ids_only=ids_only, batch_size=2)
            assert "call 2 is" in str(raised.value)
            assert "each call is a pair (args, kwargs)" in str(raised.value)
            tasks.add.enqueue(3, 4)  # the transaction is usable
            transaction.set_rollback(True)
    assert not Job.objects.exists()
    assert len(tasks.add.enqueue_many([good, [[5], {"b": 6}]], ids_only=ids_only)) == 2


@pytest.mark.django_db
def test_enqueue_many_honours_run_after_from_the_database_clock():
    tasks.add.using(run_after=timedelta(minutes=5)).enqueue_many([((1, 2), {})])
    assert Job.objects.filter(run_at__gt=Now() + timedelta(minutes=4)).count() == 1


def test_job_str_and_repr_never_show_arguments():
    job = Job(id=3, task="t", args=["hunter2"], kwargs={"password": "hunter2"}, state="pending")
    assert "hunter2" not in str(job)
    assert "hunter2" not in repr(job)


def test_t28_a_payload_limit_above_the_ceiling_is_a_check_error(settings):
    from django_skipqueue.checks import check_settings

    settings.SKIPQUEUE = {"MAX_PAYLOAD_BYTES": 2 * 1024 * 1024}
    [error] = check_settings()
    assert error.id == "skipqueue.E002" and "MAX_PAYLOAD_BYTES" in error.msg


@pytest.mark.django_db
def test_the_queue_table_carries_its_autovacuum_settings():
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = 'skipqueue_job'")
        options = cursor.fetchone()[0]
    assert "autovacuum_vacuum_scale_factor=0" in options
    assert "autovacuum_vacuum_threshold=2000" in options


@given(name=st.text(max_size=80))
@hypothesis_settings(max_examples=300, deadline=None)
def test_s6_any_queue_name_is_either_valid_or_refused_cleanly(name):
    from django_skipqueue.core.states import validate_queue_name

    try:
        validate_queue_name(name)
    except InvalidJobError:
        return
    # Accepted: any text Django's Tasks API takes, but control characters, within
    # 200 bytes (its channel is a quoted identifier, or a hash: test_notify.py)
    assert 0 < len(name.encode()) <= 200
    assert not any(ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F for char in name)


@pytest.mark.django_db
def test_enqueue_sends_save_signals_when_a_receiver_listens():
    from django.db.models.signals import post_save

    saved = []

    def record(sender, instance, created, **kwargs):
        saved.append((instance.id, created))

    plain = tasks.add.enqueue(1, 2)  # no receiver: the one-statement INSERT
    post_save.connect(record, sender=Job)
    try:
        job = tasks.add.enqueue(3, 4)
    finally:
        post_save.disconnect(record, sender=Job)
    assert saved == [(job.id, True)]
    for each in (plain, job):
        assert fields_of(each) == fields_of(Job.objects.get(id=each.id))


@hypothesis_settings(max_examples=300, deadline=None)
@given(
    parameters=st.lists(
        st.tuples(st.sampled_from("abcde"), st.booleans(), st.booleans()),
        max_size=4,
        unique_by=lambda p: p[0],
    ),
    positional=st.integers(min_value=0, max_value=5),
    keywords=st.sets(st.sampled_from("abcdef"), max_size=4),
)
def test_the_fast_call_check_agrees_with_signature_bind(parameters, positional, keywords):
    """`_Shape.binds` is the fast path of check_call: it must say yes exactly when
    `inspect.Signature.bind` accepts the call, for any signature of named parameters."""
    from django_skipqueue.core.spec import call_shape as _call_shape
    from django_skipqueue.core.spec import call_signature as _call_signature

    parameters = sorted(parameters, key=lambda p: p[2])  # keyword-only ones last
    parameters = sorted(parameters, key=lambda p: (p[2], p[1]))  # defaults after required
    params = ", ".join(
        (("*, " if kw_only and not any(q[2] for q in parameters[:i]) else "") + name)
        + ("=None" if has_default else "")
        for i, (name, has_default, kw_only) in enumerate(parameters)
    )
    namespace: dict = {}
    exec(f"def f({params}): pass", namespace)  # noqa: S102  (a generated test signature)
    func = namespace["f"]
    args, kwargs = [0] * positional, dict.fromkeys(keywords, 0)
    try:
        _call_signature(func, False).bind(*args, **kwargs)
        binds = True
    except TypeError:
        binds = False
    assert _call_shape(func, False).binds(args, kwargs) == binds


@pytest.mark.django_db
@pytest.mark.parametrize("ids_only", [False, True])
def test_a_bad_call_deep_in_a_stream_leaves_nothing_and_names_its_position(ids_only):
    """`enqueue_many(ids_only=True)` of a generator, batches of 100, a bad call at 437:
    the 400 rows of the batches before it stayed in the caller's still-usable
    transaction. All or nothing now (a savepoint), and the refusal names the call."""
    from django.db import transaction

    def calls():
        for n in range(1000):
            yield ((object() if n == 437 else n, 2), {})

    with transaction.atomic():
        kept = tasks.add.enqueue(1, 1)  # the caller's own work before the bad stream
        with pytest.raises(InvalidJobError, match="call 437: "):
            tasks.add.enqueue_many(calls(), batch_size=100, ids_only=ids_only)
        assert list(Job.objects.values_list("id", flat=True)) == [kept.id]
        tasks.add.enqueue(2, 2)  # the caller's transaction goes on
    assert Job.objects.count() == 2
