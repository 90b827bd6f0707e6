"""The job spec (core/spec.py): the one value between the task API and the queue layer.

Every job row is built from it, whichever path wrote the row: these tests write the same
call through each path and compare the rows, and drive the queue layer with a spec that
no Task stands behind.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test import override_settings

from django_skipqueue import Cron
from django_skipqueue.core.spec import CallRule, JobSpec, KeyRule
from django_skipqueue.exceptions import InvalidJobError, QueueFullError
from django_skipqueue.maintenance.scheduler import sync, tick
from django_skipqueue.models import Job, Schedule
from django_skipqueue.tasks.base import bind_schedules, task
from django_skipqueue.tasks.registry import registry
from tests.testapp.tasks import add, send_invoice

pytestmark = pytest.mark.django_db

#: The columns a spec decides (the rest are the database's or the worker's).
DECIDED = (
    "task",
    "args",
    "kwargs",
    "queue_name",
    "priority",
    "max_attempts",
    "lease",
    "unique_key",
    "rate_key",
    "rate_limit",
    "concurrency_key",
    "concurrency_limit",
)


def decided(job: Job) -> dict[str, object]:
    row = Job.objects.values(*DECIDED).get(id=job.id)
    return dict(row)


@pytest.fixture
def keyed_task():
    """A task with both keys and a rate limit, registered for the test only."""

    def billing(account: str, amount: int = 0) -> None: ...

    billing.__module__ = "tests.testapp.tasks"  # a module workers import
    billing.__qualname__ = "billing"
    made = task(
        name="tests.spec.keyed",
        queue_name="billing",
        priority=7,
        max_attempts=4,
        lease=30,
        unique_key=("account", "amount"),
        concurrency_key=lambda account, **_: f"acct:{account}",
        concurrency_limit=2,
        rate_limit="100/m",
    )(billing)
    yield made
    registry.unregister(made.name)


def test_a_spec_is_a_frozen_value():
    spec = add.spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.queue_name = "other"  # type: ignore[misc]


def test_every_enqueue_path_writes_the_same_row_for_the_same_call(keyed_task):
    call = (("a-1",), {"amount": 5})
    one = keyed_task.enqueue(*call[0], **call[1])
    Job.objects.cancel([one.id])  # frees the key
    many = keyed_task.enqueue_many([call])[0]
    Job.objects.cancel([many.id])
    built = keyed_task.build(*call[0], **call[1])
    built.save()
    rows = [decided(one), decided(many), decided(built)]
    assert rows[0] == rows[1] == rows[2]
    assert rows[0] == {
        "task": "tests.spec.keyed",
        "args": ["a-1"],
        "kwargs": {"amount": 5},
        "queue_name": "billing",
        "priority": 7,
        "max_attempts": 4,
        "lease": timedelta(seconds=30),
        "unique_key": 'account="a-1",amount=5',
        "concurrency_key": "acct:a-1",
        "concurrency_limit": 2,
        "rate_key": "tests.spec.keyed",
        "rate_limit": "100/m",
    }


def test_a_schedule_occurrence_is_built_by_the_same_mapping(keyed_task):
    every_second = Cron(expression="* * * * * *", args=["a-2"], kwargs={"amount": 1})
    cron = bind_schedules(keyed_task, every_second)[0]
    defined = {cron.name: cron}
    sync(defined, database="default")
    Schedule.objects.update(last_occurrence_at=Now() - timedelta(seconds=3))
    assert tick(defined, database="default").enqueued == 1  # the unique key holds the rest
    occurrence = Job.objects.get(schedule=cron.name)
    assert decided(occurrence) == keyed_task.spec().columns(["a-2"], {"amount": 1})


def test_the_queue_layer_takes_a_spec_that_no_task_stands_behind():
    """No Task, no registry: the manager needs only the value."""

    def compute(x: int) -> int: ...

    spec = JobSpec(
        name="not.registered",
        queue_name="default",
        priority=-3,
        run_after=timedelta(hours=1),
        max_attempts=2,
        lease=timedelta(seconds=9),
        call=CallRule("not.registered", compute),
        unique_key=KeyRule("unique_key", ("x",), CallRule("not.registered", compute)),
    )
    job = Job.objects.enqueue(spec, (3,), {})
    assert decided(job) | {"run_later": Job.objects.filter(run_at__gt=Now()).exists()} == {
        **dict.fromkeys(DECIDED),
        "task": "not.registered",
        "args": [3],
        "kwargs": {},
        "queue_name": "default",
        "priority": -3,
        "max_attempts": 2,
        "lease": timedelta(seconds=9),
        "unique_key": "x=3",
        "run_later": True,
    }
    assert Job.objects.enqueue(spec, (3,), {}).id == job.id  # the key is held
    with pytest.raises(InvalidJobError, match=r"not\.registered\(x\) cannot be called"):
        Job.objects.enqueue(spec, (1, 2), {})


def test_the_spec_takes_the_settings_of_the_moment_it_is_made():
    with override_settings(SKIPQUEUE={"MAX_ATTEMPTS": 9, "LEASE_SECONDS": 12}):
        spec = add.spec()
    assert (spec.max_attempts, spec.lease) == (9, timedelta(seconds=12))
    assert add.spec().max_attempts != 9


def test_the_pending_cap_is_counted_by_the_queue_layer_for_any_spec():
    with override_settings(SKIPQUEUE={"MAX_PENDING_PER_QUEUE": 2}):
        add.enqueue_many([((1, 1), {}), ((2, 2), {})])
        with pytest.raises(QueueFullError, match="MAX_PENDING_PER_QUEUE"):
            Job.objects.enqueue(add.spec(), (3, 3), {})
    # The caller's transaction goes on.
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    assert Job.objects.count() == 2


def test_a_key_of_a_spec_without_one_is_refused_by_name():
    with pytest.raises(InvalidJobError, match="has no unique_key"):
        add.spec().key_for((1, 2), {})
    assert send_invoice.spec().key_for((5,), {}) == "invoice_id=5"
