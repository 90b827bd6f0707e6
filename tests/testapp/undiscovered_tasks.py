"""Tasks in a module that workers never import (not tasks.py, not in TASK_MODULES).

Imported only by tests, after start-up: each task here must be refused.
"""

from __future__ import annotations

from django_skipqueue import task


@task
def late_native() -> None:
    pass
