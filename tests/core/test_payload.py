"""Payloads as the database stores them: sizes, fidelity, and rows Python cannot load."""

from __future__ import annotations

import tracemalloc

import pytest
from django.db import connection, transaction
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_skipqueue.core.payload import Undecodable, encode, encoded_size
from django_skipqueue.exceptions import InvalidJobError
from django_skipqueue.models import Job
from django_skipqueue.testing import run_jobs
from tests.testapp import tasks

FLOATS = [1e20, -1.5e300, 1e16, 9.007199254740993e15, 0.1, 1.0, -0.5, 2.5e-7, 5e-324, 1e308]


def stored_size(value: object) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT octet_length(%s::jsonb::text)", [encode(value)])
        return cursor.fetchone()[0]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "value",
    [
        [1e308] * 300,
        [5e-324, 1e-300, 1.5e20],
        {"b": [1, 2, {"c": "é\n\x01"}], "a": None, "t": True},
        ['quote " and \\ backslash', 12345678901234567890, []],
    ],
)
def test_the_size_counted_is_the_size_the_database_stores(value):
    assert encoded_size(value) == stored_size(value)


@pytest.mark.django_db
def test_floats_come_back_as_floats_with_the_same_value():
    job = tasks.add.enqueue(FLOATS, {"x": 1e20})
    loaded = Job.objects.get(id=job.id)
    assert loaded.args == [FLOATS, {"x": 1e20}]
    assert [type(value) for value in loaded.args[0]] == [float] * len(FLOATS)
    assert type(loaded.args[1]["x"]) is float


@pytest.mark.django_db(transaction=True)
def test_a_task_receives_and_returns_floats_as_they_went_in():
    job = tasks.echoes_arguments.enqueue(1e20, 3, big=1.5e300, small=2.5e-7)
    [execution] = run_jobs()
    assert execution.outcome.value == "succeeded"
    job.refresh_from_db()
    assert job.result == {"args": [1e20, 3], "kwargs": {"big": 1.5e300, "small": 2.5e-7}}
    assert type(job.result["args"][0]) is float and type(job.result["args"][1]) is int


def test_the_encoder_writes_no_exponent_and_keeps_the_point_of_whole_floats():
    assert encode([1e20, 2.5e-7, 3]) == "[100000000000000000000.0, 0.00000025, 3]"


# -- enqueue refuses cleanly, and never aborts the caller's transaction ---------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: tasks.echoes_arguments.enqueue(**{"a\x00b": 1}), "contains a NUL"),
        (lambda: tasks.echoes_arguments.enqueue(**{"a\udc80": 1}), "not valid Unicode"),
        (lambda: tasks.returns_value.enqueue(10**5000), "more than 4300 digits"),
        (lambda: tasks.returns_value.enqueue([1e308] * 30000), "bytes as stored"),
        (lambda: tasks.returns_value.using(lease=1e300).enqueue(1), r"lease 1e\+300 is out"),
        (lambda: tasks.returns_value.using(lease=0.001).enqueue(1), "lease 0.001 is out"),
        (
            lambda: tasks.add.enqueue(1, 2, 3),
            r"add\(a, b\) cannot be called with these arguments: too many",
        ),
        (lambda: tasks.add.enqueue(1, 2, c=3), "unexpected keyword argument 'c'"),
        (lambda: tasks.add.enqueue_many([((1, 2), {}), ((1,), {})]), "missing a required"),
    ],
    ids=[
        "nul-name",
        "surrogate-name",
        "huge-int",
        "jsonb-size",
        "lease-1e300",
        "lease-1ms",
        "too-many",
        "unknown-kwarg",
        "bulk-missing",
    ],
)
def test_a_bad_enqueue_raises_invalid_job_error_and_leaves_the_transaction_usable(call, message):
    with transaction.atomic():
        tasks.add.enqueue(1, 1)  # the caller's business write, so to speak
        with pytest.raises(InvalidJobError, match=message):
            call()
        assert Job.objects.count() == 1  # the transaction still works
    assert Job.objects.count() == 1


@pytest.mark.django_db
def test_a_lease_of_timedelta_max_is_refused_at_enqueue():
    from datetime import timedelta

    with pytest.raises(InvalidJobError, match="out of bounds"):
        tasks.add.using(lease=timedelta.max).enqueue(1, 2)


# -- rows written by another client that Python's json cannot load ---------------------


@pytest.mark.django_db
def test_a_row_python_cannot_load_comes_back_undecodable_not_as_an_error():
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,"
            " lease, attempts, max_attempts, expirations, releases, last_error, errors,"
            " created_at) VALUES ('tests.testapp.tasks.add', '[1e4400]', '{}', 'default', 0,"
            " 'pending', now(), '30 s', 0, 5, 0, 0, '', '[]', now()) RETURNING id"
        )
        job_id = cursor.fetchone()[0]
    job = Job.objects.get(id=job_id)
    assert isinstance(job.args, Undecodable)
    assert "4300" in job.args.reason
    assert job.kwargs == {}


# -- bounded memory for big fan-outs -----------------------------------------------------


def peak_memory(function) -> int:
    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.django_db
def test_enqueue_many_ids_only_streams_in_batches_with_bounded_memory():
    def fan_out(calls: int) -> list[int]:
        generated = (((n, n), {}) for n in range(calls))
        return tasks.add.enqueue_many(generated, ids_only=True, batch_size=2000)

    small = peak_memory(lambda: fan_out(10_000))
    large = peak_memory(lambda: fan_out(50_000))
    # Five times the calls: only the list of ids grows (tens of bytes an id), never the
    # batch; the Job objects of the default would take about 1.4 KB each (70 MB here).
    assert large - small < 40_000 * 100, (small, large)
    assert large < 8 * 1024 * 1024, large
    assert Job.objects.count() == 60_000


@pytest.mark.django_db
def test_enqueue_many_ids_only_returns_the_ids_in_call_order():
    ids = tasks.add.enqueue_many((((n, 0), {}) for n in range(7)), ids_only=True, batch_size=3)
    assert [Job.objects.get(id=job_id).args[0] for job_id in ids] == list(range(7))


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)


@hypothesis_settings(max_examples=400, deadline=None)
@given(_json_values)
def test_the_fast_encoder_writes_what_the_plain_json_encoder_writes(value):
    from django_skipqueue.core.payload import _ENCODER, _encode_fast

    assert _encode_fast(value) == _ENCODER.encode(value)
