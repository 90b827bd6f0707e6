"""Debounce and throttle (issue 56 point 4; queue/coalesce.py): the calls of one task and
key join one pending job, under concurrent enqueues in their own transactions."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models import F

from django_skipqueue import chain, task
from django_skipqueue.exceptions import ConfigurationError, InvalidJobError
from django_skipqueue.models import Job, JobState
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True)]


def pending(task_name: str) -> list[Job]:
    return list(Job.objects.filter(task=task_name, state=JobState.PENDING).order_by("id"))


def test_debounced_calls_of_one_key_make_one_job_with_the_last_arguments_due_after_the_last():
    first = tasks.digest.enqueue(7, changes=1)
    time.sleep(0.2)
    second = tasks.digest.enqueue(7, changes=2)
    other = tasks.digest.enqueue(8, changes=9)
    assert second.id == first.id != other.id
    [job, other_job] = pending(tasks.digest.name)
    assert job.kwargs == {"changes": 2} and job.coalesce_key == "user_id=7"
    assert job.run_at - job.created_at >= timedelta(seconds=0.65)  # moved: 0.5 after the 2nd
    assert other_job.kwargs == {"changes": 9}


def test_a_debounce_never_passes_its_maximum_wait_after_the_first_call():
    first = tasks.digest.enqueue(7, changes=1)
    for n in range(6):  # calls keep coming, each within the debounce of the last
        time.sleep(0.4)
        tasks.digest.enqueue(7, changes=n)
    job = Job.objects.get(id=first.id)
    assert job.coalesce_until is not None
    assert job.run_at <= job.coalesce_until == job.created_at + timedelta(seconds=2)


def test_a_running_job_takes_no_call_the_next_call_makes_the_next_job():
    """A change during a run is not lost: the running job is no longer pending."""
    first = tasks.digest.enqueue(7, changes=1)
    Job.objects.filter(id=first.id).update(run_at=F("created_at"))
    [claimed] = Job.objects.claim(queues=["default"], limit=1)
    assert claimed.id == first.id
    later = tasks.digest.enqueue(7, changes=2)
    assert later.id != first.id and later.state == JobState.PENDING


def test_concurrent_enqueues_in_their_own_transactions_make_one_pending_job():
    """Eight threads enqueue the same key at one instant, each in a transaction held a
    moment: one pending job, whoever commits last wrote its arguments."""
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []
    ids: list[int] = []

    def call(n: int) -> None:
        try:
            with transaction.atomic():
                barrier.wait()
                ids.append(tasks.digest.enqueue(7, changes=n).id)
                time.sleep(0.05)
        except BaseException as error:  # noqa: BLE001  (reported below)
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=call, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    [job] = pending(tasks.digest.name)
    assert set(ids) == {job.id}


def test_a_rolled_back_call_changes_nothing_and_the_callers_transaction_goes_on():
    first = tasks.digest.enqueue(7, changes=1)
    before = Job.objects.get(id=first.id)
    with pytest.raises(RuntimeError), transaction.atomic():
        tasks.digest.enqueue(7, changes=2)
        raise RuntimeError("the view failed")
    after = Job.objects.get(id=first.id)
    assert (after.kwargs, after.run_at) == (before.kwargs, before.run_at)
    with transaction.atomic():
        assert tasks.digest.enqueue(7, changes=3).id == first.id
        assert Job.objects.filter(task=tasks.digest.name).count() == 1  # usable


def test_a_throttle_starts_the_first_call_at_once_joins_the_next_and_runs_it_after_the_period():
    first = tasks.throttled_sync.enqueue(7, n=1)
    assert first.run_at <= first.created_at + timedelta(seconds=0.01)  # due at once
    claimed, _ = Job.objects.claim_limited(queues=["default"], limits={}, limit=5)
    assert [job.id for job in claimed] == [first.id]
    second = tasks.throttled_sync.enqueue(7, n=2)
    third = tasks.throttled_sync.enqueue(7, n=3)
    assert third.id == second.id and third.kwargs == {"n": 2}  # the first call's
    assert Job.objects.claim_limited(queues=["default"], limits={}, limit=5)[0] == []
    time.sleep(1.1)  # the period: the key's bucket holds a start again
    again, _ = Job.objects.claim_limited(queues=["default"], limits={}, limit=5)
    assert [job.id for job in again] == [second.id]
    other = tasks.throttled_sync.enqueue(8)  # another key is not held back
    assert [j.id for j in Job.objects.claim_limited(queues=["default"], limits={}, limit=5)[0]] == [
        other.id
    ]


def test_enqueue_many_joins_calls_of_one_key_and_returns_each_calls_job():
    jobs = tasks.digest.enqueue_many([((7,), {"changes": n}) for n in range(3)] + [((8,), {})])
    assert [job.id for job in jobs[:3]] == [jobs[0].id] * 3 and jobs[3].id != jobs[0].id
    assert Job.objects.get(id=jobs[0].id).kwargs == {"changes": 2}


def _coalesced(user_id: int) -> None: ...


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"debounce": 1, "throttle": 1}, "debounce and throttle do not go together"),
        ({"debounce": 1, "unique_key": ("user_id",)}, "drop unique_key"),
        ({"throttle": 1, "rate_limit": "5/s"}, "drop rate_limit"),
        ({"debounce_key": ("user_id",)}, "debounce_key and debounce_max_wait need debounce"),
        ({"debounce": 5, "debounce_max_wait": 1}, "debounce_max_wait is shorter than debounce"),
        ({"debounce": 0}, "debounce of .* from 0.1"),
        ({"throttle": timedelta(days=2)}, "throttle of .* to 86400"),
    ],
)
def test_options_that_cannot_go_together_are_refused_at_the_declaration(options, message):
    with pytest.raises(ConfigurationError, match=message):
        task(**options)(_coalesced)


def test_a_debounced_task_is_refused_in_a_workflow_naming_why():
    with pytest.raises(InvalidJobError, match="debounced or throttled: its calls join one"):
        chain(tasks.add.s(1, 2), tasks.digest.s()).enqueue()
    assert Job.objects.count() == 0


def test_a_claimed_job_leaves_its_key_so_its_retry_or_reap_never_meets_the_next_job():
    """The outside trial: a running debounced job set back to pending (a retry, a
    release, the reaper) met the newer pending job of its key in the unique index: its
    outcome could not be written, and the reaper failed it. The claim clears its key."""
    from django_skipqueue.maintenance.reaper import Reaper
    from tests.conftest import set_lease

    first = tasks.digest.enqueue(7, changes=1)
    Job.objects.filter(id=first.id).update(run_at=F("created_at"))
    [running] = Job.objects.claim(queues=["default"], limit=1)
    assert running.coalesce_key is None
    later = tasks.digest.enqueue(7, changes=2)
    assert later.id != first.id
    set_lease(first.id, -1)  # its worker died: the reaper takes it back
    assert Reaper().reap().requeued == 1
    rows = dict(Job.objects.filter(task=tasks.digest.name).values_list("id", "state"))
    assert rows == {first.id: JobState.PENDING, later.id: JobState.PENDING}
    joined = tasks.digest.enqueue(7, changes=3)  # joins the key's pending job, not the retry
    assert joined.id == later.id


def test_a_debounced_jobs_expiry_is_its_last_calls_and_a_delay_is_counted_in_sql():
    expiring = tasks.digest.using(expires=timedelta(seconds=30))
    first = expiring.enqueue(7, changes=1)
    assert first.expires_at is not None
    assert timedelta(seconds=29) < first.expires_at - first.created_at <= timedelta(seconds=30)
    time.sleep(0.2)
    later = tasks.digest.using(expires=timedelta(seconds=60)).enqueue(7, changes=2)
    assert later.id == first.id
    assert later.expires_at - first.expires_at > timedelta(seconds=29)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"debounce": 1, "ordered_key": ("user_id",)}, "an ordered key cannot keep in order"),
        ({"throttle": 0.5}, "throttle is a whole number of seconds"),
        ({"throttle": 2, "rate_key": ("user_id",)}, "drop rate_key"),
    ],
)
def test_more_options_that_cannot_go_with_debounce_or_throttle(options, message):
    with pytest.raises(ConfigurationError, match=message):
        task(**options)(_coalesced)
