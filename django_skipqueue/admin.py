"""The admin: read-only jobs and workers, operator actions, and a queue overview.

Rows are never edited here. Actions call the Manager's guarded verbs (retry_now, cancel,
requeue), each with its own permission, in bounded batches, and report how many rows
they changed and how many they skipped. HTML is built only with format_html.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.contrib.admin.exceptions import DisallowedModelAdminLookup
from django.core.paginator import Paginator
from django.db.models import Count, Exists, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _

from django_skipqueue.conf import get_settings
from django_skipqueue.models import Job, JobState, WorkerProcess
from django_skipqueue.redaction import redact
from django_skipqueue.stats import queue_stats, throughput_last_hour

if TYPE_CHECKING:
    from django.utils.functional import _StrPromise

    from django_skipqueue.managers import JobQuerySet

STATE_COLOURS: dict[str, str] = {
    JobState.PENDING: "#6b7280",
    JobState.RUNNING: "#2563eb",
    JobState.DONE: "#16a34a",
    JobState.FAILED: "#dc2626",
    JobState.CANCELLED: "#a16207",
}


class EstimatedCountPaginator(Paginator):
    """Exact counts up to 10,000 rows; above that, the planner's estimate.

    A COUNT(*) over a million-row queue table on every page load is what makes admins
    slow. The capped count stops after 10,001 rows; past it EXPLAIN's row estimate
    (what PostgreSQL keeps from ANALYZE) numbers the pages.
    """

    CAP = 10_000

    @cached_property
    def count(self) -> int:
        queryset = cast("QuerySet[Any]", self.object_list).order_by()
        capped = queryset[: self.CAP + 1].count()
        if capped <= self.CAP:
            return capped
        plan = json.loads(queryset.explain(format="json"))
        return max(int(plan[0]["Plan"]["Plan Rows"]), capped)


class HealthFilter(admin.SimpleListFilter):
    title = _("health")
    parameter_name = "health"

    def lookups(
        self, request: HttpRequest, model_admin: Any
    ) -> list[tuple[str, str | _StrPromise]]:
        return [
            ("stuck", _("stuck (lease expired, not yet reaped)")),
            ("repeatedly_expired", _("repeatedly expired")),
            ("failed", _("failed")),
            ("scheduled", _("scheduled (due later)")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        jobs = cast("JobQuerySet", queryset)  # Job.objects is built from JobQuerySet
        value = self.value()
        if value == "stuck":
            return jobs.expired()
        if value == "repeatedly_expired":
            return jobs.repeatedly_expired(get_settings().REPEATED_EXPIRY_THRESHOLD)
        if value == "failed":
            return jobs.filter(state=JobState.FAILED)
        if value == "scheduled":
            return jobs.scheduled()
        return jobs


class ValuesFilter(admin.SimpleListFilter):
    """Distinct values of a column among unfinished jobs (an index-served set)."""

    field = ""

    def lookups(
        self, request: HttpRequest, model_admin: Any
    ) -> list[tuple[str, str | _StrPromise]]:
        values = (
            Job.objects.filter(state__in=[JobState.PENDING, JobState.RUNNING])
            .values_list(self.field, flat=True)
            .distinct()
            .order_by(self.field)[:100]
        )
        return [(value, value) for value in values]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        return queryset.filter(**{self.field: self.value()}) if self.value() else queryset


class QueueFilter(ValuesFilter):
    title, parameter_name, field = _("queue"), "queue", "queue_name"


class TaskFilter(ValuesFilter):
    title, parameter_name, field = _("task"), "task", "task"


class OwnLookupsOnly:
    """Only the lookups this admin's own filters use reach the ORM from a query string.

    Django's default accepts a lookup on any local field, so a view-only user could
    probe a redacted secret in `?kwargs__password__startswith=...` one character at a
    time, or send `?task__regex=(a` for a 500. Anything else is refused with a 400, and
    so is a query string holding NUL, which PostgreSQL text cannot hold.
    """

    #: The query-string keys of this admin's list filters.
    allowed_lookups: frozenset[str] = frozenset()

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        return lookup in self.allowed_lookups

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        for key, values in request.GET.lists():
            if any("\x00" in text for text in (key, *values)):
                raise DisallowedModelAdminLookup(f"the query string has a NUL in {key!r}")
        return super().changelist_view(request, extra_context)  # type: ignore[misc]


def _entries(history: Any) -> list[dict[str, Any]]:
    """The dict entries of an error history, whatever was stored (never raises)."""
    if not isinstance(history, list):
        return []
    return [entry for entry in history if isinstance(entry, dict)]


def _report(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    verb: str,
    changed: int,
    selected: int,
    why: str,
) -> None:
    skipped = selected - changed
    text = f"{changed} job(s) {verb}"
    if skipped:
        text += f"; {skipped} skipped ({why})"
    model_admin.message_user(request, text, messages.SUCCESS if changed else messages.WARNING)


@admin.register(Job)
class JobAdmin(OwnLookupsOnly, admin.ModelAdmin):
    # HealthFilter, "state", QueueFilter, TaskFilter and the run_at date filter.
    allowed_lookups = frozenset(
        {"health", "state__exact", "queue", "task", "run_at__gte", "run_at__lt"}
    )
    list_display = [
        "id",
        "task",
        "queue_name",
        "coloured_state",
        "attempts_of_max",
        "expirations",
        "run_at",
        "leased_until",
        "worker_id",
        "error_summary",
    ]
    list_filter = [
        HealthFilter,
        "state",
        QueueFilter,
        TaskFilter,
        ("run_at", admin.DateFieldListFilter),
    ]
    search_fields = ["task"]  # see get_search_results: an id, or a task name prefix
    search_help_text = _("A job id, or the start of a task name.")
    ordering = ["-id"]
    # No date_hierarchy: it runs SELECT DISTINCT date_trunc(...) over the whole table on
    # every page (T45: a million rows); the run_at date filter needs no query to draw.
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    list_per_page = 50
    actions = ["retry_now", "cancel", "requeue"]
    readonly_fields = [
        "id",
        "task",
        "queue_name",
        "priority",
        "state",
        "attempts",
        "max_attempts",
        "expirations",
        "releases",
        "run_at",
        "lease",
        "leased_until",
        "created_at",
        "started_at",
        "finished_at",
        "worker_status",
        "pretty_args",
        "pretty_result",
        "timeline",
        "error_history",
    ]
    fieldsets = [
        (None, {"fields": ["id", "task", "queue_name", "priority", "state"]}),
        (
            _("Attempts"),
            {
                "fields": [
                    "attempts",
                    "max_attempts",
                    "expirations",
                    "releases",
                    "lease",
                    "leased_until",
                    "worker_status",
                ]
            },
        ),
        (_("Data"), {"fields": ["pretty_args", "pretty_result"]}),
        (_("History"), {"fields": ["timeline", "error_history"]}),
    ]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Job], search_term: str
    ) -> tuple[QuerySet[Job], bool]:
        """A number finds that job by primary key; text matches task names by prefix.

        Never `OR task ILIKE '%...%'` across the table, which scans every row.
        """
        term = search_term.strip()
        if not term:
            return queryset, False
        if term.isdigit():
            return queryset.filter(id=int(term)), False
        return queryset.filter(task__startswith=term), False

    # -- read-only ---------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        return False

    # -- columns -----------------------------------------------------------------------

    @admin.display(description=_("state"), ordering="state")
    def coloured_state(self, job: Job) -> str:
        return format_html('<b style="color: {}">{}</b>', STATE_COLOURS[job.state], job.state)

    @admin.display(description=_("attempts"))
    def attempts_of_max(self, job: Job) -> str:
        return f"{job.attempts}/{job.max_attempts}"

    @admin.display(description=_("last error"))
    def error_summary(self, job: Job) -> str:
        line = (job.last_error or "").splitlines()[0] if job.last_error else ""
        return line[:100] + ("..." if len(line) > 100 else "")

    @admin.display(description=_("arguments"))
    def pretty_args(self, job: Job) -> str:
        data = redact({"args": job.args, "kwargs": job.kwargs})
        return format_html("<pre>{}</pre>", json.dumps(data, indent=2, ensure_ascii=False))

    @admin.display(description=_("return value"))
    def pretty_result(self, job: Job) -> str:
        if job.result is None:
            return "-"
        return format_html("<pre>{}</pre>", json.dumps(redact(job.result), indent=2))

    @admin.display(description=_("worker"))
    def worker_status(self, job: Job) -> str:
        worker = WorkerProcess.objects.filter(id=job.worker_id).first() if job.worker_id else None
        if worker is None:
            return str(job.worker_id or "-")
        alive = worker.id in set(self._alive_worker_ids())
        return format_html("{} ({})", worker, _("alive") if alive else _("dead"))

    @admin.display(description=_("timeline"))
    def timeline(self, job: Job) -> str:
        events: list[tuple[str, Any]] = [("enqueued", job.created_at)]
        events += [
            (f"attempt {e.get('attempt')}: {e.get('type')}", e.get("at"))
            for e in _entries(job.errors)
        ]
        if job.started_at:
            events.append((f"attempt {job.attempts} started", job.started_at))
        if job.finished_at:
            events.append((f"finished {job.state}", job.finished_at))
        return format_html(
            "<ul>{}</ul>",
            format_html_join("", "<li>{}: {}</li>", ((when, what) for what, when in events)),
        )

    @admin.display(description=_("errors"))
    def error_history(self, job: Job) -> str:
        if not job.errors:
            return "-"
        if not _entries(job.errors):  # written by hand or by another client
            return format_html("<pre>{}</pre>", json.dumps(redact(job.errors), indent=2))
        return format_html_join(
            "",
            "<p><b>attempt {} at {}: {}</b> {}</p><pre>{}</pre>",
            (
                (e.get("attempt"), e.get("at"), e.get("type"), e.get("message"), e.get("traceback"))
                for e in reversed(_entries(job.errors))
            ),
        )

    def _alive_worker_ids(self) -> list[Any]:
        return list(WorkerProcess.objects.alive().values_list("id", flat=True))

    # -- actions -----------------------------------------------------------------------

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("skipqueue.retry_job")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("skipqueue.cancel_job")

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("skipqueue.requeue_job")

    @admin.action(description=_("Retry now (failed or cancelled)"), permissions=["retry"])
    def retry_now(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        ids = list(queryset.values_list("id", flat=True))
        changed = Job.objects.retry_now(ids)
        _report(self, request, "retried", changed, len(ids), "not failed or cancelled")

    @admin.action(description=_("Cancel (pending)"), permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        ids = list(queryset.values_list("id", flat=True))
        changed = Job.objects.cancel(ids)
        _report(self, request, "cancelled", changed, len(ids), "not pending any more")

    @admin.action(description=_("Requeue (stuck)"), permissions=["requeue"])
    def requeue(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        ids = list(queryset.values_list("id", flat=True))
        changed = Job.objects.requeue(ids)
        _report(
            self,
            request,
            "requeued",
            changed,
            len(ids),
            "not stuck: running with a live lease, or finished",
        )

    # -- the queue overview ------------------------------------------------------------

    def get_urls(self) -> list[Any]:
        overview = self.admin_site.admin_view(self.overview_view)
        return [path("overview/", overview, name="skipqueue_overview"), *super().get_urls()]

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            from django.core.exceptions import PermissionDenied

            raise PermissionDenied
        buckets = throughput_last_hour()
        peak = max((count for _, count in buckets), default=0) or 1
        bars = []
        for index, (minutes, count) in enumerate(buckets):
            height = round(count / peak * 100)
            bars.append(
                {
                    "x": index * 40 + 10,
                    "y": 110 - height,
                    "height": height,
                    "count": count,
                    "label": f"-{minutes}m",
                }
            )
        context = {
            **self.admin_site.each_context(request),
            "title": _("Queue overview"),
            "queues": queue_stats(),
            "bars": bars,
            "opts": self.model._meta,
        }
        return TemplateResponse(request, "admin/skipqueue/overview.html", context)


@admin.register(WorkerProcess)
class WorkerProcessAdmin(OwnLookupsOnly, admin.ModelAdmin):
    list_display = [
        "id",
        "hostname",
        "pid",
        "queue_list",
        "concurrency",
        "started_at",
        "heartbeat_at",
        "is_alive",
        "jobs_held",
    ]
    ordering = ["-started_at"]
    readonly_fields = [
        "id",
        "hostname",
        "pid",
        "queues",
        "concurrency",
        "started_at",
        "heartbeat_at",
        "held_jobs",
    ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # read-only: dead workers' rows are pruned by the housekeeper

    @admin.display(description=_("queues"))
    def queue_list(self, worker: WorkerProcess) -> str:
        return ", ".join(worker.queues or [])

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerProcess]:
        """Each row's liveness and held jobs in the page's one query, not two a row."""
        alive = WorkerProcess.objects.alive().filter(id=OuterRef("id"))
        held = (
            Job.objects.running()
            .filter(worker_id=OuterRef("id"))
            .order_by()
            .values("worker_id")
            .annotate(n=Count("id"))
            .values("n")
        )
        return (
            super()
            .get_queryset(request)
            .annotate(alive=Exists(alive), held=Coalesce(Subquery(held), 0))
        )

    @admin.display(description=_("alive"), boolean=True, ordering="alive")
    def is_alive(self, worker: WorkerProcess) -> bool:
        return bool(worker.alive)  # type: ignore[attr-defined]  # annotated above

    @admin.display(description=_("jobs held"), ordering="held")
    def jobs_held(self, worker: WorkerProcess) -> int:
        return int(worker.held)  # type: ignore[attr-defined]  # annotated above

    @admin.display(description=_("jobs held"))
    def held_jobs(self, worker: WorkerProcess) -> str:
        jobs = Job.objects.running().filter(worker_id=worker.id).order_by("id")[:100]
        return format_html_join(", ", "#{} {}", ((job.id, job.task) for job in jobs)) or "-"
