"""Expiring jobs (`expires=`, issue 27): a job not started by its `expires_at` never runs;
the reaper ends it cancelled, by skipqueue:expired, and counts it.

Expiry is decided on the database clock by the claim (`JobQuerySet.unexpired`); an
instant already past, or a delay of a second, stands in for a real wait.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.utils import timezone

from django_skipqueue import Cron, chain, signals
from django_skipqueue.core.states import EXPIRED, UPSTREAM
from django_skipqueue.exceptions import InvalidJobError
from django_skipqueue.maintenance.reaper import Reaper
from django_skipqueue.maintenance.scheduler import sync, tick
from django_skipqueue.models import Job, JobState, WorkflowState
from django_skipqueue.runtime.executor import execute
from django_skipqueue.tasks.base import bind_schedules
from django_skipqueue.testing import run_jobs
from tests.testapp.tasks import add, double, per_account, sync_account

pytestmark = pytest.mark.django_db(transaction=True)

PAST = timedelta(seconds=-1)


def past() -> object:
    return timezone.now() + PAST


def test_a_delay_is_counted_from_the_enqueue_on_the_database_clock():
    job = add.using(expires=30).enqueue(1, 2)
    stored = Job.objects.get(id=job.id)
    assert stored.expires_at == stored.created_at + timedelta(seconds=30)
    assert job.expires_at == stored.expires_at  # the returned job says what was written
    [one, two] = add.using(expires=timedelta(minutes=5)).enqueue_many([((1, 2), {})] * 2)
    assert one.expires_at == Job.objects.get(id=two.id).created_at + timedelta(minutes=5)
    assert Job.objects.get(id=add.enqueue(1, 2).id).expires_at is None


def test_a_job_past_its_expiry_is_never_claimed_and_the_reaper_ends_it_counted():
    received = []

    def on_reaped(sender, **counts):
        received.append(counts)

    signals.job_reaped.connect(on_reaped)
    try:
        late = add.using(expires=past()).enqueue(1, 2)
        fine = add.using(expires=3600).enqueue(3, 4)
        assert [job.id for job in Job.objects.claim(queues=["default"], limit=10)] == [fine.id]
        result = Reaper().reap()
    finally:
        signals.job_reaped.disconnect(on_reaped)
    late.refresh_from_db()
    assert (late.state, late.cancelled_by, late.attempts) == (JobState.CANCELLED, EXPIRED, 0)
    assert late.last_error.startswith("expired: not started by ")
    assert late.finished_at is not None
    assert result.expired == 1 and received[-1]["expired"] == 1
    assert Reaper().reap().expired == 0  # ended once, counted once


def test_a_job_that_started_in_time_finishes_even_past_its_expiry():
    job = add.using(expires=1).enqueue(1, 2)
    [claimed] = Job.objects.claim(queues=["default"])
    time.sleep(1.2)  # the expiry passes while it runs
    assert Reaper().reap().expired == 0
    execute(claimed)
    job.refresh_from_db()
    assert (job.state, job.result) == (JobState.DONE, 3)


def test_a_retry_due_after_the_expiry_never_starts():
    from tests.testapp.tasks import always_fails

    job = always_fails.using(expires=1, max_attempts=3).enqueue()
    run_jobs()  # attempt 1 fails; the retry is due within a second or so
    Job.objects.filter(id=job.id).update(run_at=Now() + timedelta(seconds=2))
    time.sleep(1.2)
    Job.objects.filter(id=job.id).update(run_at=Now())
    assert run_jobs() == []
    Reaper().reap()
    job.refresh_from_db()
    assert (job.state, job.cancelled_by, job.attempts) == (JobState.CANCELLED, EXPIRED, 1)


def test_the_limited_claim_skips_an_expired_keyed_job_too():
    per_account.using(expires=past()).enqueue("acme", seconds=0)
    fresh = per_account.enqueue("other", seconds=0)
    claimed, _ = Job.objects.claim_limited(queues=["default"], limits={}, limit=10)
    assert [job.id for job in claimed] == [fresh.id]


def test_an_operator_retry_of_an_expired_job_runs_it():
    job = add.using(expires=past()).enqueue(1, 2)
    Reaper().reap()
    assert Job.objects.retry_now([job.id]) == 1
    job.refresh_from_db()
    assert job.expires_at is None
    run_jobs()
    job.refresh_from_db()
    assert (job.state, job.result) == (JobState.DONE, 3)


def test_a_replacing_unique_enqueue_takes_the_new_calls_expiry():
    first = sync_account.using(expires=3600).enqueue("acme")
    again = sync_account.using(expires=60).enqueue("acme", full=True)
    assert again.id == first.id
    stored = Job.objects.get(id=first.id)
    assert stored.kwargs == {"full": True}
    assert stored.expires_at < stored.created_at + timedelta(seconds=120)


def test_an_expired_workflow_step_cancels_what_waits_on_it():
    workflow = chain(add.s(1, 2), double.using(expires=past()).s(), double.s()).enqueue()
    first, second, third = Job.objects.filter(workflow=workflow).order_by("id")
    run_jobs()  # the first step: done; the second is due but expired
    Reaper().reap()
    second.refresh_from_db(), third.refresh_from_db()
    workflow.refresh_from_db()
    assert (second.state, second.cancelled_by) == (JobState.CANCELLED, EXPIRED)
    assert (third.state, third.cancelled_by) == (JobState.CANCELLED, UPSTREAM)
    assert workflow.state == WorkflowState.FAILED  # as when any step is cancelled
    assert "skipqueue:expired" in workflow.error


def test_an_expired_waiting_step_ends_before_its_parent_finishes():
    workflow = chain(add.s(1, 2), double.using(expires=past()).s()).enqueue()
    first, second = Job.objects.filter(workflow=workflow).order_by("id")
    assert second.state == JobState.WAITING
    assert Reaper().reap().expired == 1
    second.refresh_from_db()
    assert (second.state, second.cancelled_by) == (JobState.CANCELLED, EXPIRED)


def test_a_schedules_expiry_is_a_delay_after_each_occurrence():
    [cron] = bind_schedules(add, Cron("* * * * * *", name="fast", args=[1, 2], expires=30))
    sync({"fast": cron}, database="default")
    from django_skipqueue.models import Schedule

    Schedule.objects.update(last_occurrence_at=Now() - timedelta(seconds=3))
    tick({"fast": cron}, database="default")
    jobs = Job.objects.filter(schedule="fast")
    assert jobs.exists()
    assert all(job.expires_at == job.scheduled_for + timedelta(seconds=30) for job in jobs)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: add.using(expires=-1), "positive number of seconds"),
        (lambda: add.using(expires=timedelta(0)), "positive delay"),
        (lambda: add.using(expires="soon"), "seconds, a timedelta or an aware datetime"),
        (lambda: add.using(expires=timezone.now().replace(tzinfo=None)), "naive datetime"),
    ],
)
def test_a_bad_expiry_is_refused_naming_the_fault(make, message):
    with pytest.raises(InvalidJobError, match=message):
        make()


def test_a_tasks_own_expiry_is_a_delay_not_an_instant():
    from django_skipqueue import task

    with pytest.raises(InvalidJobError, match=r"a delay after the enqueue"):
        task(expires=timezone.now())(_undecorated)


def _undecorated() -> None: ...


@pytest.mark.slow
def test_a_worker_never_runs_an_expired_job_and_its_reaper_ends_it(start_worker):
    from tests.processes import wait_until

    late = add.using(expires=past()).enqueue(1, 2)
    fine = add.enqueue(3, 4)
    start_worker("--reap-interval", "0.5")
    wait_until(
        lambda: (
            Job.objects.filter(id__in=[late.id, fine.id], finished_at__isnull=False).count() == 2
        ),
        timeout=20,
        message="the worker did not end both jobs",
    )
    late.refresh_from_db(), fine.refresh_from_db()
    assert (late.state, late.cancelled_by, late.attempts) == (JobState.CANCELLED, EXPIRED, 0)
    assert fine.state == JobState.DONE


def test_the_relay_never_publishes_an_expired_job():
    from django.db import transaction

    late = add.using(expires=past(), queue_name="events").enqueue(1, 2)
    fine = add.using(queue_name="events").enqueue(3, 4)
    with transaction.atomic():
        assert [job.id for job in Job.objects.relayable(["events"], 10)] == [fine.id]
    assert Job.objects.get(id=late.id).state == JobState.PENDING  # until the reaper ends it
