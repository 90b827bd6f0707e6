"""The queue overview: its page, its pause and resume buttons, and its admin entry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import django
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseNotAllowed,
)
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path
from django.utils.translation import gettext_lazy as _

from django_skipqueue.admin.common import (
    OwnLookupsOnly,
    ReadOnly,
)
from django_skipqueue.core.states import validate_queue_name
from django_skipqueue.exceptions import InvalidJobError
from django_skipqueue.models import Job, Queue, QueueOverview
from django_skipqueue.stats import queue_stats, throughput_last_hour

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
class QueueOverviewAdmin(ReadOnly, OwnLookupsOnly, admin.ModelAdmin):
    """The admin index's "Queue overview" entry: it opens the overview page. Its one URL
    is that redirect: the model is a proxy of Job, and Django's own change page for it
    would show a job's fields unredacted."""

    def get_urls(self) -> list[Any]:
        entry = self.admin_site.admin_view(self.changelist_view)
        info = self.opts.app_label, self.opts.model_name
        return [path("", entry, name="%s_%s_changelist" % info)]  # noqa: UP031

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm("skipqueue.view_job")

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return redirect("admin:skipqueue_overview")
