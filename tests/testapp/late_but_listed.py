"""A task module named in SKIPQUEUE['TASK_MODULES'] by one test only."""

from __future__ import annotations

from django_skipqueue import task


@task
def listed() -> None:
    pass
