"""Housekeeping passes: reaping and pruning keep going past a row they cannot move."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models.functions import Now

from django_skipqueue.maintenance.reaper import Reaper
from django_skipqueue.models import Job
from tests.conftest import refusing
from tests.factories import JobFactory


@pytest.mark.django_db(transaction=True)
def test_a_row_that_cannot_be_pruned_is_left_and_the_others_go(caplog):
    old = Now() - timedelta(days=2)
    JobFactory.create_batch(5, done=True, finished_at=old)
    poison = JobFactory(done=True, finished_at=old, kwargs={"poison": True}).id

    with refusing("prune"):
        result = Reaper(batch_size=4).prune(done_older_than=timedelta(days=1))

    assert result.pruned_done == 5
    assert list(Job.objects.values_list("id", flat=True)) == [poison]
    assert f"job not pruned id={poison}" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_reap_pass_in_the_housekeeper_isolates_a_row_it_cannot_reap():
    JobFactory.create_batch(3, expired=True)
    JobFactory(expired=True, kwargs={"poison": True})

    with refusing("reap"):
        result = Reaper().reap()

    assert (result.requeued, result.failed) == (3, 1)


@pytest.mark.django_db(transaction=True)
def test_a_dry_run_counts_what_the_reap_would_do_and_changes_nothing():
    JobFactory.create_batch(3, expired=True)
    JobFactory.create_batch(2, expired=True, attempts=5, max_attempts=5)
    JobFactory(running=True)

    counted = Reaper().reap(dry_run=True)

    assert (counted.requeued, counted.failed) == (3, 2)
    assert Job.objects.filter(state="running").count() == 6
    done = Reaper().reap()
    assert (done.requeued, done.failed) == (counted.requeued, counted.failed)


@pytest.mark.django_db(transaction=True)
def test_a_reap_never_rewrites_a_finished_job_that_once_had_a_cancel_request():
    asked = Now() - timedelta(minutes=1)
    done = JobFactory(done=True, cancel_requested_at=asked)
    failed = JobFactory(failed=True, cancel_requested_at=asked)
    before = {job.id: (job.state, job.finished_at) for job in Job.objects.all()}

    result = Reaper().reap()

    assert result.cancelled == 0
    after = {job.id: (job.state, job.finished_at) for job in Job.objects.all()}
    assert after == before
    assert after[done.id][0] == "done" and after[failed.id][0] == "failed"


@pytest.mark.django_db(transaction=True)
def test_a_reap_leaves_a_live_running_job_with_a_cancel_request_to_its_worker():
    job = JobFactory(running=True, cancel_requested_at=Now())

    result = Reaper().reap()

    job.refresh_from_db()
    assert (result.cancelled, job.state) == (0, "running")
    assert job.leased_until is not None


@pytest.mark.django_db(transaction=True)
def test_an_expired_job_with_a_cancel_request_ends_cancelled_and_is_counted(caplog):
    from django_skipqueue import signals

    job = JobFactory(expired=True, cancel_requested_at=Now())
    received = []

    def receiver(**kwargs):
        received.append(kwargs)

    signals.job_reaped.connect(receiver)
    try:
        result = Reaper().reap()
    finally:
        signals.job_reaped.disconnect(receiver)

    job.refresh_from_db()
    assert (job.state, job.expirations) == ("cancelled", 1)
    assert result.cancelled == 1
    assert received[0]["cancelled"] == 1
    assert "cancelled=1" in caplog.text
    assert Reaper().reap().cancelled == 0  # once


@pytest.mark.django_db(transaction=True)
def test_a_running_row_without_a_lease_is_reaped_and_shown_as_stuck():
    job = JobFactory(running=True, leased_until=None)

    assert list(Job.objects.expired().values_list("id", flat=True)) == [job.id]
    result = Reaper().reap()

    job.refresh_from_db()
    assert (result.requeued, job.state, job.expirations) == (1, "pending", 1)
