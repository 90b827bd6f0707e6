"""The schedules' admin: read-only, pause and resume under their own permission."""

from __future__ import annotations

from urllib.parse import quote

from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import (
    HttpRequest,
)
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _

from django_skipqueue.admin.common import (
    STYLESHEET,
    OwnLookupsOnly,
    ReadOnly,
    _report,
    _when,
    arguments_html,
)
from django_skipqueue.core.cron import Cron
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.maintenance.scheduler import defined_schedules
from django_skipqueue.models import (
    Job,
    Schedule,
)


@admin.register(Schedule)
class ScheduleAdmin(ReadOnly, OwnLookupsOnly, admin.ModelAdmin):
    """The periodic schedules, read-only (their definitions live in code), with their
    next occurrence and the jobs of their latest ones. Pausing takes its own permission
    (skipqueue.pause_schedule)."""

    class Media:
        css = {"all": (STYLESHEET,)}

    list_display = ["name", "task", "expression", "timezone", "status", "last_run", "next_run"]
    list_filter = [("paused_at", admin.EmptyFieldListFilter)]
    allowed_lookups = frozenset({"paused_at__isempty"})
    search_fields = ["name", "task"]
    actions = ["pause", "resume"]
    readonly_fields = [
        "name",
        "task",
        "expression",
        "timezone",
        "pretty_args",
        "queue_name",
        "priority",
        "missed",
        "catch_up",
        "grace",
        "status",
        "last_run",
        "next_run",
        "recent_jobs",
        "created_at",
        "synced_at",
    ]
    fields = tuple(readonly_fields)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("skipqueue.pause_schedule")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Schedule]:
        """Each row with the database's now, from which its next occurrence is found."""
        return super().get_queryset(request).annotate(db_now=Now())

    @admin.display(description=_("state"), ordering="paused_at")
    def status(self, schedule: Schedule) -> str:
        if schedule.is_paused:
            by = f" by {schedule.paused_by}" if schedule.paused_by else ""
            return format_html(
                '<b class="skipqueue-warn">{}</b> <small>{}{}</small>',
                _("paused"),
                _when(schedule.paused_at),
                by,
            )
        if schedule.name not in _defined_names():
            return format_html('<span class="skipqueue-error">{}</span>', _("not in this code"))
        return str(_("active"))

    @admin.display(description=_("last occurrence"), ordering="last_occurrence_at")
    def last_run(self, schedule: Schedule) -> str:
        return _when(schedule.last_occurrence_at)

    @admin.display(description=_("next occurrence"))
    def next_run(self, schedule: Schedule) -> str:
        if schedule.is_paused:
            return "-"
        try:
            cron = Cron(expression=schedule.expression, timezone=schedule.timezone)
        except ConfigurationError:
            return "-"
        now = schedule.db_now  # type: ignore[attr-defined]  # annotated above
        zone = cron.zone(schedule.timezone)
        upcoming = cron.next_after(now, zone)
        return format_html(
            '{}<br><span class="help">{}</span>', _when(upcoming), cron.describe_upcoming(now, zone)
        )

    @admin.display(description=_("arguments"))
    def pretty_args(self, schedule: Schedule) -> str:
        return arguments_html(schedule.args, schedule.kwargs)

    @admin.display(description=_("latest jobs"))
    def recent_jobs(self, schedule: Schedule) -> str:
        jobs = Job.objects.filter(schedule=schedule.name).order_by("-scheduled_for")[:10]
        rows = format_html_join(
            "",
            '<li><a href="{}">#{}</a> {} · {}</li>',
            (
                (
                    reverse("admin:skipqueue_job_change", args=[job.id]),
                    job.id,
                    _when(job.scheduled_for),
                    job.state,
                )
                for job in jobs
            ),
        )
        every = reverse("admin:skipqueue_job_changelist") + f"?schedule={quote(schedule.name)}"
        return format_html('<ul>{}</ul><a href="{}">{}</a>', rows, every, _("all its jobs"))

    @admin.action(description=_("Pause"), permissions=["pause"])
    def pause(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        names = list(queryset.values_list("name", flat=True))
        changed = Schedule.objects.pause(names, by=request.user.get_username())
        _report(self, request, "paused", changed, len(names), "already paused", "schedule(s)")

    @admin.action(description=_("Resume from now"), permissions=["pause"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        names = list(queryset.values_list("name", flat=True))
        changed = Schedule.objects.resume(names)
        _report(self, request, "resumed", changed, len(names), "not paused", "schedule(s)")


def _defined_names() -> set[str]:
    """The schedules this process's code defines (empty if they cannot be read)."""
    try:
        return set(defined_schedules())
    except ConfigurationError:
        return set()
