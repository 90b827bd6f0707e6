"""Why due jobs wait (lag.py): the overview's reasons under a queue's lag, and the job
page's "why it waits". Each cause made for real: a pause, no live worker, a task's
spent rate limit (run through the claim), a concurrency key at its limit, a queue's
own limit, busy workers; and the jobs not due yet (a time, a parent)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from django_skipqueue import chain
from django_skipqueue.lag import job_reason, queue_reasons
from django_skipqueue.models import Job, JobState, Queue, WorkerProcess
from django_skipqueue.stats import queue_stats
from django_skipqueue.testing import run_jobs
from tests.conftest import set_lease
from tests.testapp.tasks import add, per_account, three_a_minute, two_a_minute_per_tenant

pytestmark = pytest.mark.django_db


def reasons(queue: str = "default") -> list[str]:
    return queue_reasons(queue_stats(broker=False)).get(queue, [])


def live_worker(queue: str = "default") -> None:
    WorkerProcess.objects.create(hostname="test", pid=1, queues=[queue])


def running(job: Job) -> None:
    """As a claim leaves it: running, its first attempt, a live lease."""
    Job.objects.filter(id=job.id).update(
        state=JobState.RUNNING, attempts=1, started_at=timezone.now()
    )
    set_lease(job.id, 60)


def test_a_paused_queue_and_a_queue_nobody_takes_say_so():
    add.enqueue(1, 1)
    assert reasons() == ["no live worker takes this queue"]
    live_worker()
    Queue.objects.pause("default", by="ops")
    assert reasons() == ["paused: no worker claims from it"]
    assert not Queue.objects.filter(name="d").exists()  # one name, not its letters


def test_jobs_held_by_their_tasks_spent_rate_limit_say_which_task_and_when():
    live_worker()
    for n in range(5):
        three_a_minute.enqueue(n)
    run_jobs()  # the bucket's three starts are taken; two jobs stay due
    [reason] = reasons()
    assert reason.startswith("all of the oldest 2 held: task three_a_minute's rate limit (3/m)")
    assert "the next start in" in reason
    held = Job.objects.filter(state=JobState.PENDING).first()
    assert job_reason(held).startswith("its task's rate limit (3/m) is spent")


def test_a_rate_limit_per_key_says_which_task_without_showing_the_key():
    """A per-key bucket is named `task[value]`, the value made of the arguments (a
    tenant, an account): the reasons name the task only."""
    live_worker()
    for n in range(3):
        two_a_minute_per_tenant.enqueue("tenant-secret-7", n)
    run_jobs()  # the bucket's two starts are taken; one job stays due
    [reason] = reasons()
    assert reason.startswith(
        "all of the oldest 1 held: task two_a_minute_per_tenant's rate limit per key (2/m)"
    )
    held = Job.objects.get(state=JobState.PENDING)
    assert job_reason(held).startswith("its task's rate limit (2/m) is spent")
    assert "tenant-secret-7" not in reason + job_reason(held)


def test_a_job_behind_its_concurrency_key_says_so_without_showing_the_key():
    live_worker()
    first = per_account.enqueue("acct-secret-42")
    second = per_account.enqueue("acct-secret-42")
    add.enqueue(1, 1)  # free to run: only the busy workers hold it
    running(first)
    text = " ".join(reasons())
    assert "1 of the oldest 2 held: a concurrency key at its limit" in text
    assert job_reason(Job.objects.get(id=second.id)) == (
        "its concurrency key is at its limit (1 running)"
    )
    assert "acct-secret-42" not in text + job_reason(Job.objects.get(id=second.id))


def test_a_queue_at_its_concurrency_limit_says_how_many_run():
    live_worker()
    busy = add.enqueue(1, 1)
    add.enqueue(2, 2)
    running(busy)
    with override_settings(SKIPQUEUE={"QUEUE_LIMITS": {"default": {"concurrency": 1}}}):
        assert reasons() == ["its concurrency limit: 1 of 1 running"]
    assert reasons() == ["its workers' threads are busy (1 of its jobs running)"]


def test_jobs_not_due_wait_for_their_time_or_their_parents():
    later = add.using(run_after=timedelta(minutes=10)).enqueue(1, 1)
    assert job_reason(later) == "scheduled: due in 10 min"
    chain(add.s(1, 1), add.s(2)).enqueue()
    waiting = Job.objects.get(state=JobState.WAITING)
    assert job_reason(waiting) == "waiting on 1 parent job of its workflow"
    done = add.enqueue(3, 3)
    run_jobs()
    done.refresh_from_db()
    assert job_reason(done) == ""


def test_the_overview_and_the_job_page_show_why_to_a_view_only_user(client):
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(*Permission.objects.filter(codename__startswith="view_"))
    client.force_login(viewer)
    live_worker()
    for n in range(5):
        three_a_minute.enqueue(n)
    run_jobs()
    page = client.get(reverse("admin:skipqueue_overview")).content.decode()
    assert "task three_a_minute&#x27;s rate limit (3/m)" in page
    held = Job.objects.filter(state=JobState.PENDING).first()
    page = client.get(reverse("admin:skipqueue_job_change", args=[held.id])).content.decode()
    assert "why it waits" in page.lower() and "rate limit (3/m) is spent" in page
    done = Job.objects.filter(state=JobState.DONE).first()
    page = client.get(reverse("admin:skipqueue_job_change", args=[done.id])).content.decode()
    assert "why it waits" not in page.lower()


def test_queue_limits_that_are_not_a_dict_leave_the_overview_up(admin_client):
    """The system check reports it (skipqueue.E002), but a web server runs no check:
    the overview raised AttributeError on QUEUE_LIMITS = ["reports"]."""
    add.enqueue(1, 1)
    live_worker()
    with override_settings(SKIPQUEUE={"QUEUE_LIMITS": ["default"]}):
        response = admin_client.get(reverse("admin:skipqueue_overview"))
    assert response.status_code == 200
