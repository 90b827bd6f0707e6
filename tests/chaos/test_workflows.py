"""W2: a chord under a SIGKILL storm (docs/explanation/failure-model.md, "Workflows")."""

from __future__ import annotations

import random
import time

import pytest

from django_skipqueue import chord, group
from django_skipqueue.models import Job, JobState, Workflow, WorkflowState
from tests.chaos.harness import check, deadlocks
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import JobAudit, Run

pytestmark = pytest.mark.django_db(transaction=True)

WORKERS, THREADS, MEMBERS, KILL_SECONDS = 3, 4, 1000, 20.0


@pytest.mark.timeout(360)
def test_a_chords_callback_is_made_due_once_after_every_member_under_sigkill(supervisor):
    """Three workers are SIGKILLed and restarted at random while a 1,000-member chord
    drains. Members may run twice (at least once); each is recorded once. The callback
    becomes due exactly once, only after the last member's recorded success, and
    receives every member's one recorded result, in the order given."""
    rng = random.Random(20261202)
    probe = tasks.probe.using(lease=3.0)
    workflow = chord(
        group(probe.si(ms=rng.randint(2, 30)) for _ in range(MEMBERS)), tasks.chord_body.s()
    ).enqueue()
    members = list(
        workflow.jobs.exclude(task=tasks.chord_body.name)
        .order_by("id")
        .values_list("id", flat=True)
    )
    body = workflow.jobs.get(task=tasks.chord_body.name)
    deadlocks_before = deadlocks()
    worker_args = ("--concurrency", str(THREADS), "--reap-interval", "1")
    for _ in range(WORKERS):
        supervisor.start(*worker_args)
    storm_ends = time.monotonic() + KILL_SECONDS
    while time.monotonic() < storm_ends:
        time.sleep(rng.uniform(1.0, 2.0))  # the storm's pace, not a synchronisation
        supervisor.kill_random(rng)
        supervisor.start(*worker_args)

    wait_until(
        lambda: Workflow.objects.get(id=workflow.id).state != WorkflowState.RUNNING,
        timeout=240,
        message="the workflow is still running after the storm",
    )
    workflow.refresh_from_db()
    report = check([*members, body.id], deadlocks_before)
    body.refresh_from_db()
    made_due = JobAudit.objects.filter(job_id=body.id, old_state="waiting", new_state="pending")
    last_member_done = max(Job.objects.filter(id__in=members).values_list("finished_at", flat=True))
    body_runs = Run.objects.filter(job_id=body.id).order_by("at")
    recorded = dict(Job.objects.filter(id__in=members).values_list("id", "result"))
    print(
        f"\nW2 kills={supervisor.kills} body_runs={body_runs.count()} "
        f"body_expirations={body.expirations} {report}"
    )

    assert report.violations() == []
    assert workflow.state == WorkflowState.DONE
    assert Job.objects.filter(id__in=members, state=JobState.DONE).count() == MEMBERS
    assert made_due.count() == 1  # due exactly once
    assert made_due.get().at >= last_member_done  # never before the last member's success
    assert body_runs.first().at >= last_member_done
    assert body_runs.count() == 1 + body.expirations  # its own runs: once, plus its losses
    assert body.result == [recorded[job_id] for job_id in members]  # in the order given
    assert workflow.result == body.result
    assert supervisor.kills >= 8
