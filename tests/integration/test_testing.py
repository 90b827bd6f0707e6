"""The helpers users get for their own tests: enqueued() and run_jobs()."""

from __future__ import annotations

import pytest

from django_skipqueue.testing import enqueued, run_jobs
from tests.testapp import tasks

pytestmark = pytest.mark.django_db


def test_enqueued_lists_what_the_code_under_test_enqueued():
    tasks.add.enqueue(1, 2)
    tasks.add.enqueue(3, 4)
    tasks.named.enqueue()
    assert enqueued(tasks.add).count() == 2
    assert [job.args for job in enqueued("tests.testapp.tasks.add")] == [[1, 2], [3, 4]]
    assert enqueued(queue_name="other").get().task == "tests.named"
    assert enqueued().count() == 3


def test_run_jobs_drains_due_jobs_in_process_through_the_real_protocol():
    first, second = tasks.add.enqueue(1, 2), tasks.add.enqueue(3, 4)
    executions = run_jobs()
    assert [(e.job_id, e.outcome.value) for e in executions] == [
        (first.id, "succeeded"),
        (second.id, "succeeded"),
    ]
    assert enqueued().count() == 0
    first.refresh_from_db()
    assert first.result == 3


def test_run_jobs_honours_its_limit_and_queues():
    tasks.add.enqueue(1, 1)
    tasks.named.enqueue()  # queue "other"
    assert [e.outcome.value for e in run_jobs(["other"])] == ["succeeded"]
    assert enqueued(tasks.add).count() == 1
    assert run_jobs(limit=0) == []


def test_run_jobs_in_a_tests_transaction_wakes_a_job_whose_signal_was_sent():
    """Inside a TestCase's transaction, the sender's on_commit wake-up never runs:
    run_jobs makes the jobs parked on a signal that is there due, as the reaper does."""
    from django_skipqueue import send_signal

    job = tasks.durable_kyc.enqueue()
    run_jobs()  # parked on its wait
    send_signal(job.id, "kyc", "in a test")
    run_jobs()
    job.refresh_from_db()
    assert job.state == "done" and job.result == {"decisions": ["in a test"]}
