"""The admin: read-only jobs and workers, operator actions, a queue and a task overview.

Rows are never edited here. Actions call the Manager's guarded verbs (retry_now, cancel,
requeue), each with its own permission, in bounded batches, and report how many rows
they changed and how many they skipped. HTML is built only with format_html.
"""

from __future__ import annotations

from django_skipqueue.admin.common import STYLESHEET, OwnLookupsOnly
from django_skipqueue.admin.jobs import JobAdmin
from django_skipqueue.admin.queues import QueueOverviewAdmin, QueueOverviewViews, trend_charts
from django_skipqueue.admin.schedules import ScheduleAdmin
from django_skipqueue.admin.tasks import TaskOverviewAdmin
from django_skipqueue.admin.workers import WorkerProcessAdmin
from django_skipqueue.admin.workflows import WorkflowAdmin

__all__ = [
    "STYLESHEET",
    "JobAdmin",
    "OwnLookupsOnly",
    "QueueOverviewAdmin",
    "QueueOverviewViews",
    "ScheduleAdmin",
    "TaskOverviewAdmin",
    "WorkerProcessAdmin",
    "WorkflowAdmin",
    "trend_charts",
]
