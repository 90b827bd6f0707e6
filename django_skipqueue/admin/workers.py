"""The worker registry's admin: live and dead workers, and the jobs each holds."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Count, Exists, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import (
    HttpRequest,
)
from django.utils.html import format_html_join
from django.utils.translation import gettext_lazy as _

from django_skipqueue.admin.common import (
    STYLESHEET,
    AliveFilter,
    OwnLookupsOnly,
    ReadOnly,
)
from django_skipqueue.models import (
    Job,
    WorkerProcess,
)


@admin.register(WorkerProcess)
class WorkerProcessAdmin(ReadOnly, OwnLookupsOnly, admin.ModelAdmin):  # pruned by housekeeping
    class Media:
        css = {"all": (STYLESHEET,)}

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
    list_filter = [AliveFilter]
    allowed_lookups = frozenset({"status"})
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

    @admin.display(description=_("queues"))
    def queue_list(self, worker: WorkerProcess) -> str:
        return ", ".join(worker.queue_names)

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
            .order_by("-alive", "-started_at")  # the live ones first; the dead pile below
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
