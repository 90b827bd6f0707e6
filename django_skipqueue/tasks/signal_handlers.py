"""Receivers: Django's task_started / task_finished for jobs of django.tasks Tasks.

Sent with the backend class as sender, as Django's own backends do: the signals of the
API core/tasks_api.py serves (django.tasks, or the django-tasks backport's). Connected in
SkipQueueConfig.ready(), only when that API exists.
"""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from django_skipqueue import signals
from django_skipqueue.core.compat import set_on_frozen
from django_skipqueue.core.tasks_api import (
    TaskResultStatus,
    task_finished,
    task_started,
)
from django_skipqueue.tasks.registry import registry


def _django_result(job: Any, status: str | None = None) -> tuple[Any, Any] | None:
    if job.task not in registry:
        return None
    django_task = registry.get(job.task).django_task
    if django_task is None:
        return None
    backend = django_task.get_backend()
    result = backend.result_from_job(job)  # the job's own options
    if status is not None:
        set_on_frozen(result, "status", TaskResultStatus[status])
    return type(backend), result


@receiver(signals.job_started, dispatch_uid="skipqueue_django_task_started")
def send_task_started(sender: Any, job: Any, **kwargs: Any) -> None:
    found = _django_result(job)
    if found:
        task_started.send(found[0], task_result=found[1])


@receiver(signals.job_succeeded, dispatch_uid="skipqueue_django_task_succeeded")
def send_task_succeeded(sender: Any, job: Any, result: Any = None, **kwargs: Any) -> None:
    found = _django_result(job, "SUCCESSFUL")
    if found:
        set_on_frozen(found[1], "_return_value", result)
        task_finished.send(found[0], task_result=found[1])


@receiver(signals.job_failed, dispatch_uid="skipqueue_django_task_failed")
def send_task_failed(sender: Any, job: Any, **kwargs: Any) -> None:
    found = _django_result(job, "FAILED")
    if found:
        task_finished.send(found[0], task_result=found[1])
