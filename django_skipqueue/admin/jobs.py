"""The job admin: read-only jobs, their health, and the operator's guarded actions.

Over 600 lines because it is one ModelAdmin: its columns, its page and its three
actions (retry, cancel, requeue) share the queryset and the permission checks. The
words of a job's banners are `job_texts.py`'s; what every admin page shares,
`common.py`'s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import quote

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.db.models import Q, QuerySet
from django.db.models.functions import Now
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseNotAllowed,
)
from django.shortcuts import redirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _

from django_skipqueue.core.redaction import redact, redact_key, redact_text
from django_skipqueue.core.states import EXPIRED
from django_skipqueue.lag import job_reason
from django_skipqueue.models import (
    Job,
    JobState,
    Signal,
    Step,
    WorkerProcess,
)

if TYPE_CHECKING:
    from django_skipqueue.queue.base import JobQuerySet

from django_skipqueue.admin.common import (
    STYLESHEET,
    EstimatedCountPaginator,
    HealthFilter,
    OwnLookupsOnly,
    PayloadGate,
    QueueFilter,
    ReadOnly,
    ScheduleFilter,
    TaskFilter,
    WorkflowFilter,
    _age,
    _entries,
    _expired_for,
    _parse_time,
    _report,
    _when,
    arguments_html,
    as_id,
    attempts_text,
    error_class,
    hidden,
    inputs_before_args,
    moment,
    payloads_for,
    shape,
    short_error,
    shows_payloads,
)
from django_skipqueue.admin.job_steps import (
    RESTART_FORM,
    RESTARTABLE,
    kept_signals_html,
    restart_form,
    steps_html,
)
from django_skipqueue.admin.job_texts import cancelled_headline, failed_headline, progress_html
from django_skipqueue.admin.queues import QueueOverviewViews
from django_skipqueue.admin.workers import with_status


@admin.register(Job)
class JobAdmin(PayloadGate, QueueOverviewViews, ReadOnly, OwnLookupsOnly, admin.ModelAdmin):
    class Media:
        css = {"all": (STYLESHEET,)}

    # HealthFilter, "state", QueueFilter, TaskFilter and the run_at date filter.
    allowed_lookups = frozenset(
        {
            "health",
            "state__exact",
            "queue",
            "task",
            "schedule",
            "workflow",
            "run_at__gte",
            "run_at__lt",
        }
    )
    # What an operator triages by, all of it within 1280 px with Django's two sidebars
    # open (tests/admin/test_admin_browser.py): long values (task paths, worker ids, errors)
    # are cut, with the whole text on hover; times are relative to the database's now.
    list_display = ["id", "task_and_queue", "state_and_health", "attempts_of_max", "timing"]
    list_filter = [
        HealthFilter,
        "state",
        QueueFilter,
        TaskFilter,
        ScheduleFilter,
        WorkflowFilter,
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
        "shown_expires_at",
        "rate_limit",
        "lease",
        "shown_leased_until",
        "created_at",
        "started_at",
        "finished_at",
        "worker_status",
        "shown_unique_key",
        "shown_fair_key",
        "schedule_link",
        "shown_scheduled_for",
        "workflow_link",
        "pretty_args",
        "pretty_result",
        "timeline",
        "error_history",
        "progress_shown",
        "waiting_reason",
        "steps_shown",
        "signals_kept",
    ]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    "task",
                    "queue_name",
                    "priority",
                    "state",
                    "waiting_reason",
                    "shown_expires_at",
                    "progress_shown",
                ]
            },
        ),
        (
            _("Attempts"),
            {
                "fields": [
                    "attempts",
                    "max_attempts",
                    "expirations",
                    "releases",
                    "lease",
                    "shown_leased_until",
                    "worker_status",
                ]
            },
        ),
        (
            _("Origin"),
            {
                "fields": [
                    "shown_unique_key",
                    "shown_fair_key",
                    "schedule_link",
                    "shown_scheduled_for",
                    "workflow_link",
                    "rate_limit",
                ]
            },
        ),
        (_("Data"), {"fields": ["pretty_args", "pretty_result"]}),
        (_("Steps"), {"fields": ["steps_shown", "signals_kept"]}),
        (_("History"), {"fields": ["timeline", "error_history"]}),
    ]

    shown_expires_at = moment("expires_at", _("expires at"))
    shown_leased_until = moment("leased_until", _("leased until"))
    shown_scheduled_for = moment("scheduled_for", _("scheduled for"))

    def get_fieldsets(self, request: HttpRequest, obj: Job | None = None) -> Any:
        """A failed job's errors come first, right under its banner: why it failed is
        what its page is opened for, not something to scroll 2,000 px down to."""
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None or obj.state not in (JobState.PENDING, JobState.WAITING):
            fieldsets = _without(fieldsets, "waiting_reason")  # only while it waits
        kept = obj is not None and Signal.objects.filter(job_id=obj.id).exists()
        if not kept:
            fieldsets = _without(fieldsets, "signals_kept")  # only where some are kept
        if not kept and (obj is None or not Step.objects.filter(job_id=obj.id).exists()):
            fieldsets = [(name, options) for name, options in fieldsets if name != _("Steps")]
        if obj is None or obj.state != JobState.FAILED:
            return fieldsets
        rest = _without(fieldsets, "error_history")
        return [(_("Errors, newest first"), {"fields": ["error_history"]}), *rest]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Job], search_term: str
    ) -> tuple[QuerySet[Job], bool]:
        """A number finds that job by primary key; text matches task names by prefix.

        Never `OR task ILIKE '%...%'` across the table, which scans every row.
        """
        term = search_term.strip()
        if not term:
            return queryset, False
        if (job_id := as_id(term)) is not None:
            return queryset.filter(id=job_id), False
        if term.isdigit():  # digits, but no id (too long, or not ASCII): none
            return queryset.none(), False
        return queryset.filter(task__startswith=term), False

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
        if job.last_error and not shows_payloads():
            error = format_html(
                '<br><small class="skipqueue-error">{}</small>', error_class(job.last_error)
            )
        elif job.last_error:  # masked again: another client may have written it
            last_error = redact_text(job.last_error)[:2000]
            error = format_html(
                '<br><small class="skipqueue-error skipqueue-cut" title="{}">{}</small>',
                last_error,
                short_error(last_error)[:300],
            )
        origin = ""
        if job.schedule:
            origin = format_html(" · schedule {}", job.schedule)  # words: no emoji font needed
        elif job.unique_key:
            key = redact_key(job.unique_key)[:60] if shows_payloads() else "(hidden)"
            origin = format_html(" · key {}", key)
        return format_html(
            '<span class="skipqueue-cut" title="{}"><b>{}</b></span><br>'
            '<small class="skipqueue-cut">{} · {}{}</small>{}',
            job.task,
            name,
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

    @admin.display(description=_("workflow"))
    def workflow_link(self, job: Job) -> str:
        """The workflow the job is a step of, and what it waits on."""
        if job.workflow_id is None:
            return "-"
        url = reverse("admin:skipqueue_workflow_change", args=[job.workflow_id])
        waits = ""
        if job.state == JobState.WAITING and job.waiting_on:
            waits = format_html(" · {}", _("waits on %d more") % job.waiting_on)
        siblings = reverse("admin:skipqueue_job_changelist") + f"?workflow={job.workflow_id}"
        return format_html(
            '<a href="{}">#{}</a>{} · <a href="{}">{}</a>',
            url,
            job.workflow_id,
            waits,
            siblings,
            _("all its jobs"),
        )

    @admin.display(description=_("state"), ordering="state")
    def state_and_health(self, job: Job) -> str:
        """The state; a stuck mark when a running job's lease has expired; its worker."""
        state = format_html('<b class="skipqueue-state-{}">{}</b>', job.state, job.state)
        if job.state == JobState.CANCELLED and job.cancelled_by == EXPIRED:
            state = format_html(
                '{} <b class="skipqueue-badge" title="{}">{}</b>',
                state,
                job.last_error,
                _("expired"),
            )
        expired = _expired_for(job)
        if expired is not None:
            state = format_html(
                '{} <b class="skipqueue-stuck skipqueue-badge" title="{}">{}</b>',
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
                    '<span class="skipqueue-alert" title="{}">{}</span>',
                    _when(job.leased_until),
                    text,
                )
            left = _("lease: %(age)s left") % {"age": _age(job.leased_until - now)}
            cell = format_html('<span title="{}">{}</span>', _when(job.leased_until), left)
            return format_html("{}{}", cell, progress_html(job))
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

    @admin.display(description=_("why it waits"))
    def waiting_reason(self, job: Job) -> str:
        """Why a pending or waiting job has not started (lag.py): its time, its
        parents, a pause, a limit, or busy workers; "-" for any other state."""
        return job_reason(job) or "-"

    @admin.display(description=_("progress"))
    def progress_shown(self, job: Job) -> str:
        """The task's last `context.set_progress()`, and when it was written."""
        if not job.progress:
            return "-"
        at = job.progress.get("at") if isinstance(job.progress, dict) else None
        if not shows_payloads():  # the note is the task's own text
            fraction = job.progress_fraction
            done = "reported" if fraction is None else f"{fraction:.0%}"
            return format_html(
                "{} {}<br><small>{}</small>", done, hidden("(note hidden)"), at or ""
            )
        return format_html("{}<br><small>{}</small>", progress_html(job), at or "")

    @admin.display(description=_("arguments"))
    def pretty_args(self, job: Job) -> str:
        return arguments_html(job.args, job.kwargs, job.task, skipped=inputs_before_args(job))

    @admin.display(description=_("unique key"))
    def shown_unique_key(self, job: Job) -> str:
        """Masked where it may be a token (a reset link's, say): see redaction.redact_key."""
        if job.unique_key and not shows_payloads():
            return hidden(_("set (hidden)"))
        return redact_key(job.unique_key) if job.unique_key else "-"

    @admin.display(description=_("fair key"))
    def shown_fair_key(self, job: Job) -> str:
        """A fair queue's job: its key (made of its arguments: hidden as they are) and
        weight; "-" outside a fair queue."""
        if job.fair_key is None:
            return "-"
        weight = _("weight %(weight)d") % {"weight": job.fair_weight}
        if job.fair_key == "":
            return format_html("{} ({})", _("none: the queue's keyless jobs"), weight)
        if not shows_payloads():
            return format_html("{} ({})", hidden(_("set (hidden)")), weight)
        return format_html("{} ({})", redact_key(job.fair_key), weight)

    @admin.display(description=_("return value"))
    def pretty_result(self, job: Job) -> str:
        if job.result is None:
            return "-"
        if not shows_payloads():
            return hidden(shape(job.result))
        return format_html("<pre>{}</pre>", json.dumps(redact(job.result), indent=2))

    @admin.display(description=_("steps"))
    def steps_shown(self, job: Job) -> str:
        """A durable job's recorded steps, and whether it sleeps (admin/job_steps.py)."""
        return steps_html(job)

    @admin.display(description=_("signals not yet taken"))
    def signals_kept(self, job: Job) -> str:
        """Signals sent to the job that no wait has taken yet (admin/job_steps.py)."""
        return kept_signals_html(job)

    @admin.display(description=_("worker"))
    def worker_status(self, job: Job) -> str:
        workers = with_status(WorkerProcess.objects.filter(id=job.worker_id))
        worker = workers.first() if job.worker_id else None
        if worker is None:
            return str(job.worker_id or "-")
        url = reverse("admin:skipqueue_workerprocess_change", args=[worker.id])
        return format_html('<a href="{}">{}</a> ({})', url, worker, worker.status)  # type: ignore[attr-defined]

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
        if not shows_payloads():  # when and what class, never the message or traceback
            return format_html_join(
                "",
                "<p><b>attempt {} at {}: {}</b></p>",
                (
                    (e.get("attempt"), e.get("at"), str(e.get("type")).rpartition(".")[2])
                    for e in reversed(_entries(job.errors))
                ),
            )
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
            try:
                changed += write(batch)
            except DatabaseError as error:  # said, with what was done, not a 500
                self.message_user(
                    request,
                    f"{changed} job(s) {verb}, then the database refused "
                    f"({str(error).splitlines()[0][:200]}); the rest was not changed. "
                    f"Run it again to go on.",
                    messages.ERROR,
                )
                return
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
        with payloads_for(request):  # the banners are made here, before the page
            return self._change_view(request, object_id, form_url, extra_context)

    def _change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str,
        extra_context: dict[str, Any] | None,
    ) -> HttpResponse:
        job_id = as_id(object_id)
        job = self.get_queryset(request).filter(pk=job_id).first() if job_id is not None else None
        extra: dict[str, Any] = {**(extra_context or {})}
        if job is not None:
            expired = _expired_for(job)
            if expired is not None:
                extra["skipqueue_stuck"] = _(
                    "Stuck: its lease expired %(age)s ago and no worker holds it. The reaper "
                    "takes it back on its next pass; Requeue does it now."
                ) % {"age": _age(expired)}
            if job.state == JobState.FAILED:
                extra["skipqueue_failed"] = failed_headline(job)
            if job.state == JobState.CANCELLED:
                extra["skipqueue_cancelled"] = cancelled_headline(job)
            elif job.state == JobState.DONE and job.cancelled_by:  # a keyed job's cancel
                extra["skipqueue_cancelled"] = _(
                    "Done, though %(who)s asked it to stop: its task finished first."
                ) % {"who": job.cancelled_by}
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
            # The banner of a failed or cancelled job carries its Retry button.
            extra["skipqueue_banner_action"] = next(
                (a for a in extra["skipqueue_actions"] if a["verb"] == "retry"), None
            )
            if job.state in RESTARTABLE and self.has_retry_permission(request):
                extra["skipqueue_restart_url"] = reverse(
                    "admin:skipqueue_job_act", args=[job.id, "restart"]
                )
        form = restart_form.set(RESTART_FORM if "skipqueue_restart_url" in extra else "")
        try:  # the page is drawn inside (PayloadGate renders it before returning)
            return super().change_view(request, object_id, form_url, extra)
        finally:
            restart_form.reset(form)

    def job_action_view(self, request: HttpRequest, object_id: int, verb: str) -> HttpResponse:
        """POST from a job's page: the same guarded verb as the list action, on this job."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if verb == "restart":
            return self._restart(request, object_id)
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

    def _restart(self, request: HttpRequest, object_id: int) -> HttpResponse:
        """POST from a durable job's steps: restart it from the step the button names."""
        if not self.has_retry_permission(request):
            raise PermissionDenied
        position = as_id(str(request.POST.get("position", "")))
        if position is None or position < 1:
            return HttpResponseBadRequest("position: a step's number (1, 2, ...)")
        if Job.objects.restart_from_step(object_id, position):
            self.message_user(
                request,
                _(
                    "Job %(id)s runs again from step %(n)s: the records of that step and the later "
                    "ones were dropped."
                )
                % {"id": object_id, "n": position},
            )
        else:
            self.message_user(
                request,
                _(
                    "Job %(id)s was not restarted: it is running or done now, or another job "
                    "holds its unique key."
                )
                % {"id": object_id},
                messages.WARNING,
            )
        return redirect("admin:skipqueue_job_change", object_id)


def _without(fieldsets: Any, field: str) -> list[Any]:
    """`fieldsets` with `field` left out of each."""
    return [
        (name, {**options, "fields": [f for f in options["fields"] if f != field]})
        for name, options in fieldsets
    ]
