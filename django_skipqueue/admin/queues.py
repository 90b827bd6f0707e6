"""The queue overview: its page, its pause and resume buttons, and its admin entry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import django
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import DurationField, ExpressionWrapper, F
from django.db.models.functions import Now
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseNotAllowed,
)
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _

from django_skipqueue.admin import charts
from django_skipqueue.admin.common import (
    OnePage,
    OwnLookupsOnly,
    ReadOnly,
    _age,
    _when,
)
from django_skipqueue.core.states import validate_queue_name
from django_skipqueue.exceptions import InvalidJobError
from django_skipqueue.lag import queue_reasons
from django_skipqueue.models import Job, Queue, QueueOverview
from django_skipqueue.stats import WINDOWS, Bucket, QueueStats, queue_stats, queue_trends

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Job]
else:
    _ModelAdmin = object


class QueueOverviewViews(_ModelAdmin):
    """The queue overview page and its pause and resume buttons (views of JobAdmin,
    whose URLs they are)."""

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
            if request.POST.get("confirm") != "yes":
                return self.pause_confirmation(request, queue)
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

    def pause_confirmation(self, request: HttpRequest, queue: str) -> HttpResponse:
        """The page between the overview's Pause and the pause, as Django's delete
        confirmation is: what pausing does to this queue now, and Yes or No."""
        jobs = Job.objects.filter(queue_name=queue)
        context = {
            **self.admin_site.each_context(request),
            "title": _("Pause queue %(q)s?") % {"q": queue},
            "queue": queue,
            "due": jobs.due().count(),
            "running": jobs.running().count(),
            "opts": self.model._meta,
            "breadcrumbs_as_list": django.VERSION >= (6, 1),
        }
        return TemplateResponse(request, "admin/skipqueue/pause_confirmation.html", context)

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        window = request.GET.get("window", "hour")
        if window not in WINDOWS:
            window = "hour"
        hour = queue_trends("hour")
        trends = hour if window == "hour" else queue_trends(window)
        rows = queue_stats(finished=False)  # the done columns: from the minute rows below
        listed = {row.queue for row in rows}
        rows += [QueueStats(queue=name) for name in sorted(set(hour) - listed)]  # idle now
        rows.sort(key=lambda row: row.queue)
        for row in rows:  # the columns count what the hour chart's bars count
            series = hour.get(row.queue, [])
            row.done_5m = series[-1].succeeded if series else 0
            row.done_1h = sum(bucket.succeeded for bucket in series)
        paused = paused_by_queue()
        reasons = queue_reasons(rows)
        context = {
            **self.admin_site.each_context(request),
            "title": _("Queue overview"),
            "queues": [
                {
                    **row.as_dict(),
                    **paused.get(row.queue, {}),
                    "lag_text": charts.duration(row.lag_seconds),
                    "reasons": reasons.get(row.queue, []),  # why its due jobs wait
                    # A relayed queue's due rows wait for a relay, a plain queue's for
                    # a worker: none alive, nobody takes them.
                    "unattended": row.pending_due > 0
                    and not (row.live_relays if row.relayed else row.live_workers),
                }
                for row in rows
            ],
            "window": window,
            "panels": [
                {"queue": name, "charts": trend_charts(series, window)}
                for name, series in trends.items()
            ],
            "can_pause": self.has_pause_queue_permission(request),
            # Its column only when it says something: a button, a pause, a limit, a relay
            # (a view-only user saw an empty FLOW column).
            "show_flow": self.has_pause_queue_permission(request)
            or any(row.paused or row.limits or row.relayed for row in rows),
            "opts": self.model._meta,
            "breadcrumbs_as_list": django.VERSION >= (6, 1),  # Django 6.1's admin markup
        }
        return TemplateResponse(request, "admin/skipqueue/overview.html", context)


def paused_by_queue() -> dict[str, dict[str, str]]:
    """Who paused each paused queue, when, and how long ago on the database's clock."""
    rows = Queue.objects.paused().annotate(
        age=ExpressionWrapper(Now() - F("paused_at"), output_field=DurationField())
    )
    return {
        queue.name: {
            "paused_by": queue.paused_by or str(_("someone unnamed")),
            "paused_when": _when(queue.paused_at),
            "paused_ago": _age(queue.age),
        }
        for queue in rows
    }


def trend_charts(series: list[Bucket], window: str) -> list[SafeString]:
    """A queue's four charts over `window`: attempts ended by outcome, the failure
    rate, the pickup delay (p50 and p95) and the age of the oldest due job."""
    _span, width = WINDOWS[window]
    labels = [
        _("now")
        if bucket.minutes_ago == 0
        else (f"-{bucket.minutes_ago} min" if width < 60 else f"-{bucket.minutes_ago // 60} h")
        for bucket in series
    ]
    per = _("per %(n)s min") % {"n": width} if width < 60 else _("per hour")
    return [
        charts.bar_chart(
            _("Ended %(per)s") % {"per": per},
            [
                (_("succeeded"), "#16a34a", [b.succeeded for b in series]),
                (_("retried"), "#d97706", [b.retried for b in series]),
                (_("failed"), "#dc2626", [b.failed for b in series]),
            ],
            labels,
            charts.count,
        ),
        charts.line_chart(
            _("Failure rate"),
            [(_("retried or failed"), "#dc2626", [b.failure_rate for b in series])],
            labels,
            charts.percent,
        ),
        charts.line_chart(
            _("Pickup delay"),
            [
                ("p50", "#2563eb", [b.pickup_quantile(0.5) for b in series]),
                ("p95", "#7c3aed", [b.pickup_quantile(0.95) for b in series]),
            ],
            labels,
            charts.duration,
        ),
        charts.line_chart(
            _("Oldest due job"),
            [(_("age"), "#b45309", [b.oldest_due_seconds for b in series])],
            labels,
            charts.duration,
        ),
    ]


@admin.register(QueueOverview)
class QueueOverviewAdmin(OnePage, ReadOnly, OwnLookupsOnly, admin.ModelAdmin):
    """The admin index's "Queue overview" entry: its one URL (OnePage) redirects to the
    overview page, a view of JobAdmin."""

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return redirect("admin:skipqueue_overview")
