"""The task overview: per task, what its attempts did in the last hour and day (runs,
failures, retries, p50 and p95 run time) and its newest error, what Flower's task list
gives a Celery team. It reads the per-minute rows the workers write (TaskMinute), never
the job table: the page costs the same at ten thousand jobs and at ten million."""

from __future__ import annotations

from typing import Any

import django
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext_lazy as _

from django_skipqueue.admin import charts
from django_skipqueue.admin.common import (
    PAYLOAD_PERMISSION,
    OnePage,
    OwnLookupsOnly,
    ReadOnly,
    _age,
    error_class,
)
from django_skipqueue.models import TaskOverview
from django_skipqueue.stats import TaskStats, TaskWindow, task_stats
from django_skipqueue.tasks.registry import registry

#: The page's orders (`?o=`): a key of a TaskStats, and whether the largest come first.
ORDERS: dict[str, tuple[Any, bool]] = {
    "task": (lambda row: row.task, False),
    "runs": (lambda row: row.day.runs, True),
    "failed": (lambda row: (row.day.failed, row.day.retried), True),
    "p95": (lambda row: row.day.duration(0.95) or 0.0, True),
}


def run_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return "< 1 ms" if seconds < 0.001 else charts.duration(seconds)


def window_cells(window: TaskWindow) -> dict[str, Any]:
    """One window's numbers as the page shows them."""
    return {
        "runs": window.runs,
        "failed": window.failed,
        "retried": window.retried,
        "p50": run_time(window.duration(0.5)),
        "p95": run_time(window.duration(0.95)),
        "rate": "" if window.failure_rate is None else charts.percent(window.failure_rate),
    }


def task_rows(stats: list[TaskStats], payloads: bool) -> list[dict[str, Any]]:
    """Each task's row: its windows' cells and its newest error, whose message only a
    user with PAYLOAD_PERMISSION sees (others see its class)."""
    rows = []
    for row in stats:
        error = row.last_error if payloads else (row.last_error and error_class(row.last_error))
        rows.append(
            {
                "task": row.task,
                "registered": row.task in registry,
                "windows": [window_cells(row.hour), window_cells(row.day)],
                "error": error,
                "error_job": row.last_error_job,
                "error_ago": _age(row.last_error_age) if row.last_error_age is not None else "",
            }
        )
    return rows


@admin.register(TaskOverview)
class TaskOverviewAdmin(OnePage, ReadOnly, OwnLookupsOnly, admin.ModelAdmin):
    """The admin index's "Task overview" entry: its one page (OnePage)."""

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        order = request.GET.get("o", "task")
        if order not in ORDERS:
            order = "task"
        stats = task_stats()
        counted = {row.task for row in stats}
        # A registered task that ran nothing in the day is listed too, with zeros.
        stats += [
            TaskStats(name, TaskWindow(), TaskWindow())
            for name in registry.names()
            if name not in counted
        ]
        key, largest_first = ORDERS[order]
        stats.sort(key=lambda row: row.task)
        stats.sort(key=key, reverse=largest_first)
        context = {
            **self.admin_site.each_context(request),
            "title": _("Task overview"),
            "tasks": task_rows(stats, request.user.has_perm(PAYLOAD_PERMISSION)),
            "order": order,
            "opts": self.model._meta,
            "breadcrumbs_as_list": django.VERSION >= (6, 1),  # Django 6.1's admin markup
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/skipqueue/tasks.html", context)
