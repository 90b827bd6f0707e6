"""Helpers for testing code that enqueues jobs: run them in the test process.

    from django_skipqueue.testing import run_jobs

    def test_signup_sends_a_welcome_email(client, mailoutbox):
        client.post("/signup/", {...})
        assert enqueued(send_welcome_email).count() == 1
        [execution] = run_jobs()
        assert execution.outcome == "succeeded"

The jobs go through the real claim, executor and fence, on the test database. Tests
using it need rows committed or the same connection (pytest-django's `db` is enough).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django_skipqueue.core.states import DEFAULT_QUEUE_NAME
from django_skipqueue.tasks.base import Task

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from django_skipqueue.models import Job
    from django_skipqueue.runtime.executor import Execution


def enqueued(
    task: Task[Any, Any] | str | None = None,
    *,
    queue_name: str | None = None,
    database: str | None = None,
) -> QuerySet[Job]:
    """Pending jobs, of one task (a Task or its name) and queue if given, oldest first.

    For asserting what the code under test enqueued: `enqueued(send_receipt).count()`,
    `enqueued(send_receipt).get().args`.
    """
    from django_skipqueue.conf import get_settings
    from django_skipqueue.models import Job

    jobs = Job.objects.using(database or get_settings().DATABASE_ALIAS).pending()
    if task is not None:
        jobs = jobs.filter(task=task if isinstance(task, str) else task.name)
    if queue_name is not None:
        jobs = jobs.filter(queue_name=queue_name)
    return jobs.order_by("id")


def run_jobs(
    queues: Sequence[str] | None = None,
    *,
    limit: int | None = None,
    database: str | None = None,
) -> list[Execution]:
    """Claim and run due jobs one at a time until none is due (or `limit` ran).

    Jobs whose retry is scheduled later are not waited for: call again after the
    delay, or give such tasks a zero-delay RetryPolicy in tests. Flow control applies
    as in a worker: paused queues are left alone, and jobs with a concurrency key and
    those of limited queues are claimed under their limits. Jobs parked on a wait for a
    signal that is there are made due first, as a worker's reaper does: inside a
    TestCase's transaction, a sender's on_commit wake-up never runs.
    """
    from django_skipqueue.conf import get_settings
    from django_skipqueue.conf.limits import queue_limits
    from django_skipqueue.models import Job, Queue
    from django_skipqueue.runtime.executor import execute

    alias = database or get_settings().DATABASE_ALIAS
    names = list(queues) if queues is not None else _all_queues(alias)
    jobs = Job.objects.db_manager(alias)
    limits = queue_limits()
    executions: list[Execution] = []
    jobs.wake_signalled()
    while limit is None or len(executions) < limit:
        paused = Queue.objects.db_manager(alias).paused_names(names)
        active = [name for name in names if name not in paused]
        fast = [name for name in active if name not in limits]
        claimed = jobs.claim(queues=fast, limit=1) if fast else []
        if not claimed and active:
            claimed, _ = jobs.claim_limited(queues=active, limits=limits, limit=1)
        if not claimed:
            break
        executions.append(execute(claimed[0], database=alias))
    return executions


def _all_queues(alias: str) -> list[str]:
    from django_skipqueue.models import Job

    names = list(
        Job.objects.db_manager(alias).due().values_list("queue_name", flat=True).distinct()
    )
    return names or [DEFAULT_QUEUE_NAME]
