"""django-skipqueue: a background-job queue for Django on PostgreSQL (SKIP LOCKED).

The public API. Importing this module never imports models, so `@task` can be used
in any module, whether or not the app registry is ready.
"""

from __future__ import annotations

from django_skipqueue.core import collector

collector.pause_for_worker_start()  # first: before the imports of the worker's start-up

from django_skipqueue.core.cron import Cron  # noqa: E402
from django_skipqueue.core.retry import RetryPolicy  # noqa: E402
from django_skipqueue.exceptions import DuplicateJobError, Retry, WorkflowFailed  # noqa: E402
from django_skipqueue.tasks.base import Signature, Task, TaskContext, task  # noqa: E402
from django_skipqueue.tasks.canvas import chain, chord, group  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Cron",
    "DuplicateJobError",
    "Retry",
    "RetryPolicy",
    "Signature",
    "Task",
    "TaskContext",
    "WorkflowFailed",
    "__version__",
    "chain",
    "chord",
    "group",
    "task",
]
