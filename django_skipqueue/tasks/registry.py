"""The process-wide task registry: the only way a job's name becomes code to run.

A worker never imports a path read from a row; a name it does not find here is an
unknown task (the job fails that attempt with a clear error).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from importlib import import_module
from typing import Any, Generic, Protocol, TypeVar

from django.apps import apps
from django.utils.module_loading import autodiscover_modules

from django_skipqueue.exceptions import ConfigurationError, UnknownTaskError

logger = logging.getLogger(__name__)


class Registrable(Protocol):
    """What the registry needs of a task (`tasks.base.Task` is one); it does not import
    the Task class, which registers itself here."""

    @property
    def name(self) -> str: ...
    @property
    def func(self) -> Callable[..., Any]: ...


T = TypeVar("T", bound=Registrable)


class TaskRegistry(Generic[T]):
    """Registered tasks by name. Safe to read from many threads."""

    def __init__(self) -> None:
        self._tasks: dict[str, T] = {}
        self._lock = threading.Lock()
        #: The modules that autodiscover() imports in every process, workers included.
        self.discovered_modules: frozenset[str] = frozenset()
        #: Tasks registered after start-up from a module not in discovered_modules.
        self._undiscoverable: dict[str, str] = {}
        #: SKIPQUEUE['TASK_MODULES'] entries that failed to import, with the error: a
        #: system check reports them (skipqueue.E009), so that one typo does not break
        #: every manage.py command with a traceback.
        self.import_errors: dict[str, str] = {}

    def register(self, task: T) -> None:
        """Add `task`; a second, different function under the same name is an error.

        The same function registered again (a django.tasks `.using()` copy) keeps the
        first registration; a module imported again (a reload) replaces it.
        """
        with self._lock:
            existing = self._tasks.get(task.name)
            if existing is not None and not _same_function(existing.func, task.func):
                raise ConfigurationError(
                    f"two tasks are named {task.name!r}: "
                    f"{_where(existing.func)} and {_where(task.func)}; give one a name= of its own"
                )
            if existing is not None and existing.func is task.func:
                return
            self._tasks[task.name] = task
            module = task.func.__module__
            if apps.ready and module not in self.discovered_modules:
                self._undiscoverable[task.name] = module
            else:
                self._undiscoverable.pop(task.name, None)

    def check_discoverable(self, name: str) -> None:
        """Refuse a task that workers would not find (ConfigurationError).

        A worker knows the tasks registered while Django starts (the apps' modules and
        their `ready()`) and those of the modules autodiscover() imports: each installed
        app's `tasks` module and SKIPQUEUE['TASK_MODULES']. A task registered later from
        another module (a view, a script, the shell) is unknown to every worker: its job
        would fail every attempt.
        """
        module = self._undiscoverable.get(name)
        if module is not None:
            raise ConfigurationError(
                f"task {name!r} is defined in {module!r}, which workers do not import: they "
                f"import the tasks module of each installed app and the modules in "
                f"SKIPQUEUE['TASK_MODULES']. Move it into an app's tasks.py, or add "
                f"{module!r} to SKIPQUEUE['TASK_MODULES']"
            )

    def get(self, name: str) -> T:
        try:
            return self._tasks[name]
        except KeyError:
            raise UnknownTaskError(name) from None

    def __contains__(self, name: object) -> bool:
        return name in self._tasks

    def names(self) -> list[str]:
        return sorted(self._tasks)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._tasks.pop(name, None)
            self._undiscoverable.pop(name, None)


def _same_function(a: Any, b: Any) -> bool:
    # A module imported again (a reload) re-registers its tasks with new function objects.
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def _where(func: Any) -> str:
    return f"{func.__module__}.{func.__qualname__}"


#: The process's tasks (`tasks.base.Task` instances, registered by `@task`).
registry: TaskRegistry[Any] = TaskRegistry()


def autodiscover() -> None:
    """Import each installed app's `tasks` module, then SKIPQUEUE['TASK_MODULES']."""
    from django_skipqueue.conf import get_settings

    modules = {f"{config.name}.tasks" for config in apps.get_app_configs()}
    registry.discovered_modules = frozenset(modules | set(get_settings().TASK_MODULES))
    autodiscover_modules("tasks")
    registry.import_errors = {}
    for module in get_settings().TASK_MODULES:
        try:
            import_module(module)  # a module path from settings, never from a job row
        except ImportError as error:
            registry.import_errors[module] = f"{type(error).__name__}: {error}"
            logger.error("SKIPQUEUE['TASK_MODULES'] names %r, which cannot be imported: %s",
                         module, error)  # fmt: skip
