"""Housekeeping passes: reaping and pruning keep going past a row they cannot move."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db.models.functions import Now

from django_skipqueue.models import Job
from django_skipqueue.reaper import Reaper
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
