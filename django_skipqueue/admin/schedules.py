"""The schedules' admin: read-only, pause and resume under their own permission."""

from __future__ import annotations

from datetime import datetime, tzinfo
from typing import Any
from urllib.parse import quote

from django.conf import settings
from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import (
    HttpRequest,
)
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.translation import gettext_lazy as _

from django_skipqueue.admin.common import (
    STYLESHEET,
    OwnLookupsOnly,
    PayloadGate,
    ReadOnly,
    _report,
    _when,
    arguments_html,
    moment,
)
from django_skipqueue.core.cron import Cron, zone_of
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.maintenance.scheduler import defined_schedules
from django_skipqueue.models import (
    Job,
    Schedule,
)


class ScheduleStatusFilter(admin.SimpleListFilter):
    """Active or paused, in those words (Django's empty-field filter said "By paused at:
    Empty / Not empty")."""

    title = _("status")
    parameter_name = "status"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, Any]]:
        return [("active", _("Active")), ("paused", _("Paused"))]

    def queryset(self, request: Any, queryset: QuerySet[Schedule]) -> QuerySet[Schedule]:
        if self.value() == "active":
            return queryset.filter(paused_at__isnull=True)
        if self.value() == "paused":
            return queryset.filter(paused_at__isnull=False)
        return queryset


@admin.register(Schedule)
class ScheduleAdmin(PayloadGate, ReadOnly, OwnLookupsOnly, admin.ModelAdmin):
    """The periodic schedules, read-only (their definitions live in code), with their
    next occurrence and the jobs of their latest ones. Pausing takes its own permission
    (skipqueue.pause_schedule)."""

    class Media:
        css = {"all": (STYLESHEET,)}

    # Within 1280 px with the admin's sidebars open (tests/admin/test_admin_browser.py): the
    # task path is cut (whole on hover), and one column holds the last run and the next
    # three, one a line, with the zone they are shown in.
    list_display = ["name", "shown_task", "shown_expression", "status", "next_runs"]
    list_filter = [ScheduleStatusFilter]
    allowed_lookups = frozenset({"status"})
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
        "next_runs",
        "recent_jobs",
        "shown_created_at",
        "shown_synced_at",
    ]
    fields = tuple(readonly_fields)
    shown_created_at = moment("created_at", _("created at"))
    shown_synced_at = moment("synced_at", _("synced at"))

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

    @admin.display(description=_("task"), ordering="task")
    def shown_task(self, schedule: Schedule) -> str:
        module, _dot, name = schedule.task.rpartition(".")
        return format_html(
            '<span class="skipqueue-cut" title="{}"><b>{}</b><br><small>{}</small></span>',
            schedule.task,
            name,
            module,
        )

    @admin.display(description=_("expression"), ordering="expression")
    def shown_expression(self, schedule: Schedule) -> str:
        return format_html('<code class="skipqueue-nowrap">{}</code>', schedule.expression)

    @admin.display(
        description=_("last occurrence (in the schedule's time zone)"),
        ordering="last_occurrence_at",
    )
    def last_run(self, schedule: Schedule) -> str:
        if schedule.last_occurrence_at is None:
            return "-"
        zone = _zone(schedule)
        if zone is None:
            return _when(schedule.last_occurrence_at)
        return _in_zone(schedule.last_occurrence_at, zone)

    @admin.display(
        description=_("last and next runs (in the schedule's time zone)"),
        ordering="last_occurrence_at",
    )
    def next_runs(self, schedule: Schedule) -> str:
        """The last run and the next three in the schedule's own zone (the one its
        expression is read in), one a line, then the zone and the cadence in words
        (Cron.upcoming_words: the parts of the sentence `manage.py schedules` prints)."""
        last = format_html(
            '<small class="skipqueue-runs-label">{}</small> {}', _("last"), self.last_run(schedule)
        )
        if schedule.is_paused:
            return format_html("{}<br>{}", last, _("paused: no next run"))
        try:
            cron = Cron(expression=schedule.expression, timezone=schedule.timezone)
            zone = cron.zone(settings.TIME_ZONE)
        except ConfigurationError:
            return last
        now = schedule.db_now  # type: ignore[attr-defined]  # annotated above
        shown, cadence = cron.upcoming_words(now, zone)
        if not shown:
            return format_html("{}<br>{}", last, _("no run within ten years"))
        return format_html(
            '{}<br><small class="skipqueue-runs-label">{}</small> '
            '<span class="skipqueue-runs" title="{}">{}</span><br><small>{}</small>',
            last,
            _("next"),
            cron.describe_upcoming(now, zone),
            format_html_join(mark_safe("<br>"), "{}", ((when,) for when in shown)),
            " · ".join(part for part in (str(zone), cadence) if part),
        )

    @admin.display(description=_("arguments"))
    def pretty_args(self, schedule: Schedule) -> str:
        return arguments_html(schedule.args, schedule.kwargs, schedule.task)

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


def _zone(schedule: Schedule) -> tzinfo | None:
    try:
        return zone_of(schedule.timezone or settings.TIME_ZONE)
    except ConfigurationError:
        return None


def _in_zone(moment: datetime, zone: tzinfo) -> str:
    """A time as the next runs are shown: in the schedule's zone, to the second."""
    return moment.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S")


def _defined_names() -> set[str]:
    """The schedules this process's code defines (empty if they cannot be read)."""
    try:
        return set(defined_schedules())
    except ConfigurationError:
        return set()
