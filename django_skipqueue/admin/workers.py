"""The worker registry's admin: who is alive, who stopped cleanly, who was lost.

Workers (`runworker`), broker consumers (`runworker --broker`) and relays (`relayjobs`)
each keep a row. A row is alive while its heartbeat is recent (WORKER_DEAD_AFTER_SECONDS
on the database's clock); stopped when the process said so on a clean stop (`stopped_at`);
lost when it went silent without saying so (killed, frozen, its host gone).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import (
    Case,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    IntegerField,
    OuterRef,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Now
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _

from django_skipqueue.admin.common import (
    STYLESHEET,
    OwnLookupsOnly,
    ReadOnly,
    _age,
    _when,
    moment,
)
from django_skipqueue.models import Job, WorkerProcess
from django_skipqueue.queue.base import dead_after

ALIVE, STOPPED, LOST = "alive", "stopped", "lost"

#: What each status means, on hover in the list and in the docs (monitoring.md).
STATUS_HELP = {
    ALIVE: _("its heartbeat is recent"),
    STOPPED: _("it stopped cleanly and said so"),
    LOST: _("silent past WORKER_DEAD_AFTER_SECONDS without saying it stopped: killed or frozen"),
}


def with_status(workers: QuerySet[WorkerProcess]) -> QuerySet[WorkerProcess]:
    """Each row's status (alive, stopped, lost) and its heartbeat's age, both on the
    database's clock (`now()` in the query, not the web server's)."""
    return workers.annotate(
        status=Case(
            When(stopped_at__isnull=False, then=Value(STOPPED)),
            When(heartbeat_at__gte=Now() - Value(dead_after()), then=Value(ALIVE)),
            default=Value(LOST),
        ),
        beat_age=ExpressionWrapper(Now() - F("heartbeat_at"), output_field=DurationField()),
        start_age=ExpressionWrapper(Now() - F("started_at"), output_field=DurationField()),
        stop_age=ExpressionWrapper(Now() - F("stopped_at"), output_field=DurationField()),
    )


class WorkerStatusFilter(admin.SimpleListFilter):
    title = _("status")
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            (ALIVE, _("alive")),
            (STOPPED, _("stopped (cleanly)")),
            (LOST, _("lost (killed or silent)")),
        ]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[WorkerProcess]
    ) -> QuerySet[WorkerProcess]:
        value = self.value()
        if value in (ALIVE, STOPPED, LOST):
            return queryset.filter(status=value)  # type: ignore[misc]  # annotated
        if value == "dead":  # the filter's older value: stopped or lost
            return queryset.exclude(status=ALIVE)  # type: ignore[misc]  # annotated
        return queryset


@admin.register(WorkerProcess)
class WorkerProcessAdmin(ReadOnly, OwnLookupsOnly, admin.ModelAdmin):  # pruned by housekeeping
    class Media:
        css = {"all": (STYLESHEET,)}

    # Within 1280 px with the admin's sidebars open (tests/admin/test_admin_browser.py): the
    # heartbeat is an age on the database's clock (the timestamp on hover), the jobs held
    # share a column with the concurrency they are held against, and the start time is
    # on the worker's page.
    list_display = [
        "shown_status",
        "kind",
        "host_and_pid",
        "queue_list",
        "heartbeat",
        "jobs_held",
    ]
    list_display_links = ["host_and_pid"]
    list_filter = [WorkerStatusFilter, "kind"]
    allowed_lookups = frozenset({"status", "kind__exact"})
    readonly_fields = [
        "id",
        "kind",
        "shown_status",
        "hostname",
        "pid",
        "queues",
        "concurrency",
        "started",
        "heartbeat",
        "shown_stopped_at",
        "held_jobs",
    ]
    fields = tuple(readonly_fields)
    shown_stopped_at = moment("stopped_at", _("stopped at"))

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerProcess]:
        """Each row's status and held jobs in the page's one query, not two a row: the
        live ones first, then the lost (what an operator looks for), then the stopped."""
        held = (
            Job.objects.running()
            .filter(worker_id=OuterRef("id"))
            .order_by()
            .values("worker_id")
            .annotate(n=Count("id"))
            .values("n")
        )
        rank = Case(
            When(status=ALIVE, then=Value(0)),
            When(status=LOST, then=Value(1)),
            default=Value(2),
            output_field=IntegerField(),
        )
        return (
            # Not super()'s queryset: it orders by get_ordering() before the annotations.
            with_status(WorkerProcess.objects.all())
            .annotate(held=Coalesce(Subquery(held), 0), rank=rank)
            .order_by(*self.get_ordering(request))
        )

    def get_ordering(self, request: HttpRequest) -> list[Any]:
        return ["rank", "-started_at"]  # the changelist's order; the annotation above

    @admin.display(description=_("status"), ordering="rank")
    def shown_status(self, worker: WorkerProcess) -> str:
        status = worker.status  # type: ignore[attr-defined]  # annotated above
        return format_html(
            '<b class="skipqueue-worker-{}" title="{}">{}</b>',
            status,
            STATUS_HELP[status],
            status,
        )

    @admin.display(description=_("host:pid"), ordering="hostname")
    def host_and_pid(self, worker: WorkerProcess) -> str:
        return format_html(
            '{}:{}<br><small><code title="{}">{}</code></small>',
            worker.hostname,
            worker.pid,
            worker.id,
            str(worker.id)[:8],
        )

    @admin.display(description=_("queues"))
    def queue_list(self, worker: WorkerProcess) -> str:
        return ", ".join(worker.queue_names)

    @admin.display(description=_("heartbeat"), ordering="heartbeat_at")
    def heartbeat(self, worker: WorkerProcess) -> str:
        """How long ago, by the database's clock; a stopped row says when it stopped
        (`mark_stopped` backdates its heartbeat, which would read as silence)."""
        stop_age = worker.stop_age  # type: ignore[attr-defined]  # annotated above
        if stop_age is not None:
            text = _("stopped %(age)s ago") % {"age": _age(stop_age)}
            return format_html('<span title="{}">{}</span>', _when(worker.stopped_at), text)
        age = worker.beat_age  # type: ignore[attr-defined]
        text = _("%(age)s ago") % {"age": _age(age)}
        return format_html('<span title="{}">{}</span>', _when(worker.heartbeat_at), text)

    @admin.display(description=_("started"), ordering="started_at")
    def started(self, worker: WorkerProcess) -> str:
        text = _("%(age)s ago") % {"age": _age(worker.start_age)}  # type: ignore[attr-defined]
        return format_html('<span title="{}">{}</span>', _when(worker.started_at), text)

    @admin.display(description=_("jobs held"), ordering="held")
    def jobs_held(self, worker: WorkerProcess) -> str:
        held = int(worker.held)  # type: ignore[attr-defined]  # annotated above
        return format_html(
            '<span title="{}">{} / {}</span>', _("held / concurrency"), held, worker.concurrency
        )

    @admin.display(description=_("jobs held"))
    def held_jobs(self, worker: WorkerProcess) -> str:
        jobs = Job.objects.running().filter(worker_id=worker.id).order_by("id")[:100]
        return format_html_join(", ", "#{} {}", ((job.id, job.task) for job in jobs)) or "-"
