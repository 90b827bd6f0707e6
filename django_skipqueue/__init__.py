"""django-skipqueue: a background-job queue for Django on PostgreSQL (SKIP LOCKED).

The public API. Importing this module never imports models, so `@task` can be used
in any module, whether or not the app registry is ready.
"""

from __future__ import annotations

from django_skipqueue.core.cron import Cron
from django_skipqueue.core.retry import RetryPolicy
from django_skipqueue.exceptions import DuplicateJobError, JobFailed, Retry, WorkflowFailed
from django_skipqueue.tasks.base import Signature, Task, task
from django_skipqueue.tasks.canvas import chain, chord, group
from django_skipqueue.tasks.context import TaskContext
from django_skipqueue.tasks.durable import send_signal

__version__ = "0.1.0"

__all__ = [
    "Cron",
    "DuplicateJobError",
    "JobFailed",
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
    "send_signal",
    "task",
]
