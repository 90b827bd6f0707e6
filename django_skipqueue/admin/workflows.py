"""The workflow admin: a workflow's jobs as an indented tree, why it failed, and the
operator's two actions on it (cancel it, retry its failed job), each through the guarded
verbs of queue/workflows.py and with the job permissions they stand for."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _

from django_skipqueue.admin.common import (
    STYLESHEET,
    OwnLookupsOnly,
    PayloadGate,
    ReadOnly,
    error_class,
    hidden,
    moment,
    shows_payloads,
)
from django_skipqueue.core.redaction import redact_text
from django_skipqueue.models import Job, Workflow, WorkflowState

#: The most jobs a workflow's page draws (a chord of 10,000 members would not read).
TREE_LIMIT = 300
#: Deeper jobs are drawn at this indent (the stylesheet has a class for each level).
MAX_INDENT = 8


@admin.register(Workflow)
class WorkflowAdmin(PayloadGate, ReadOnly, OwnLookupsOnly, admin.ModelAdmin):
    class Media:
        css = {"all": (STYLESHEET,)}

    list_display = [
        "id",
        "name",
        "state_badge",
        "failed_job_link",
        "shown_created_at",
        "shown_finished_at",
    ]
    list_filter = ["state"]
    allowed_lookups = frozenset({"state__exact"})
    ordering = ["-id"]
    show_full_result_count = False
    actions = ["cancel_workflows", "retry_failed"]
    readonly_fields = [
        "id",
        "name",
        "state_badge",
        "shown_error",
        "failed_job_link",
        "shown_created_at",
        "shown_finished_at",
        "job_tree",
    ]
    fields = tuple(readonly_fields)
    shown_created_at = moment("created_at", _("created at"))
    shown_finished_at = moment("finished_at", _("finished at"))

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Who may see jobs may see their workflows (no permission of its own to grant)."""
        return request.user.has_perm("skipqueue.view_job")

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("skipqueue.cancel_job")

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("skipqueue.retry_job")

    @admin.display(description=_("state"), ordering="state")
    def state_badge(self, workflow: Workflow) -> str:
        return format_html('<b class="skipqueue-state-{}">{}</b>', workflow.state, workflow.state)

    @admin.display(description=_("failed job"))
    def failed_job_link(self, workflow: Workflow) -> str:
        if workflow.failed_job_id is None:
            return "-"
        url = reverse("admin:skipqueue_job_change", args=[workflow.failed_job_id])
        return format_html('<a href="{}">#{}</a>', url, workflow.failed_job_id)

    @admin.display(description=_("why it failed"))
    def shown_error(self, workflow: Workflow) -> str:
        if not workflow.error:
            return "-"
        if not shows_payloads():  # the error's text names the failed job's error message
            return hidden(_("hidden: seeing it takes the payload permission"))
        return format_html(
            '<pre class="skipqueue-error">{}</pre>', redact_text(workflow.error)[:4000]
        )

    @admin.display(description=_("jobs"))
    def job_tree(self, workflow: Workflow) -> str:
        """Each job indented under the parents it waits on, in the order they were given."""
        rows = list(
            Job.objects.filter(workflow=workflow)
            .order_by("id")
            .values("id", "task", "state", "waiting_on", "dependents", "last_error")[
                : TREE_LIMIT + 1
            ]
        )
        on_error_label = format_html(
            ' <small class="skipqueue-tree-label">{}</small>',
            _("on_error: runs if a job of the workflow fails"),
        )
        depth: dict[int, int] = {}
        for row in rows:
            depth.setdefault(row["id"], 0)
            for child in row["dependents"] or []:
                depth[child] = max(depth.get(child, 0), depth[row["id"]] + 1)
        lines = format_html_join(
            "",
            '<li class="skipqueue-tree-{}"><a href="{}">#{}</a> {} '
            '<b class="skipqueue-state-{}">{}</b>{}{}</li>',
            (
                (
                    min(depth.get(row["id"], 0), MAX_INDENT),
                    reverse("admin:skipqueue_job_change", args=[row["id"]]),
                    row["id"],
                    row["task"].rsplit(".", 1)[-1],
                    row["state"],
                    row["state"],
                    _note(row),
                    on_error_label if row["id"] == workflow.on_error_job_id else "",
                )
                for row in rows[:TREE_LIMIT]
            ),
        )
        more = ""
        if len(rows) > TREE_LIMIT:
            url = reverse("admin:skipqueue_job_changelist") + f"?workflow={workflow.id}"
            more = format_html(
                '<li><a href="{}">{}</a></li>', url, _("… and more: every job of it")
            )
        return format_html('<ul class="skipqueue-tree">{}{}</ul>', lines, more)

    def get_urls(self) -> list[Any]:
        retry = path(
            "<int:object_id>/retry/",
            self.admin_site.admin_view(self.retry_view),
            name="skipqueue_workflow_retry",
        )
        return [retry, *super().get_urls()]

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """A failed workflow's page carries the Retry of its failed job, as a failed
        job's page does (the list's action did it alone before)."""
        extra = {**(extra_context or {})}
        workflow_id = object_id if str(object_id).isdigit() else None
        if workflow_id is not None and self.has_retry_permission(request):
            failed = Workflow.objects.filter(id=workflow_id, state=WorkflowState.FAILED).exists()
            if failed:
                extra["skipqueue_retry_url"] = reverse(
                    "admin:skipqueue_workflow_retry", args=[workflow_id]
                )
        return super().change_view(request, object_id, form_url, extra)

    def retry_view(self, request: HttpRequest, object_id: int) -> HttpResponse:
        """POST from a failed workflow's page: retry its failed job (`retry_failed`)."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_retry_permission(request):
            raise PermissionDenied
        retried = Workflow.objects.retry_failed([object_id])
        self.message_user(
            request,
            _("Workflow %(id)d: %(n)d failed job(s) retried; it runs on.")
            % {"id": object_id, "n": retried}
            if retried
            else _("Workflow %(id)d has no failed job to retry.") % {"id": object_id},
            messages.SUCCESS if retried else messages.WARNING,
        )
        return redirect("admin:skipqueue_workflow_change", object_id)

    @admin.action(
        description=_("Cancel the workflow (its unfinished jobs)"), permissions=["cancel"]
    )
    def cancel_workflows(self, request: HttpRequest, queryset: QuerySet[Workflow]) -> None:
        ids = list(queryset.values_list("id", flat=True)[:1000])
        try:
            changed = Workflow.objects.cancel(ids, by=request.user.get_username())
        except DatabaseError as error:  # a lock timeout, a server going away: said, not a 500
            self.message_user(
                request,
                _("No workflow was cancelled: the database refused (%(error)s). Try again.")
                % {"error": str(error).splitlines()[0][:200]},
                messages.ERROR,
            )
            return
        self.message_user(
            request,
            _("%(changed)d of %(asked)d workflows cancelled (finished ones are left as they are).")
            % {"changed": changed, "asked": len(ids)},
            messages.SUCCESS if changed else messages.WARNING,
        )

    @admin.action(
        description=_("Retry the failed job (resumes the workflow)"), permissions=["retry"]
    )
    def retry_failed(self, request: HttpRequest, queryset: QuerySet[Workflow]) -> None:
        ids = list(queryset.values_list("id", flat=True)[:1000])
        retried = Workflow.objects.retry_failed(ids)
        self.message_user(
            request,
            _("%(retried)d failed jobs retried; what waited on them waits again.")
            % {"retried": retried},
            messages.SUCCESS if retried else messages.WARNING,
        )


def _note(row: dict[str, Any]) -> str:
    if row["state"] == "waiting" and row["waiting_on"]:
        return format_html(" <small>{}</small>", _("waits on %d") % row["waiting_on"])
    if row["state"] in {"failed", "cancelled"} and row["last_error"] and not shows_payloads():
        return format_html(
            ' <small class="skipqueue-error">{}</small>', error_class(row["last_error"])
        )
    if row["state"] in {"failed", "cancelled"} and row["last_error"]:
        text = redact_text(row["last_error"])[:300].splitlines() or [""]
        return format_html(' <small class="skipqueue-error">{}</small>', text[0])
    return ""
