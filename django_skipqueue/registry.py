"""The process-wide task registry: the only way a job's name becomes code to run.

A worker never imports a path read from a row; a name it does not find here is an
unknown task (the job fails that attempt with a clear error).
"""

from __future__ import annotations

import threading
from importlib import import_module
from typing import TYPE_CHECKING, Any

from django.utils.module_loading import autodiscover_modules

from django_skipqueue.exceptions import ConfigurationError, UnknownTaskError

if TYPE_CHECKING:
    from django_skipqueue.base import Task


class TaskRegistry:
    """Registered tasks by name. Safe to read from many threads."""

    def __init__(self) -> None:
        self._tasks: dict[str, Task[Any, Any]] = {}
        self._lock = threading.Lock()

    def register(self, task: Task[Any, Any]) -> None:
        """Add `task`; a second, different function under the same name is an error."""
        with self._lock:
            existing = self._tasks.get(task.name)
            if existing is not None and not _same_function(existing.func, task.func):
                raise ConfigurationError(
                    f"two tasks are named {task.name!r}: "
                    f"{_where(existing.func)} and {_where(task.func)}; give one a name= of its own"
                )
            self._tasks[task.name] = task

    def get(self, name: str) -> Task[Any, Any]:
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


def _same_function(a: Any, b: Any) -> bool:
    # A module imported again (a reload) re-registers its tasks with new function objects.
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def _where(func: Any) -> str:
    return f"{func.__module__}.{func.__qualname__}"


registry = TaskRegistry()


def autodiscover() -> None:
    """Import each installed app's `tasks` module, then SKIPQUEUE['TASK_MODULES']."""
    from django_skipqueue.conf import get_settings

    autodiscover_modules("tasks")
    for module in get_settings().TASK_MODULES:
        import_module(module)  # a module path from settings, never from a job row
