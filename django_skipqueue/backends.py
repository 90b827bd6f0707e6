"""SkipQueueBackend: django-skipqueue under Django's Tasks API: `django.tasks` on Django
6.0 and later, the django-tasks backport (`django_tasks`) on Django 5.2. One class,
subclassing the BaseTaskBackend of whichever core/tasks_api.py found (Django's first).

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

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.core.checks import CheckMessage, Error
from django.core.exceptions import ImproperlyConfigured

try:  # django.tasks (Django >= 6.0), else the django-tasks backport (core/tasks_api.py)
    from django_skipqueue.core.tasks_api import (
        BaseTaskBackend,
        InvalidTask,
        TaskError,
        TaskResult,
        TaskResultDoesNotExist,
        TaskResultStatus,
        task_enqueued,
    )
    from django_skipqueue.core.tasks_api import Task as DjangoTask
except ImportError as error:  # Django 5.2 without the backport
    raise ImproperlyConfigured(
        "django_skipqueue.backends needs django.tasks (Django 6.0 or newer) or, on Django "
        "5.2, the django-tasks backport: pip install 'django-skipqueue[django-tasks]'"
    ) from error

from django_skipqueue.conf import get_settings
from django_skipqueue.core.compat import build_unvalidated, set_on_frozen
from django_skipqueue.core.retry import RetryPolicy
from django_skipqueue.exceptions import (
    ConfigurationError,
    InvalidJobError,
    NotJSONError,
    UnknownTaskError,
)
from django_skipqueue.tasks import signal_handlers
from django_skipqueue.tasks.base import Signature, bind_schedules
from django_skipqueue.tasks.base import Task as SkipQueueTask
from django_skipqueue.tasks.registry import registry

if TYPE_CHECKING:
    from django_skipqueue.models import Job

STATUSES = {
    "pending": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "done": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
    # Published to RabbitMQ (a relayed queue with RESULTS): queued there, or running.
    "relayed": TaskResultStatus.READY,
    # A workflow's job waiting on its parents: not due yet.
    "waiting": TaskResultStatus.READY,
}
#: The most attempts a TaskResult names a worker for (a row another client wrote may
#: claim two billion attempts: the list would take gigabytes).
WORKER_IDS_SHOWN = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class Task(DjangoTask):
    """Django's Task with our options: `@task(max_attempts=3, lease=60)` under this backend
    (Django 6.1's `@task` and the backport's, or `django_skipqueue.backends.task` on every
    version)."""

    max_attempts: int | None = None
    lease: float | None = None  # seconds
    retry: RetryPolicy | None = None
    timeout: float | None = None  # seconds
    #: Periodic schedules: a cron expression, a Cron, or a list of them.
    schedule: Any = None
    #: Unique jobs: a string, parameter names, or a function of the call's arguments.
    unique_key: Any = None
    on_conflict: str = "existing"
    #: Flow control: jobs sharing the key run at most `concurrency_limit` at a time.
    concurrency_key: Any = None
    concurrency_limit: int = 1
    #: The hard time limit in seconds (`timeout` is its older name) and the soft one:
    #: see docs/reference/tasks.md (Django's TaskContext has no `time_left`).
    time_limit: float | None = None
    soft_time_limit: float | None = None
    #: A job not started this many seconds after its enqueue never runs.
    expires: float | None = None
    #: At most this many starts per period across every worker: "10/s", "100/m".
    rate_limit: str | None = None
    #: The rate limit per value of this key (as `concurrency_key`): per tenant, say.
    rate_key: Any = None
    #: Fair share in a fair queue: the key its jobs share the workers by, and their weight.
    fair_key: Any = None
    fair_weight: int = 1
    #: Debounce or throttle: calls of one key join one pending job (seconds).
    debounce: float | None = None
    debounce_max_wait: float | None = None
    debounce_key: Any = None
    throttle: float | None = None
    throttle_key: Any = None
    #: Strict order per key: one at a time, in enqueue order; "hold" or "skip" a failure.
    ordered_key: Any = None
    order_failed: str = "hold"

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A signature of this call, a step of a workflow (chain, group, chord): it
        receives its parent's result as its first argument, after its context if it
        takes one (docs/howto/workflows.md)."""
        backend: Any = self.get_backend()  # a SkipQueueBackend: task_class is this class
        return backend.signature(self, args, kwargs)  # type: ignore[no-any-return,unused-ignore]

    def si(self, *args: Any, **kwargs: Any) -> Signature:
        """An immutable signature: a step that does not receive its parent's result."""
        backend: Any = self.get_backend()
        return backend.signature(self, args, kwargs, immutable=True)  # type: ignore[no-any-return,unused-ignore]


#: The options our Task adds to Django's.
OUR_OPTIONS = tuple(
    field.name for field in fields(Task) if field.name not in {f.name for f in fields(DjangoTask)}
)


class InvalidTaskArguments(InvalidTask, TypeError):  # noqa: N818  (named like InvalidTask)
    """Arguments of a type JSON cannot hold: Django's InvalidTask, and the TypeError that
    Django documents for them, so that either `except` catches it."""


def _hard_limit(task: DjangoTask) -> Any:  # seconds; the Task makes it a timedelta
    """A task's `time_limit`, or `timeout`, its older name (not both)."""
    limit, older = getattr(task, "time_limit", None), getattr(task, "timeout", None)
    if limit is not None and older is not None:
        raise ConfigurationError(f"{task.module_path} has time_limit and timeout: keep one")
    return limit if limit is not None else older


def _stand_in(name: str) -> Callable[..., Any]:
    """A function named like the task `name` (for `module_path`), raising
    UnknownTaskError when called."""

    def unknown(*args: Any, **kwargs: Any) -> Any:
        raise UnknownTaskError(name)

    module, _, qualname = name.rpartition(".")
    unknown.__module__, unknown.__qualname__, unknown.__name__ = module, qualname, qualname
    return unknown


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
    `retry`, `timeout`) to the backend's task class, as does the django-tasks backport's;
    Django 6.0's refuses them. This one takes them on all three. Used with a backend other
    than SkipQueueBackend, our options raise a TypeError naming them and the backend.
    """
    from django_skipqueue.core.tasks_api import task_backends

    def wrapper(func: Callable[..., Any]) -> Any:
        task_class = task_backends[backend].task_class
        ours = set(OUR_OPTIONS)
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

    def check(self, **kwargs: Any) -> list[CheckMessage]:
        """skipqueue.E008: the app must be installed (its table, migrations, task
        discovery and checks). Django runs this through django.tasks' own check (the
        backport through its app's, when 'django_tasks' is in INSTALLED_APPS)."""
        messages = list(super().check(**kwargs))
        if not apps.is_installed("django_skipqueue"):
            messages.append(
                Error(
                    f"TASKS[{self.alias!r}] uses SkipQueueBackend, but 'django_skipqueue' "
                    f"is not in INSTALLED_APPS.",
                    hint="Add 'django_skipqueue' to INSTALLED_APPS, then run migrate: the "
                    "app holds the job table and finds your tasks.",
                    id="skipqueue.E008",
                )
            )
        return messages

    def validate_task(self, task: DjangoTask) -> None:
        """Django's checks, then register the task so that workers can run it by name.

        A task that workers would not find is refused: one defined, after start-up, in a
        module that is neither an installed app's `tasks` module nor in
        SKIPQUEUE['TASK_MODULES'] (see `TaskRegistry.check_discoverable`).
        """
        super().validate_task(task)
        native = self._native(task)
        registry.register(native)
        signal_handlers.connect()  # Django's task_started and task_finished for its jobs
        try:
            registry.check_discoverable(native.name)
        except ConfigurationError as error:
            raise InvalidTask(str(error)) from error

    def _native(self, task: DjangoTask) -> SkipQueueTask[Any, Any]:
        try:
            native = SkipQueueTask(
                func=task.func,
                name=task.module_path,
                queue_name=task.queue_name,
                priority=task.priority,
                takes_context=task.takes_context,
                max_attempts=getattr(task, "max_attempts", None),
                lease=getattr(task, "lease", None),
                retry=getattr(task, "retry", None),
                timeout=_hard_limit(task),
                soft_time_limit=getattr(task, "soft_time_limit", None),
                expires=getattr(task, "expires", None),
                rate_limit=getattr(task, "rate_limit", None),
                rate_key=getattr(task, "rate_key", None),
                fair_key=getattr(task, "fair_key", None),
                fair_weight=getattr(task, "fair_weight", 1),
                debounce=_seconds(getattr(task, "debounce", None)),
                debounce_max_wait=_seconds(getattr(task, "debounce_max_wait", None)),
                debounce_key=getattr(task, "debounce_key", None),
                throttle=_seconds(getattr(task, "throttle", None)),
                throttle_key=getattr(task, "throttle_key", None),
                ordered_key=getattr(task, "ordered_key", None),
                order_failed=getattr(task, "order_failed", "hold"),
                django_task=task,
                unique_key=getattr(task, "unique_key", None),
                on_conflict=getattr(task, "on_conflict", "existing"),
                concurrency_key=getattr(task, "concurrency_key", None),
                concurrency_limit=getattr(task, "concurrency_limit", 1),
            )
            schedule = getattr(task, "schedule", None)
            if schedule is not None:
                native = dataclasses.replace(native, schedules=bind_schedules(native, schedule))
            return native
        except (InvalidJobError, ConfigurationError) as error:
            raise InvalidTask(str(error)) from error

    def signature(
        self, task: DjangoTask, args: Any, kwargs: Any, *, immutable: bool = False
    ) -> Signature:
        """A workflow step of a django.tasks Task (its `.s()` and `.si()`): the same job
        an `enqueue()` of it writes, as a member of a chain, group or chord."""
        return Signature(self._native_call(task), tuple(args), dict(kwargs), immutable=immutable)

    def _native_call(self, task: DjangoTask) -> SkipQueueTask[Any, Any]:
        """Our Task for one call of `task`: validated, with its run_after."""
        self.validate_task(task)
        native = self._native(task)
        if task.run_after is not None:
            native = native.using(run_after=task.run_after)
        return native

    def enqueue(self, task: DjangoTask, args: Any, kwargs: Any) -> TaskResult:
        """INSERT a Job in the caller's transaction; returns its READY TaskResult."""
        native = self._native_call(task)
        try:
            job = native.enqueue(*args, **kwargs)
        except NotJSONError as error:  # Django's words (normalize_json's), then ours
            raise InvalidTaskArguments(f"Unsupported type: {error.kind} ({error})") from error
        except (InvalidJobError, ConfigurationError) as error:
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
        return self.result_from_job(job)

    def task_of(self, job: Job) -> DjangoTask:
        """The django.tasks Task of a job, with the job's own options, not those of the
        last `.using()` in this process: its priority, queue, `run_after` (the row's
        run_at when later than its enqueue) and this backend.

        A job whose task is not a django.tasks Task registered here (another process's
        task, or one of django-skipqueue's own @task) gets a stand-in whose function
        raises UnknownTaskError and whose `module_path` is the job's task name.
        """
        known = registry.get(job.task) if job.task in registry else None
        base = known.django_task if known is not None else None
        func = base.func if base is not None else _stand_in(job.task)
        return build_unvalidated(
            type(base) if base is not None else Task,
            func=func,
            priority=job.priority,
            backend=self.alias,
            queue_name=job.queue_name,
            run_after=job.run_at if job.run_at > job.created_at else None,
            takes_context=base.takes_context if base is not None else False,
            **{name: getattr(base, name, None) for name in OUR_OPTIONS},
        )

    def result_from_job(self, job: Job, task: DjangoTask | None = None) -> TaskResult:
        """A TaskResult that mirrors the job's row; its task is `task_of(job)` unless
        given (enqueue passes the very Task it was called on).

        Arguments another client stored in a shape no call can take (`args` not a JSON
        array, `kwargs` not an object, a number Python cannot load) show as empty: the
        worker fails such a job with the reason, which `errors` then holds.
        """
        if task is None:
            task = self.task_of(job)
        # One entry per attempt; rows claimed before migration 0007 have none for their
        # earlier attempts: those are named by the last worker, as the row knows no other.
        attempts = min(max(job.attempts or 0, 0), WORKER_IDS_SHOWN)
        stored = job.worker_ids if isinstance(job.worker_ids, list) else []
        recorded = [str(name) for name in stored[-attempts:]] if attempts else []
        worker_ids = [str(job.worker_id or "")] * (attempts - len(recorded)) + recorded
        history = job.errors if isinstance(job.errors, list) else []
        result: TaskResult[Any, Any] = TaskResult(
            task=task,
            id=str(job.id),
            status=STATUSES.get(job.state, TaskResultStatus.READY),
            enqueued_at=job.created_at,
            started_at=job.first_started_at or job.started_at,
            finished_at=job.finished_at,
            last_attempted_at=job.started_at,
            args=list(job.args) if isinstance(job.args, list) else [],
            kwargs=dict(job.kwargs) if isinstance(job.kwargs, dict) else {},
            backend=self.alias,
            errors=[
                TaskError(
                    exception_class_path=str(entry.get("type", "")),
                    traceback=str(entry.get("traceback", "")),
                )
                for entry in history
                if isinstance(entry, dict)
            ],
            worker_ids=worker_ids,
        )
        set_on_frozen(result, "_return_value", job.result)
        return result


def _seconds(value: Any) -> Any:
    """A debounce's or throttle's period given in seconds, as the native task takes it
    (its own check refuses anything else, naming the option)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return timedelta(seconds=value)
    return value
