"""Receivers: Django's task_started / task_finished for jobs of django.tasks Tasks.

Sent with the backend class as sender, as Django's own backends do: the signals of the
API core/tasks_api.py serves (django.tasks, or the django-tasks backport's). Connected
(`connect`) when SkipQueueBackend registers its first django.tasks Task, before any job
of it can run: a project whose tasks are all `@skipqueue.task` keeps our signals without
receivers, and a signal with one costs about 3 us more to send, twice a job (measured;
on Django 6 the API is always there).
"""

from __future__ import annotations

from typing import Any

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


def send_task_started(sender: Any, job: Any, **kwargs: Any) -> None:
    found = _django_result(job)
    if found:
        task_started.send(found[0], task_result=found[1])


def send_task_succeeded(sender: Any, job: Any, result: Any = None, **kwargs: Any) -> None:
    found = _django_result(job, "SUCCESSFUL")
    if found:
        set_on_frozen(found[1], "_return_value", result)
        task_finished.send(found[0], task_result=found[1])


def send_task_failed(
    sender: Any, job: Any, exception: BaseException | None = None, **kwargs: Any
) -> None:
    found = _django_result(job, "FAILED")
    if not found:
        return
    if exception is None:  # failed by the reaper: no exception
        task_finished.send(found[0], task_result=found[1])
        return
    # Django sends a failure's task_finished inside the exception handler, and its own
    # receiver logs it with logger.exception for error monitoring: so here too.
    try:
        raise exception
    except BaseException:  # noqa: BLE001  (re-raised only to be the one being handled)
        task_finished.send(found[0], task_result=found[1])


_BRIDGES = (
    (signals.job_started, send_task_started, "skipqueue_django_task_started"),
    (signals.job_succeeded, send_task_succeeded, "skipqueue_django_task_succeeded"),
    (signals.job_failed, send_task_failed, "skipqueue_django_task_failed"),
)
_connected = False


def connect() -> None:
    """Connect the receivers above (once: later calls return at once)."""
    global _connected
    if _connected:
        return
    for signal, receiver, uid in _BRIDGES:
        signal.connect(receiver, dispatch_uid=uid)
    _connected = True
