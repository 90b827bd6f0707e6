"""django-tasks' own test tasks (its tests/tasks.py at 0.12.0), declared with the Tasks
API's @task under SkipQueueBackend, for tests/integration/test_backport_conformance.py.

Changed: the failing tasks make one attempt (`max_attempts=1`), as the backport's
backends do; ours would otherwise retry them with backoff. `hang` and `sleep_for` are
left out (its worker tests, which are django-tasks-db's now).
"""

from __future__ import annotations

from typing import Any

from django_skipqueue import backends
from django_skipqueue.core.tasks_api import TaskContext, task


@task()
def noop_task(*args: Any, **kwargs: Any) -> None:
    return None


@task
def noop_task_from_bare_decorator(*args: Any, **kwargs: Any) -> None:
    return None


@task()
async def noop_task_async(*args: Any, **kwargs: Any) -> None:
    return None


@task()
def calculate_meaning_of_life() -> int:
    return 42


@backends.task(max_attempts=1)
def failing_task_value_error() -> None:
    raise ValueError("This task failed due to ValueError")


@backends.task(max_attempts=1)
def failing_task_system_exit() -> None:
    raise SystemExit("This task failed due to SystemExit")


@backends.task(max_attempts=1)
def complex_exception() -> None:
    raise ValueError(ValueError("This task failed"))


@backends.task(max_attempts=1)
def complex_return_value() -> Any:
    # Return something which isn't JSON serializable nor picklable
    return lambda: True


@task(takes_context=True)
def get_task_id(context: TaskContext) -> str:
    return context.task_result.id


@task(takes_context=True)
def test_context(context: TaskContext, attempt: int) -> None:
    assert isinstance(context, TaskContext)
    assert context.attempt == attempt


def undecorated() -> str:
    """Decorated in a test, by the backport's @task on Django 6.x (its test_compat)."""
    return "ran"
