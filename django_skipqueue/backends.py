"""SkipQueueBackend: django-skipqueue under Django's own Tasks API (Django >= 6.0).

    TASKS = {
        "default": {
            "BACKEND": "django_skipqueue.backends.SkipQueueBackend",
            "QUEUES": ["default", "emails"],
        }
    }

Tasks declared with Django's @task are stored as the same Job rows, in the caller's
transaction, and run by `runworker` with every guarantee of the native API: leases,
fencing, retries with backoff, the reaper, the admin. Everything else is configured in
SKIPQUEUE; the backend's OPTIONS are not used.

State mapping: pending -> READY, running -> RUNNING, done -> SUCCESSFUL,
failed and cancelled -> FAILED.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

try:
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task as DjangoTask
    from django.tasks.base import TaskError, TaskResult, TaskResultStatus
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued
except ImportError as error:  # Django 5.2
    raise ImproperlyConfigured(
        "django_skipqueue.backends needs Django 6.0 or newer (django.tasks); on Django "
        "5.2 use django-skipqueue's own @task from django_skipqueue instead"
    ) from error

from django_skipqueue.base import Task as SkipQueueTask
from django_skipqueue.compat import set_on_frozen
from django_skipqueue.conf import get_settings
from django_skipqueue.exceptions import InvalidJobError, UnknownTaskError
from django_skipqueue.registry import registry
from django_skipqueue.retry import RetryPolicy

if TYPE_CHECKING:
    from django_skipqueue.models import Job

STATUSES = {
    "pending": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "done": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Task(DjangoTask):
    """Django's Task with our options: `@task(max_attempts=3, lease=60)` under this backend
    (Django 6.1's `@task`, or `django_skipqueue.backends.task` on 6.0 and later)."""

    max_attempts: int | None = None
    lease: float | None = None  # seconds
    retry: RetryPolicy | None = None
    timeout: float | None = None  # seconds


def task(
    function: Callable[..., Any] | None = None,
    *,
    priority: int = 0,
    queue_name: str = "default",
    backend: str = "default",
    takes_context: bool = False,
    **options: Any,
) -> Any:
    """Django's `@task` that takes our options on Django 6.0 too.

    Django 6.1's own `@task` passes extra keyword arguments (`max_attempts`, `lease`,
    `retry`, `timeout`) to the backend's task class; Django 6.0's refuses them. This one
    takes them on both. Used with a backend other than SkipQueueBackend, our options
    raise a TypeError naming them and the backend.
    """
    from django.tasks import task_backends

    def wrapper(func: Callable[..., Any]) -> Any:
        task_class = task_backends[backend].task_class
        ours = {field.name for field in fields(Task)} - {field.name for field in fields(DjangoTask)}
        foreign = sorted(set(options) - ours) if issubclass(task_class, Task) else sorted(options)
        if foreign:
            raise TypeError(
                f"@task got {', '.join(foreign)}: not an option of TASKS[{backend!r}] "
                f"({task_backends[backend].__class__.__name__}); SkipQueueBackend takes "
                f"{', '.join(sorted(ours))}"
            )
        return task_class(
            func=func,
            priority=priority,
            queue_name=queue_name,
            backend=backend,
            takes_context=takes_context,
            run_after=None,
            **options,
        )

    return wrapper(function) if function is not None else wrapper


class SkipQueueBackend(BaseTaskBackend):
    task_class = Task
    supports_defer = True
    supports_priority = True
    supports_get_result = True
    supports_async_task = True  # run in an event loop on the worker thread

    def validate_task(self, task: DjangoTask) -> None:
        """Django's checks, then register the task so that workers can run it by name."""
        super().validate_task(task)
        registry.register(self._native(task))

    def _native(self, task: DjangoTask) -> SkipQueueTask[Any, Any]:
        try:
            return SkipQueueTask(
                func=task.func,
                name=task.module_path,
                queue_name=task.queue_name,
                priority=task.priority,
                takes_context=task.takes_context,
                max_attempts=getattr(task, "max_attempts", None),
                lease=getattr(task, "lease", None),
                retry=getattr(task, "retry", None),
                timeout=getattr(task, "timeout", None),
                django_task=task,
            )
        except InvalidJobError as error:
            raise InvalidTask(str(error)) from error

    def enqueue(self, task: DjangoTask, args: Any, kwargs: Any) -> TaskResult:
        """INSERT a Job in the caller's transaction; returns its READY TaskResult."""
        self.validate_task(task)
        native = self._native(task)
        if task.run_after is not None:
            native = native.using(run_after=task.run_after)
        try:
            job = native.enqueue(*args, **kwargs)
        except InvalidJobError as error:
            raise InvalidTask(str(error)) from error
        job.refresh_from_db(fields=["run_at", "created_at"])
        result = self.result_from_job(job, task)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        from django_skipqueue.models import Job

        try:
            job = Job.objects.using(get_settings().DATABASE_ALIAS).get(id=int(result_id))
        except (ValueError, TypeError, Job.DoesNotExist):
            raise TaskResultDoesNotExist(result_id) from None
        try:
            task = registry.get(job.task).django_task
        except UnknownTaskError:
            task = None
        if task is None:
            raise TaskResultDoesNotExist(
                f"{result_id}: its task {job.task!r} is not a django.tasks Task registered "
                f"in this process"
            )
        return self.result_from_job(job, task)

    def result_from_job(self, job: Job, task: DjangoTask) -> TaskResult:
        """A TaskResult that mirrors the job's row."""
        worker_ids = [str(job.worker_id or "")] * job.attempts
        result: TaskResult[Any, Any] = TaskResult(
            task=task,
            id=str(job.id),
            status=STATUSES[job.state],
            enqueued_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            last_attempted_at=job.started_at,
            args=list(job.args),
            kwargs=dict(job.kwargs),
            backend=self.alias,
            errors=[
                TaskError(
                    exception_class_path=entry.get("type", ""), traceback=entry.get("traceback", "")
                )
                for entry in job.errors
            ],
            worker_ids=worker_ids,
        )
        set_on_frozen(result, "_return_value", job.result)
        return result
