"""The admin: read-only jobs and workers, operator actions, and a queue overview.

Rows are never edited here. Actions call the Manager's guarded verbs (retry_now, cancel,
requeue), each with its own permission, in bounded batches, and report how many rows
they changed and how many they skipped. HTML is built only with format_html.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import quote, unquote

import django
from django.contrib import admin, messages
from django.contrib.admin.exceptions import DisallowedModelAdminLookup
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Count, Exists, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce, Now
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseNotAllowed,
)
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _

from django_skipqueue.conf import get_settings
from django_skipqueue.exceptions import ConfigurationError, InvalidJobError
from django_skipqueue.models import (
    Job,
    JobState,
    Queue,
    QueueOverview,
    Schedule,
    WorkerProcess,
)
from django_skipqueue.redaction import redact, redact_key, redact_text
from django_skipqueue.registry import registry
from django_skipqueue.scheduler import defined_schedules
from django_skipqueue.schedules import Cron
from django_skipqueue.states import validate_queue_name
from django_skipqueue.stats import queue_stats, throughput_last_hour

if TYPE_CHECKING:
    from django.utils.functional import _StrPromise

    from django_skipqueue.managers import JobQuerySet

#: Inline style of a cell cut to its width, whole text on hover (no static file needed).
CUT = (
    "display:inline-block;max-width:19em;overflow:hidden;text-overflow:ellipsis;"
    "white-space:nowrap;vertical-align:top;"
)

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
    """The values an operator filters by: those this process knows (registered tasks, their
    queues, the queues of live workers) and those of unfinished and failed jobs, read
    through the partial indexes of those states. Not a DISTINCT over the whole table,
    which at a million done rows would scan them all on every page."""

    field = ""

    def known_values(self) -> set[str]:
        return set()

    def lookups(
        self, request: HttpRequest, model_admin: Any
    ) -> list[tuple[str, str | _StrPromise]]:
        values = self.known_values()
        for state in (JobState.PENDING, JobState.RUNNING, JobState.FAILED):
            values.update(
                Job.objects.filter(state=state)
                .values_list(self.field, flat=True)
                .distinct()
                .order_by()[:200]
            )
        return [(value, value) for value in sorted(values)[:200]]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        return queryset.filter(**{self.field: self.value()}) if self.value() else queryset


class QueueFilter(ValuesFilter):
    title, parameter_name, field = _("queue"), "queue", "queue_name"

    def known_values(self) -> set[str]:
        names = {registry.get(name).queue_name for name in registry.names()}
        for queues in WorkerProcess.objects.alive().values_list("queues", flat=True):
            names.update(queues or [])
        return names


class TaskFilter(ValuesFilter):
    title, parameter_name, field = _("task"), "task", "task"

    def known_values(self) -> set[str]:
        return set(registry.names())


class ScheduleFilter(admin.SimpleListFilter):
    """The jobs of one periodic schedule (the occurrence index serves it)."""

    title, parameter_name = _("schedule"), "schedule"

    def lookups(
        self, request: HttpRequest, model_admin: Any
    ) -> list[tuple[str, str | _StrPromise]]:
        names = Schedule.objects.values_list("name", flat=True)[:200]
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        return queryset.filter(schedule=self.value()) if self.value() else queryset


class AliveFilter(admin.SimpleListFilter):
    title = _("status")
    parameter_name = "status"

    def lookups(
        self, request: HttpRequest, model_admin: Any
    ) -> list[tuple[str, str | _StrPromise]]:
        return [("alive", _("alive")), ("dead", _("dead (stopped or lost)"))]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[WorkerProcess]
    ) -> QuerySet[WorkerProcess]:
        if self.value() in ("alive", "dead"):
            return queryset.filter(alive=self.value() == "alive")  # type: ignore[misc]  # annotated
        return queryset


class OwnLookupsOnly:
    """Only the lookups this admin's own filters use reach the ORM from a query string.

    Django's default accepts a lookup on any local field, so a view-only user could
    probe a redacted secret in `?kwargs__password__startswith=...` one character at a
    time, or send `?task__regex=(a` for a 500. Anything else is refused with a 400, and
    so is a query string holding NUL, which PostgreSQL text cannot hold; an object id
    holding NUL finds no object (Django's "does not exist" redirect). Every ModelAdmin of
    ours takes this mixin.
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

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Any:
        if "\x00" in object_id:
            return None
        return super().get_object(request, object_id, from_field)  # type: ignore[misc]


def arguments_html(args: Any, kwargs: Any) -> str:
    """A job's or a schedule's arguments as every page of ours shows them: redacted."""
    data = redact({"args": args, "kwargs": kwargs})
    return format_html("<pre>{}</pre>", json.dumps(data, indent=2, ensure_ascii=False, default=str))


def attempts_text(job: Job) -> str:
    """Attempts spent of those allowed: an attempt given back (a release) is neither, so
    a 5-attempt job released once and claimed again shows 1/5, not 2/6."""
    given_back = job.releases or 0
    text = f"{job.attempts - given_back}/{job.max_attempts - given_back}"
    if job.expirations:
        text += " " + str(_("(%(n)d expired)") % {"n": job.expirations})
    return text


def _expired_for(job: Job) -> timedelta | None:
    """How long ago a running job's lease ran out, on the database clock; None if live."""
    now = getattr(job, "db_now", None)
    if job.state != JobState.RUNNING or job.leased_until is None or now is None:
        return None
    return now - job.leased_until if job.leased_until <= now else None


def _age(span: timedelta) -> str:
    seconds = int(abs(span.total_seconds()))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    if seconds < 172800:
        return f"{seconds // 3600} h"
    return f"{seconds // 86400} d"


def _when(moment: datetime | None) -> str:
    """One timestamp format everywhere in these pages, in the current time zone."""
    if moment is None:
        return "-"
    return date_format(timezone.localtime(moment), "Y-m-d H:i:s")


def _parse_time(value: object) -> datetime | None:
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return moment if timezone.is_aware(moment) else None


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
    noun: str = "job(s)",
) -> None:
    skipped = selected - changed
    text = f"{changed} {noun} {verb}"
    if skipped:
        text += f"; {skipped} skipped ({why})"
    model_admin.message_user(request, text, messages.SUCCESS if changed else messages.WARNING)


@admin.register(Job)
class JobAdmin(OwnLookupsOnly, admin.ModelAdmin):
    # HealthFilter, "state", QueueFilter, TaskFilter and the run_at date filter.
    allowed_lookups = frozenset(
        {"health", "state__exact", "queue", "task", "schedule", "run_at__gte", "run_at__lt"}
    )
    # What an operator triages by, all of it within 1280 px with Django's two sidebars
    # open (tests/test_admin_browser.py): long values (task paths, worker ids, errors)
    # are cut, with the whole text on hover; times are relative to the database's now.
    list_display = ["id", "task_and_queue", "state_and_health", "attempts_of_max", "timing"]
    list_filter = [
        HealthFilter,
        "state",
        QueueFilter,
        TaskFilter,
        ScheduleFilter,
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
        "shown_unique_key",
        "schedule_link",
        "scheduled_for",
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
        (_("Origin"), {"fields": ["shown_unique_key", "schedule_link", "scheduled_for"]}),
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

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        """Each row with the database's now, by which its lease is live or expired."""
        return super().get_queryset(request).annotate(db_now=Now())

    @admin.display(description=_("job"), ordering="task")
    def task_and_queue(self, job: Job) -> str:
        """The task's name, its queue and module, and the first line of its last error:
        what the job is and why it is in trouble, in one cell."""
        module, _dot, name = job.task.rpartition(".")
        error = ""
        if job.last_error:  # masked again: another client may have written it
            last_error = redact_text(job.last_error[:2000])
            error = format_html(
                '<br><small class="skipqueue-error" title="{}" style="{}color:#b91c1c">{}</small>',
                last_error,
                CUT,
                (last_error.splitlines() or [""])[0][:300],
            )
        origin = ""
        if job.schedule:
            origin = format_html(" · ⏱ {}", job.schedule)
        elif job.unique_key:
            origin = format_html(" · key {}", redact_key(job.unique_key)[:60])
        return format_html(
            '<span title="{}" style="{}"><b>{}</b></span><br><small style="{}">{} · {}{}</small>{}',
            job.task,
            CUT,
            name,
            CUT,
            job.queue_name,
            module,
            origin,
            error,
        )

    @admin.display(description=_("schedule"))
    def schedule_link(self, job: Job) -> str:
        """The schedule that enqueued the job, linking to its other jobs."""
        if not job.schedule:
            return "-"
        url = reverse("admin:skipqueue_job_changelist") + f"?schedule={quote(job.schedule)}"
        return format_html('<a href="{}">{}</a>', url, job.schedule)

    @admin.display(description=_("state"), ordering="state")
    def state_and_health(self, job: Job) -> str:
        """The state; a stuck mark when a running job's lease has expired; its worker."""
        state = format_html(
            '<b style="color: {}">{}</b>', STATE_COLOURS.get(job.state, "#000"), job.state
        )
        expired = _expired_for(job)
        if expired is not None:
            state = format_html(
                '{} <b class="skipqueue-stuck" style="color:#fff;background:#dc2626;'
                'padding:0 4px;border-radius:3px;white-space:nowrap" title="{}">{}</b>',
                state,
                _("lease expired: the reaper takes it back, or Requeue does now"),
                _("stuck %(age)s") % {"age": _age(expired)},
            )
        if job.worker_id and job.state == JobState.RUNNING:
            state = format_html(
                '{}<br><small><a href="{}" title="{}"><code>{}</code></a></small>',
                state,
                reverse("admin:skipqueue_workerprocess_change", args=[job.worker_id]),
                job.worker_id,
                str(job.worker_id)[:8],
            )
        return state

    @admin.display(description=_("attempts"))
    def attempts_of_max(self, job: Job) -> str:
        return attempts_text(job)

    @admin.display(description=_("when"), ordering="run_at")
    def timing(self, job: Job) -> str:
        """Relative to the database's now: due, lease left or expired, finished."""
        now = getattr(job, "db_now", None)
        if now is None:
            return _when(job.run_at)
        if job.state == JobState.RUNNING and job.leased_until is not None:
            expired = _expired_for(job)
            if expired is not None:
                text = _("lease expired %(age)s ago") % {"age": _age(expired)}
                return format_html(
                    '<span style="color:#dc2626" title="{}">{}</span>',
                    _when(job.leased_until),
                    text,
                )
            left = _("lease: %(age)s left") % {"age": _age(job.leased_until - now)}
            return format_html('<span title="{}">{}</span>', _when(job.leased_until), left)
        if job.state == JobState.PENDING:
            text = (
                _("due in %(age)s") % {"age": _age(job.run_at - now)}
                if job.run_at > now
                else _("due %(age)s ago") % {"age": _age(now - job.run_at)}
            )
            return format_html('<span title="{}">{}</span>', _when(job.run_at), text)
        if job.finished_at is not None:
            text = _("ended %(age)s ago") % {"age": _age(now - job.finished_at)}
            return format_html('<span title="{}">{}</span>', _when(job.finished_at), text)
        return _when(job.run_at)

    @admin.display(description=_("arguments"))
    def pretty_args(self, job: Job) -> str:
        return arguments_html(job.args, job.kwargs)

    @admin.display(description=_("unique key"))
    def shown_unique_key(self, job: Job) -> str:
        """Masked where it may be a token (a reset link's, say): see redaction.redact_key."""
        return redact_key(job.unique_key) if job.unique_key else "-"

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
        """What happened, oldest first, every time in one format (error entries hold
        ISO 8601 text; an entry whose time cannot be read goes last, as written)."""
        events: list[tuple[datetime | None, str]] = [(job.created_at, "enqueued")]
        if job.first_started_at and job.attempts > 1:
            events.append((job.first_started_at, "attempt 1 started"))
        for entry in _entries(job.errors):
            what = f"attempt {entry.get('attempt')}: {entry.get('type')}"
            events.append((_parse_time(entry.get("at")), what))
        if job.started_at:
            events.append((job.started_at, f"attempt {job.attempts} started"))
        if job.finished_at:
            events.append((job.finished_at, f"finished {job.state}"))
        last = datetime.max.replace(tzinfo=timezone.get_current_timezone())
        events.sort(key=lambda event: event[0] or last)
        return format_html(
            '<ol class="skipqueue-timeline">{}</ol>',
            format_html_join(
                "", "<li><code>{}</code> {}</li>", ((_when(at), what) for at, what in events)
            ),
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
                (
                    e.get("attempt"),
                    _when(_parse_time(e.get("at"))) if _parse_time(e.get("at")) else e.get("at"),
                    e.get("type"),
                    redact(e.get("message")),  # masked again: another client may have
                    redact(e.get("traceback")),  # written it, or an older rule missed it
                )
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

    #: A bulk action changes at most this many jobs per request and starts no batch once
    #: `action_seconds` have passed, so that a select-all over 800,000 jobs (35 s in one
    #: request) ends well inside a proxy's timeout. The message says how many of the
    #: selection are left; running the action again on the same selection goes on with
    #: them, in id order. At the 40 us a job measured, 50,000 take a few seconds.
    action_max_rows = 50_000
    action_seconds = 10.0
    #: Ids per call of the Manager's verb (each call is one or two UPDATEs).
    action_batch_size = 1000

    @admin.action(description=_("Retry now (failed or cancelled)"), permissions=["retry"])
    def retry_now(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._act_in_bounds(
            request,
            queryset,
            applies=lambda jobs: jobs.retryable(),
            write=Job.objects.retry_now,
            verb="retried",
            why="not failed or cancelled, or a unique job whose key another job holds",
        )

    @admin.action(
        description=_("Cancel (pending) or ask to stop (running)"), permissions=["cancel"]
    )
    def cancel(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        who = request.user.get_username()
        self._act_in_bounds(
            request,
            queryset,
            applies=lambda jobs: jobs.filter(
                Q(state=JobState.PENDING)
                | Q(state=JobState.RUNNING, cancel_requested_at__isnull=True)
            ),
            write=lambda ids: Job.objects.cancel(ids, by=who),
            verb="cancelled or asked to stop",
            why="finished, or already asked",
        )

    @admin.action(description=_("Requeue (stuck)"), permissions=["requeue"])
    def requeue(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._act_in_bounds(
            request,
            queryset,
            applies=lambda jobs: jobs.expired().filter(cancel_requested_at__isnull=True),
            write=Job.objects.requeue,
            verb="requeued",
            why="not stuck: running with a live lease, or finished",
        )

    def _act_in_bounds(
        self,
        request: HttpRequest,
        queryset: QuerySet[Job],
        *,
        applies: Callable[[JobQuerySet], QuerySet[Job]],
        write: Callable[[list[int]], int],
        verb: str,
        why: str,
    ) -> None:
        """Run `write` (a Manager verb) over the selection in batches, in id order, within
        `action_max_rows` and `action_seconds`, and say what it did and what is left.

        A selection within the bound is taken as it is, and what the verb skipped is
        reported as before. A larger one is narrowed to the jobs the verb `applies` to
        (a read, not a write: the verb re-checks each row), so that the next run goes on
        where this one stopped rather than re-reading the same skipped rows.
        """
        jobs = cast("JobQuerySet", queryset).order_by("id")
        limit = self.action_max_rows
        selected = list(jobs.values_list("id", flat=True)[: limit + 1])
        bounded = len(selected) > limit
        ids = list(applies(jobs).values_list("id", flat=True)[:limit]) if bounded else selected
        deadline = time.monotonic() + self.action_seconds
        changed = done = 0
        for start in range(0, len(ids), self.action_batch_size):
            if start and time.monotonic() >= deadline:
                break
            batch = ids[start : start + self.action_batch_size]
            changed += write(batch)
            done += len(batch)
        if not bounded and done == len(ids):
            _report(self, request, verb, changed, len(ids), why)
            return
        left = applies(jobs).count()
        text = f"{changed} job(s) {verb}"
        if left:
            text += (
                f"; {left} more of the selection still to do: an action does at most "
                f"{limit} jobs and {self.action_seconds:g} s per request. Run it again on "
                f"the same selection to go on."
            )
            self.message_user(request, text, messages.WARNING)
        else:
            self.message_user(request, f"{text}; the rest of the selection skipped ({why})")

    # -- the queue overview ------------------------------------------------------------

    def get_urls(self) -> list[Any]:
        overview = self.admin_site.admin_view(self.overview_view)
        act = self.admin_site.admin_view(self.job_action_view)
        queue_act = self.admin_site.admin_view(self.queue_action_view)
        return [
            path("overview/", overview, name="skipqueue_overview"),
            # The queue's name is POST data, not a path segment: names written by other
            # clients may hold "/", a newline or anything else (trial finding 11).
            path("overview/<str:verb>/", queue_act, name="skipqueue_queue_act"),
            path("<int:object_id>/act/<str:verb>/", act, name="skipqueue_job_act"),
            *super().get_urls(),
        ]

    # -- one job's page: its health and its actions ----------------------------------

    #: verb: (the manager's guarded verb, its permission, when it applies, its label)
    JOB_ACTIONS = {
        "retry": ("retry_now", "retry", (JobState.FAILED, JobState.CANCELLED), _("Retry now")),
        "cancel": ("cancel", "cancel", (JobState.PENDING, JobState.RUNNING), _("Cancel")),
        "requeue": ("requeue", "requeue", (JobState.RUNNING,), _("Requeue (stuck)")),
    }

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """The job's page, with a stuck banner and the actions that apply to it now."""
        job = (
            self.get_queryset(request).filter(pk=object_id).first() if object_id.isdigit() else None
        )
        extra: dict[str, Any] = {**(extra_context or {})}
        if job is not None:
            expired = _expired_for(job)
            if expired is not None:
                extra["skipqueue_stuck"] = _(
                    "Stuck: its lease expired %(age)s ago and no worker holds it. The reaper "
                    "takes it back on its next pass; Requeue does it now."
                ) % {"age": _age(expired)}
            if job.cancel_requested_at is not None and job.state == JobState.RUNNING:
                extra["skipqueue_stuck"] = _(
                    "Cancel requested %(when)s by %(who)s: the task is told at the worker's "
                    "next lease renewal; a task that does not stop loses the job when its "
                    "lease ends, and the job ends cancelled."
                ) % {"when": _when(job.cancel_requested_at), "who": job.cancelled_by or "-"}
            extra["skipqueue_actions"] = [
                {
                    "verb": verb,
                    "label": label,
                    "url": reverse("admin:skipqueue_job_act", args=[job.id, verb]),
                }
                for verb, (_method, permission, states, label) in self.JOB_ACTIONS.items()
                if job.state in states
                and (verb != "requeue" or expired is not None)
                and (verb != "cancel" or job.cancel_requested_at is None)
                and getattr(self, f"has_{permission}_permission")(request)
            ]
        return super().change_view(request, object_id, form_url, extra)

    def job_action_view(self, request: HttpRequest, object_id: int, verb: str) -> HttpResponse:
        """POST from a job's page: the same guarded verb as the list action, on this job."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if verb not in self.JOB_ACTIONS:
            raise Http404(verb)
        method, permission, _states, _label = self.JOB_ACTIONS[verb]
        if not getattr(self, f"has_{permission}_permission")(request):
            raise PermissionDenied
        if verb == "cancel":
            changed = Job.objects.cancel([object_id], by=request.user.get_username())
        else:
            changed = getattr(Job.objects, method)([object_id])
        done = {"retry": _("retried"), "cancel": _("cancelled"), "requeue": _("requeued")}[verb]
        if changed:
            self.message_user(request, _("Job %(id)s %(done)s.") % {"id": object_id, "done": done})
        else:
            self.message_user(
                request,
                _("Job %(id)s was not %(done)s: its state changed meanwhile.")
                % {"id": object_id, "done": done},
                messages.WARNING,
            )
        return redirect("admin:skipqueue_job_change", object_id)

    # -- the queue overview ------------------------------------------------------------

    def has_pause_queue_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("skipqueue.pause_queue")

    def queue_action_view(self, request: HttpRequest, verb: str) -> HttpResponse:
        """POST from the overview: pause or resume the queue named by the form's `queue`
        (skipqueue.pause_queue). Any name that a row may hold is accepted and shown. The
        name is percent-encoded, so that a browser's line-break normalisation of form
        values (LF to CRLF) cannot change a name that holds a newline."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if verb not in ("pause", "resume"):
            raise Http404(verb)
        if not self.has_pause_queue_permission(request):
            raise PermissionDenied
        queue = unquote(request.POST.get("queue", ""))
        if not queue or "\x00" in queue:  # PostgreSQL text cannot hold NUL
            return HttpResponseBadRequest("a queue name is required (and cannot hold NUL)")
        if verb == "pause":
            try:
                validate_queue_name(queue)
            except InvalidJobError as error:
                # Queue.objects.pause() takes only the names our workers claim from.
                self.message_user(
                    request,
                    _(
                        "Queue %(q)s cannot be paused: %(why)s; workers of this package "
                        "never claim from it."
                    )
                    % {"q": queue, "why": error},
                    messages.ERROR,
                )
                return redirect("admin:skipqueue_overview")
            changed = Queue.objects.pause([queue], by=request.user.get_username())
        else:
            changed = Queue.objects.resume([queue])
        done = _("paused") if verb == "pause" else _("resumed")
        if changed:
            self.message_user(request, _("Queue %(q)s %(done)s.") % {"q": queue, "done": done})
        else:
            self.message_user(
                request,
                _("Queue %(q)s was already %(done)s.") % {"q": queue, "done": done},
                messages.WARNING,
            )
        return redirect("admin:skipqueue_overview")

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": _("Queue overview"),
            "queues": [
                {
                    **row.as_dict(),
                    # A relayed queue's due rows wait for the relay, which has no
                    # worker row: it is not "unattended" for that.
                    "unattended": row.pending_due > 0 and not row.live_workers and not row.relayed,
                }
                for row in queue_stats()
            ],
            "chart": throughput_chart(throughput_last_hour()),
            "can_pause": self.has_pause_queue_permission(request),
            "opts": self.model._meta,
            "breadcrumbs_as_list": django.VERSION >= (6, 1),  # Django 6.1's admin markup
        }
        return TemplateResponse(request, "admin/skipqueue/overview.html", context)


def throughput_chart(buckets: list[tuple[int, int]]) -> dict[str, Any]:
    """Bars of jobs done per bucket, with a scale: gridlines at 0, half and the peak."""
    peak = max((count for _, count in buckets), default=0)
    top = max(peak, 1)
    height, left = 100, 44
    bars = [
        {
            "x": left + index * 40,
            "y": 110 - round(count / top * height),
            "height": round(count / top * height),
            "count": count,
            "label": f"-{minutes}m",
        }
        for index, (minutes, count) in enumerate(buckets)
    ]
    ticks = [
        {"y": 110 - round(share * height), "value": round(top * share)} for share in (0, 0.5, 1)
    ]
    return {"bars": bars, "ticks": ticks, "width": left + 40 * len(buckets), "left": left}


@admin.register(QueueOverview)
class QueueOverviewAdmin(OwnLookupsOnly, admin.ModelAdmin):
    """The admin index's "Queue overview" entry: it opens the overview page. Its one URL
    is that redirect: the model is a proxy of Job, and Django's own change page for it
    would show a job's fields unredacted."""

    def get_urls(self) -> list[Any]:
        entry = self.admin_site.admin_view(self.changelist_view)
        info = self.opts.app_label, self.opts.model_name
        return [path("", entry, name="%s_%s_changelist" % info)]  # noqa: UP031

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm("skipqueue.view_job")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return redirect("admin:skipqueue_overview")


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


@admin.register(Schedule)
class ScheduleAdmin(OwnLookupsOnly, admin.ModelAdmin):
    """The periodic schedules, read-only (their definitions live in code), with their
    next occurrence and the jobs of their latest ones. Pausing takes its own permission
    (skipqueue.pause_schedule)."""

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

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a schedule removed from the code is deleted by the next worker

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
                '<b style="color:#b45309">{}</b> <small>{}{}</small>',
                _("paused"),
                _when(schedule.paused_at),
                by,
            )
        if schedule.name not in _defined_names():
            return format_html('<span style="color:#b91c1c">{}</span>', _("not in this code"))
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
        upcoming = cron.next_after(now, cron.zone(schedule.timezone))
        return _when(upcoming)

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
