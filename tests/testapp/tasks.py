"""Module-level tasks the tests enqueue and run."""

from __future__ import annotations

import asyncio
import os
import time

from django_skipqueue import Retry, RetryPolicy, TaskContext, task
from tests.testapp.models import Run


@task
def add(a: int, b: int) -> int:
    return a + b


@task(name="tests.named", queue_name="other", priority=10)
def named() -> str:
    return "named"


@task(takes_context=True)
def record(context: TaskContext, sleep: float = 0.0, first_only: bool = False) -> dict[str, object]:
    """Log this execution (before the ack), then sleep (on the first attempt only, if asked)."""
    Run.objects.create(job_id=context.job_id, attempt=context.attempt, pid=os.getpid())
    if sleep and not (first_only and context.attempt > 1):
        time.sleep(sleep)
    return {"job_id": context.job_id, "attempt": context.attempt, "key": context.idempotency_key}


@task(retry=RetryPolicy(base=0.01, cap=0.05, jitter=0.1), max_attempts=3)
def always_fails(message: str = "boom") -> None:
    raise RuntimeError(message)


@task(non_retryable=(ValueError,), max_attempts=5)
def rejects_input(value: object) -> None:
    raise ValueError(f"cannot use {value!r}")


@task(takes_context=True)
def retry_once(context: TaskContext, delay: float = 0.0) -> str:
    if Run.objects.filter(job_id=context.job_id).exists():
        return "second time"
    Run.objects.create(job_id=context.job_id, attempt=context.attempt, pid=os.getpid())
    raise Retry(delay, reason="not yet")


@task
def returns_object() -> object:
    return object()


@task
def exits() -> None:
    raise SystemExit(3)


@task
async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@task(takes_context=True, lease=1.0)
def extends_lease(context: TaskContext, seconds: float) -> bool:
    return context.extend_lease(seconds)


@task
def drops_its_connection() -> str:
    """Kill this thread's database session, so the ack that follows meets a dead connection."""
    from django.db import OperationalError, connection

    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    except OperationalError:
        pass  # the session is gone; the task itself succeeded
    return "acked anyway"
