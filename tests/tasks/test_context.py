"""Progress of long jobs (issue 28): `context.set_progress()`, written through the fence
at most once a second per job, shown in the admin, `queuestats --json` and the row."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.urls import reverse

from django_skipqueue import chain
from django_skipqueue.core.cancel import CancelFlag
from django_skipqueue.models import Job, JobState
from django_skipqueue.runtime.inflight import InFlight
from django_skipqueue.runtime.worker import Worker
from django_skipqueue.tasks.context import TaskContext, progress_report
from django_skipqueue.testing import run_jobs
from tests.processes import wait_until
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def running_worker():
    tasks.progress_release.clear()
    worker = Worker(concurrency=1, listen=False, poll_interval=0.05, reap_interval=0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    yield worker
    tasks.progress_release.set()
    worker.stop()
    thread.join(timeout=20)


def test_progress_shows_while_the_job_runs_then_the_last_report_stays(
    running_worker, admin_client, capsys
):
    job = tasks.reports_progress.enqueue(steps=5000)
    wait_until(
        lambda: (Job.objects.get(id=job.id).progress or {}).get("done") == 5000,
        timeout=10,
        message="the running job's progress was never written",
    )
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert job.progress["total"] == 5000 and job.progress["note"] == "step 5000"
    assert job.progress["attempt"] == 1 and job.progress["at"]
    assert job.describe_progress() == "5000 of 5000 (100%): step 5000"
    page = admin_client.get(reverse("admin:skipqueue_job_change", args=[job.id]))
    assert "5000 of 5000 (100%): step 5000" in page.content.decode()
    listing = admin_client.get(reverse("admin:skipqueue_job_changelist"))
    assert "5000 of 5000 (100%)" in listing.content.decode()
    call_command("queuestats", "--json")
    in_progress = json.loads(capsys.readouterr().out)["in_progress"]
    assert [(entry["id"], entry["summary"]) for entry in in_progress] == [
        (job.id, "5000 of 5000 (100%): step 5000")
    ]
    tasks.progress_release.set()
    wait_until(lambda: Job.objects.get(id=job.id).state == JobState.DONE, timeout=10)
    job.refresh_from_db()
    # The last report, made within a second of the one before, is written as the
    # attempt ends: a finished job does not show a stale "step 5000".
    assert job.describe_progress() == "5000 of 5000 (100%): finished"


def test_a_report_is_written_at_most_once_a_second_whatever_the_task_calls():
    held = InFlight()
    job = Job(id=1, task="t", attempts=1, max_attempts=1, lease=timedelta(seconds=10))
    flight = held.add(job, now=99.0, timeout=None)
    for done in range(1000):
        flight.cancel.progress = progress_report(done, 1000)
    first = held.progress_due(now=100.0, every=1.0)
    assert [report["done"] for _flight, report in first] == [999]
    flight.cancel.progress = progress_report(1000, 1000)
    assert held.progress_due(now=100.5, every=1.0) == []  # within the second: kept
    assert [r["done"] for _f, r in held.progress_due(now=101.0, every=1.0)] == [1000]
    assert held.progress_due(now=105.0, every=1.0) == []  # nothing new


def test_only_the_attempt_holding_the_lease_writes_progress():
    job = tasks.add.enqueue(1, 2)
    jobs = Job.objects
    claimed = jobs.claim(queues=["default"], limit=1, lease=timedelta(seconds=30))
    assert [c.id for c in claimed] == [job.id]
    assert jobs.report_progress(job.id, 1, progress_report(1, 2)) is True
    assert jobs.report_progress(job.id, 2, progress_report(2, 2)) is False  # not its attempt
    Job.objects.filter(id=job.id).update(leased_until=None)
    assert jobs.report_progress(job.id, 1, progress_report(2, 2)) is False  # lease gone
    job.refresh_from_db()
    assert job.progress["done"] == 1


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("3",), TypeError, "done must be a number"),
        ((True,), TypeError, "done must be a number"),
        ((-1,), ValueError, "done must be a finite number >= 0"),
        ((1, float("nan")), ValueError, "total must be a finite number >= 0"),
        ((1, 2, 3), TypeError, "note must be a str"),
        ((1, 2, "x" * 201), ValueError, "201 characters"),
    ],
)
def test_bad_progress_is_refused_with_a_clear_error(args, error, match):
    context = TaskContext(
        job_id=1,
        attempt=1,
        max_attempts=1,
        task_name="t",
        queue_name="q",
        database="default",
        cancel_event=CancelFlag(),
    )
    with pytest.raises(error, match=match):
        context.set_progress(*args)
    assert context.cancel_event.progress is None


def test_outside_a_worker_the_last_report_is_written_when_the_attempt_ends():
    job = tasks.reports_progress.enqueue(steps=50)
    tasks.progress_release.set()
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE
    assert job.describe_progress() == "50 of 50 (100%): finished"


def test_an_async_task_reports_progress_in_a_worker_and_outside_one():
    job = tasks.async_progress.enqueue(5)
    run_jobs()  # no database call from the event loop: the report is handed over
    job.refresh_from_db()
    assert (job.state, job.result) == (JobState.DONE, 5)
    assert job.describe_progress() == "5 of 5 (100%)"


def test_a_workflows_handle_shows_its_steps_progress(running_worker):
    workflow = chain(tasks.reports_progress.s(steps=300), tasks.double.s()).enqueue()
    wait_until(
        lambda: workflow.progress()["running"],
        timeout=10,
        message="the workflow's running step never showed its progress",
    )
    progress = workflow.progress()
    assert progress["jobs"] == 2 and progress["done"] == 0
    assert progress["by_state"] == {"running": 1, "waiting": 1}
    [step] = progress["running"]
    assert step["task"].endswith("reports_progress") and step["progress"]["total"] == 300
    tasks.progress_release.set()
    assert workflow.wait(timeout=10) == 600
    assert workflow.progress()["by_state"] == {"done": 2}
