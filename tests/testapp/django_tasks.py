"""Tasks declared with the Tasks API's own @task, run by SkipQueueBackend: Django's
(Django >= 6.0), or the django-tasks backport's on Django 5.2 (core/tasks_api.py)."""

from __future__ import annotations

import asyncio

import django

from django_skipqueue import backends
from django_skipqueue.core.tasks_api import API, task


@task
def dj_add(a: int, b: int) -> int:
    return a + b


@task(takes_context=True)
def dj_context(context) -> dict:  # noqa: ANN001
    return {"attempt": context.attempt, "id": context.task_result.id}


@task
def dj_fails() -> None:
    raise ValueError("nope")


@task
async def dj_async(a: int) -> int:
    await asyncio.sleep(0)
    return a * 2


@backends.task(max_attempts=3, lease=60)  # our options on Django 6.0 too
def dj_options() -> str:
    return "ok"


#: The API's own @task passes extra options to our Task: Django 6.1's and the backport's.
OWN_TASK_TAKES_OPTIONS = django.VERSION >= (6, 1) or API == "django_tasks"

if OWN_TASK_TAKES_OPTIONS:

    @task(max_attempts=4, lease=30)
    def dj_options_django() -> str:
        return "ok"


@task(queue_name="other", priority=10)
def dj_other() -> str:
    return "other"


@task(takes_context=True)
def dj_reenqueues(context, times: int) -> dict:  # noqa: ANN001
    """Enqueues itself again through its own context, `times` more times."""
    if times > 0:
        context.task_result.task.enqueue(times - 1)
    task = context.task_result.task
    return {"priority": task.priority, "queue_name": task.queue_name}


@task
def dj_returns_object() -> object:
    return object()


@backends.task(unique_key=("order_id",))
def dj_unique(order_id: int) -> int:
    """A unique job per order, declared with Django's @task API."""
    return order_id


@backends.task(time_limit=30, soft_time_limit=10, expires=600, rate_limit="100/m")
def dj_celery_options() -> str:
    """The options a Celery port uses, on the Tasks API (issue 27)."""
    return "ok"
