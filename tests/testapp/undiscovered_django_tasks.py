"""A django.tasks Task in a module that workers never import; importing it must fail."""

from __future__ import annotations

from django_skipqueue.core.tasks_api import task


@task
def late_django() -> None:
    pass
