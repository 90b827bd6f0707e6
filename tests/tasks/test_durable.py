"""Durable steps (issue 55): checkpoints that a later attempt replays, atomic steps
whose writes commit with their checkpoint only while the attempt owns the job, and
sleeps that give the job back. Real PostgreSQL; jobs run by `run_jobs()` (in this
process, with real leases) or a worker thread."""

from __future__ import annotations

import time

import pytest

from django_skipqueue.models import Job, JobState, Step
from django_skipqueue.testing import run_jobs
from tests.testapp import tasks
from tests.testapp.models import StepRun

pytestmark = pytest.mark.django_db(transaction=True)


def expire_lease(job_id: int) -> None:
    """As if the attempt's worker froze past its lease."""
    Job.objects.filter(id=job_id).update(leased_until="2000-01-01T00:00:00Z")


def test_a_retry_resumes_after_the_last_recorded_step_and_replays_its_results():
    job = tasks.durable_onboarding.enqueue("ada", fail_at="welcome")
    run_jobs(limit=1)  # attempt 1: create_account recorded, welcome raised
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.attempts == 1
    run_jobs()  # its backoff is 0: due again
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.last_error
    # create_account ran once; the retry got its recorded result back
    assert StepRun.objects.filter(job_id=job.id, step="create_account").count() == 1
    assert StepRun.objects.filter(job_id=job.id, step="welcome").count() == 2  # at least once
    assert job.result == {"account": "acct-ada", "active": True}
    steps = list(Step.objects.filter(job_id=job.id).order_by("position"))
    assert [(s.name, s.kind, s.attempt) for s in steps] == [
        ("create_account", "plain", 1),
        ("welcome", "plain", 2),
        ("activate", "atomic", 2),
    ]
    assert all(s.recorded_at >= s.started_at for s in steps)


def test_an_atomic_step_of_an_attempt_that_lost_its_job_rolls_back_whole():
    job = tasks.atomic_after_losing.enqueue()
    run_jobs()
    job.refresh_from_db()
    # The attempt lost its lease inside the step: the step's row and its checkpoint were
    # rolled back together, and the attempt's outcome was refused by the fence.
    assert StepRun.objects.filter(job_id=job.id).count() == 0
    assert not Step.objects.filter(job_id=job.id).exists()
    assert job.state == JobState.RUNNING  # the reaper's now: nothing this attempt wrote


def test_a_step_in_a_loop_gets_an_occurrence_and_a_stable_step_key():
    job = tasks.durable_loop.enqueue(3)
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE
    keys = job.result
    assert len(set(keys)) == 3 and all(k.startswith(f"skipqueue-job-{job.id}:page:") for k in keys)
    steps = Step.objects.filter(job_id=job.id).order_by("position")
    assert [(s.name, s.occurrence) for s in steps] == [("page", 1), ("page", 2), ("page", 3)]


def test_changed_code_that_meets_another_step_fails_naming_both():
    job = tasks.durable_onboarding.enqueue("ada", fail_at="welcome")
    run_jobs(limit=1)  # attempt 1 recorded create_account, then failed at welcome
    Step.objects.filter(job_id=job.id, position=1).update(name="make_account")  # old code
    Job.objects.filter(id=job.id).update(run_at="2000-01-01T00:00:00Z")
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.FAILED  # at once: another attempt would meet it again
    assert job.attempts == 2
    assert "StepMismatchError" in job.last_error
    assert "'make_account'" in job.last_error and "'create_account'" in job.last_error
    assert StepRun.objects.filter(job_id=job.id, step="create_account").count() == 1


def test_a_sleep_gives_the_job_back_without_spending_an_attempt_and_wakes_after():
    job = tasks.durable_nap.enqueue(1.0)
    allowed = job.max_attempts
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.PENDING  # asleep: not running, no thread, no lease
    assert job.leased_until is None
    assert (job.attempts, job.max_attempts) == (1, allowed + 1)  # the attempt given back
    assert StepRun.objects.filter(job_id=job.id, step="before").count() == 1
    run_jobs()  # not due yet: nothing runs
    assert Job.objects.get(id=job.id).state == JobState.PENDING
    time.sleep(1.2)
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE
    assert StepRun.objects.filter(job_id=job.id, step="before").count() == 1
    assert StepRun.objects.filter(job_id=job.id, step="after").count() == 1


def test_restart_from_a_step_drops_its_record_and_the_later_ones_and_runs_them_again():
    job = tasks.durable_onboarding.enqueue("ada")
    run_jobs()
    assert Job.objects.get(id=job.id).state == JobState.DONE
    assert not Job.objects.restart_from_step(job.id, 2)  # done: refused, nothing changed
    assert Step.objects.filter(job_id=job.id).count() == 3

    failing = tasks.durable_onboarding.using(max_attempts=1).enqueue("bob", fail_at="welcome")
    run_jobs()
    assert Job.objects.get(id=failing.id).state == JobState.FAILED
    assert Job.objects.restart_from_step(failing.id, 1)
    assert not Step.objects.filter(job_id=failing.id).exists()
    run_jobs()
    failing.refresh_from_db()
    assert failing.state == JobState.DONE
    # create_account ran again (its record was dropped), once per run from step 1
    assert StepRun.objects.filter(job_id=failing.id, step="create_account").count() == 2


def test_restart_refuses_a_running_job_and_a_bad_position():
    job = tasks.durable_nap.enqueue(30.0)
    Job.objects.filter(id=job.id).update(
        state=JobState.RUNNING, attempts=1, leased_until="2999-01-01T00:00:00Z"
    )
    assert not Job.objects.restart_from_step(job.id, 1)
    with pytest.raises(ValueError, match="position must be an int >= 1"):
        Job.objects.restart_from_step(job.id, 0)


def test_a_sleeping_job_restarted_is_due_now_and_sleeps_again_for_what_is_left():
    job = tasks.durable_nap.enqueue(60.0)
    run_jobs()
    assert Job.objects.restart_from_step(job.id, 3)  # nothing at 3: made due now
    run_jobs()  # replays "before", meets the sleep: 60 s not over, back to sleep
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert StepRun.objects.filter(job_id=job.id, step="before").count() == 1
    assert not StepRun.objects.filter(job_id=job.id, step="after").exists()


def test_async_tasks_have_the_same_steps():
    job = tasks.durable_async.enqueue(3)
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.last_error
    assert job.result == [0, 2, 4]
    kinds = list(
        Step.objects.filter(job_id=job.id).order_by("position").values_list("kind", flat=True)
    )
    assert kinds == ["plain", "plain", "plain", "atomic", "sleep"]
    assert StepRun.objects.filter(job_id=job.id, step="save").count() == 1


def test_a_step_outside_the_job_table_or_with_a_bad_name_or_result_is_refused():
    from django_skipqueue.exceptions import InvalidJobError
    from django_skipqueue.tasks.context import TaskContext

    relayed = TaskContext(1, 1, 1, "t", "q", "default", brokered=True)
    with pytest.raises(InvalidJobError, match="relayed to RabbitMQ"):
        relayed.step("x", lambda: 1)
    job = tasks.durable_bad_step.enqueue()
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert "step 'when'" in job.last_error
    assert "not JSON serializable" in job.last_error


def test_the_jobs_page_lists_its_steps_and_restarts_from_one(admin_client, client):
    from django.urls import reverse

    from tests.admin.test_admin import staff

    job = tasks.durable_onboarding.using(max_attempts=1).enqueue("ada", fail_at="welcome")
    run_jobs()
    page = admin_client.get(reverse("admin:skipqueue_job_change", args=[job.id])).content.decode()
    assert "skipqueue-steps" in page and "create_account" in page and "acct-ada" in page
    assert 'form="skipqueue-restart"' in page and 'id="skipqueue-restart"' in page
    viewer = (
        staff(client).get(reverse("admin:skipqueue_job_change", args=[job.id])).content.decode()
    )
    assert "create_account" in viewer and "acct-ada" not in viewer  # its shape: str
    assert 'form="skipqueue-restart"' not in viewer  # no retry permission, no button
    url = reverse("admin:skipqueue_job_act", args=[job.id, "restart"])
    response = admin_client.post(url, {"position": "1"})
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.state == JobState.PENDING and not Step.objects.filter(job_id=job.id).exists()
    assert admin_client.post(url, {"position": "x"}).status_code == 400


@pytest.mark.slow
def test_a_cancel_stops_a_durable_job_at_its_next_step():
    """Each step that runs is a safe point: the worker's cancel flag (set by its lease
    renewal) ends the job before the next step, with no row read per step."""
    import threading

    from django_skipqueue.runtime.worker import Worker
    from tests.processes import wait_until

    job = tasks.durable_storm.using(lease=0.6).enqueue(steps=200, ms=20)
    worker = Worker(concurrency=1, listen=False, poll_interval=0.05, reap_interval=0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Step.objects.filter(job_id=job.id).count() >= 5, timeout=20)
        Job.objects.cancel([job.id], by="ops")
        wait_until(lambda: Job.objects.get(id=job.id).state == JobState.CANCELLED, timeout=20)
    finally:
        worker.stop()
        thread.join(timeout=20)
    assert Step.objects.filter(job_id=job.id).count() < 200


def test_a_durable_job_is_a_chain_member_like_any_other():
    from django_skipqueue import chain

    workflow = chain(tasks.durable_onboarding.s("ada"), tasks.echo_input.s()).enqueue()
    run_jobs()
    assert workflow.wait(timeout=10) == {"account": "acct-ada", "active": True}


def test_the_metrics_count_steps_recorded_and_replayed():
    from prometheus_client import CollectorRegistry

    from django_skipqueue.runtime.prometheus import PrometheusSeries

    registry = CollectorRegistry()
    PrometheusSeries(registry)
    job = tasks.durable_onboarding.enqueue("ada", fail_at="welcome")
    run_jobs()  # attempt 1: create_account recorded; attempt 2 replays it, records two
    assert Job.objects.get(id=job.id).state == JobState.DONE
    name = tasks.durable_onboarding.name

    def count(kind: str, how: str) -> float | None:
        labels = {"task": name, "kind": kind, "how": how}
        return registry.get_sample_value("skipqueue_steps_total", labels)

    assert (count("plain", "recorded"), count("plain", "replayed")) == (2.0, 1.0)
    assert count("atomic", "recorded") == 1.0


@pytest.mark.slow
def test_a_sleep_outlives_its_worker_and_a_new_worker_wakes_it(start_worker):
    """D5 with real processes: the job sleeps in one worker, that worker stops (a
    deploy), and another, started later, runs the rest after the wake time."""
    import signal

    from tests.processes import wait_until

    job = tasks.durable_nap.enqueue(2.0)
    first = start_worker("--concurrency", "1")
    wait_until(lambda: Step.objects.filter(job_id=job.id, kind="sleep").exists(), timeout=20)
    first.signal(signal.SIGTERM)
    assert first.wait(timeout=20) == 0
    assert Job.objects.get(id=job.id).state == JobState.PENDING  # asleep, held by nobody
    second = start_worker("--concurrency", "1")
    wait_until(lambda: Job.objects.get(id=job.id).state == JobState.DONE, timeout=30)
    second.signal(signal.SIGTERM)
    assert StepRun.objects.filter(job_id=job.id, step="before").count() == 1
    assert StepRun.objects.filter(job_id=job.id, step="after").count() == 1
    slept = Step.objects.get(job_id=job.id, kind="sleep")
    finished = Job.objects.get(id=job.id).finished_at
    assert (finished - slept.recorded_at).total_seconds() >= 2.0  # not woken early


# -- the outside trial's findings (helper-7) --------------------------------------------


def test_a_step_that_raised_and_was_caught_runs_again_at_its_own_position():
    """Trial finding 1: records were matched by their index in the list, so a step
    that raised (no record) shifted every later one: StepMismatchError on a retry of
    unchanged code."""
    job = tasks.durable_caught.enqueue()
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.DONE, job.last_error
    assert job.result == ["a", "b"]
    steps = Step.objects.filter(job_id=job.id).order_by("position")
    assert [(s.position, s.name, s.attempt) for s in steps] == [(1, "a", 2), (2, "b", 1)]


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("nested", "step 'inner' was called while step 'outer' runs"),
        ("sleep-in-atomic", "sleep 'nap' inside transaction.atomic()"),
        ("huge-sleep", "seconds from 0 to 3.1536e+09 (a hundred years)"),
        ("caught-sleep", "the task returned after sleep 'nap' raised Retry"),
        ("caught-sleep-then-step", "step 'after' was called after sleep 'nap' raised Retry"),
        ("nul-name", "holds a NUL character"),
    ],
)
def test_a_durable_task_written_wrong_fails_at_once_with_words(how, words):
    """Trial findings 2 to 5 and 7: a nested step, a sleep inside the task's own
    transaction (it slept for ever), a sleep past any date (the page and the replay
    broke), a caught sleep (skipped silently), a name the database refuses (after the
    step's work was done)."""
    job = tasks.durable_misuse.enqueue(how)
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.FAILED and job.attempts == 1
    assert words in job.last_error
    assert not StepRun.objects.filter(job_id=job.id, step__in=["after", "nul"]).exists()


def test_steps_run_concurrently_are_refused():
    job = tasks.durable_gathered.enqueue()
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert "not concurrently, as with asyncio.gather" in job.last_error


def test_the_first_run_returns_what_a_replay_returns():
    """Trial finding 8: the first run returned the function's own value (-0.0, its key
    order), a replay the stored one."""
    job = tasks.durable_misuse.enqueue("stored-form")
    run_jobs()
    job.refresh_from_db()
    stored = Step.objects.get(job_id=job.id).result
    assert job.result == stored
    assert list(job.result) == list(stored) and job.result["neg"] == 0.0
    assert str(job.result["neg"]) == "0.0"


@pytest.mark.django_db(transaction=False)
def test_a_sleep_in_a_test_transaction_is_not_taken_for_the_tasks_own():
    """A test wrapped in a transaction (Django's TestCase, pytest-django's `db`) runs
    jobs with `run_jobs` inside it: the sleep refuses only blocks the task opened."""
    job = tasks.durable_nap.enqueue(30.0)
    run_jobs()
    job.refresh_from_db()
    assert job.state == JobState.PENDING, job.last_error  # asleep, not refused
    assert Step.objects.filter(job_id=job.id, kind="sleep").exists()
