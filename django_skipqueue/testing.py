"""Helpers for testing code that enqueues jobs: run them in the test process.

    from django_skipqueue.testing import run_jobs

    def test_signup_sends_a_welcome_email(client, mailoutbox):
        client.post("/signup/", {...})
        [execution] = run_jobs()
        assert execution.outcome == "succeeded"

The jobs go through the real claim, executor and fence, on the test database. Tests
using it need rows committed or the same connection (pytest-django's `db` is enough).
"""

from __future__ import annotations

from collections.abc import Sequence

from django_skipqueue.base import DEFAULT_QUEUE_NAME
from django_skipqueue.executor import Execution, execute


def run_jobs(
    queues: Sequence[str] | None = None,
    *,
    limit: int | None = None,
    database: str | None = None,
) -> list[Execution]:
    """Claim and run due jobs one at a time until none is due (or `limit` ran).

    Jobs whose retry is scheduled later are not waited for: call again after the
    delay, or give such tasks a zero-delay RetryPolicy in tests.
    """
    from django_skipqueue.conf import get_settings
    from django_skipqueue.models import Job

    alias = database or get_settings().DATABASE_ALIAS
    names = list(queues) if queues is not None else _all_queues(alias)
    executions: list[Execution] = []
    while limit is None or len(executions) < limit:
        claimed = Job.objects.db_manager(alias).claim(queues=names, limit=1)
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
