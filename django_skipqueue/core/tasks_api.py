"""The Tasks API this process serves: Django's own `django.tasks` (Django >= 6.0), else
the django-tasks backport from PyPI (`django_tasks`, for Django 5.2).

One API per process, Django's first. `SkipQueueBackend` subclasses this API's
`BaseTaskBackend`, its `Task` this API's `Task`, and the worker sends this API's
signals. Where both exist (Django 6.x with django-tasks installed, as Wagtail and
modelsearch require), both read the one `TASKS` setting and both create our backend:
a task declared with the backport's `@task` then becomes a `django.tasks` Task, runs
the same, and its result is a `django.tasks` TaskResult (the attribute names and the
status strings are the same in both). django-tasks-db chooses the same way.

Importing this module raises ImportError when neither exists (Django 5.2 without the
backport). It imports no model and opens no connection.
"""

from __future__ import annotations

try:
    from django.tasks import (
        TaskContext,
        TaskResultStatus,
        default_task_backend,
        task,
        task_backends,
    )
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskError, TaskResult
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started

    #: The module of the API: "django.tasks", or "django_tasks" for the backport.
    API = "django.tasks"
except ImportError:  # Django 5.2: the backport, or ImportError if it is not installed
    from django_tasks import (  # type: ignore[assignment,no-redef,unused-ignore]
        TaskContext,
        TaskResultStatus,
        default_task_backend,
        task,
        task_backends,
    )
    from django_tasks import exceptions as _exceptions
    from django_tasks.backends.base import (  # type: ignore[assignment,no-redef,unused-ignore]
        BaseTaskBackend,
    )
    from django_tasks.base import (  # type: ignore[assignment,no-redef,unused-ignore]
        Task,
        TaskError,
        TaskResult,
    )
    from django_tasks.exceptions import (  # type: ignore[assignment,no-redef,unused-ignore]
        TaskResultDoesNotExist,
    )
    from django_tasks.signals import (  # type: ignore[assignment,no-redef,unused-ignore]
        task_enqueued,
        task_finished,
        task_started,
    )

    # Django's name; django-tasks 0.12 calls it InvalidTaskError (renamed after 0.12).
    InvalidTask = getattr(_exceptions, "InvalidTask", None) or _exceptions.InvalidTaskError  # type: ignore[assignment,misc,unused-ignore]
    API = "django_tasks"

__all__ = [
    "API",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "default_task_backend",
    "task",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
