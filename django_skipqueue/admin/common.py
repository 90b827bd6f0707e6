"""What the admins share: the paginator, the filters, the own-lookups rule, the payload
gate, and the small formatters of times, ages, attempts and arguments."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.exceptions import DisallowedModelAdminLookup
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import (
    HttpRequest,
    HttpResponse,
)
from django.urls import path
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _

from django_skipqueue.conf import get_settings
from django_skipqueue.core.redaction import redact_call
from django_skipqueue.core.states import EXPIRED, ParkedOn
from django_skipqueue.models import (
    Job,
    JobState,
    Schedule,
    WorkerProcess,
    queue_names_of,
)
from django_skipqueue.tasks.registry import registry

if TYPE_CHECKING:
    from django.utils.functional import _StrPromise

    from django_skipqueue.queue.base import JobQuerySet

#: The admin's stylesheet (classes `skipqueue-*`), on every page of ours.
STYLESHEET = "skipqueue/admin.css"


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


#: The health filter's values for durable jobs parked until their time (Job.parked).
PARKED = {"sleeping": ParkedOn.SLEEP, "awaiting_signal": ParkedOn.SIGNAL}


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
            ("sleeping", _("sleeping (a durable sleep)")),
            ("awaiting_signal", _("awaiting a signal")),
            ("expired", _("expired before it started")),
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
        if value in PARKED:
            return jobs.scheduled().filter(parked=PARKED[value])
        if value == "expired":
            return jobs.filter(state=JobState.CANCELLED, cancelled_by=EXPIRED)
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
            names.update(queue_names_of(queues))
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


class WorkflowFilter(admin.SimpleListFilter):
    """The jobs of one workflow (`?workflow=ID`, linked from a workflow's page)."""

    title, parameter_name = _("workflow"), "workflow"

    def lookups(
        self, request: HttpRequest, model_admin: Any
    ) -> list[tuple[str, str | _StrPromise]]:
        value = self.value()
        return [(value, f"#{value}")] if value and value.isdigit() else []

    def has_output(self) -> bool:
        return True  # applied from a link even though it offers no choices of its own

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        value = self.value()
        if not value:
            return queryset
        return queryset.filter(workflow_id=int(value)) if value.isdigit() else queryset.none()


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
        if request.method == "POST":  # an action's selection: ids of this admin's model
            pk = self.model._meta.pk  # type: ignore[attr-defined]
            for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
                try:
                    if "\x00" in value:
                        raise ValueError("NUL")
                    pk.to_python(value)
                except (ValueError, ValidationError):
                    raise DisallowedModelAdminLookup(
                        f"the selection holds {value[:40]!r}, not an id of this list"
                    ) from None
        return super().changelist_view(request, extra_context)  # type: ignore[misc]

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Any:
        if "\x00" in object_id:
            return None
        return super().get_object(request, object_id, from_field)  # type: ignore[misc]


#: The permission to see what jobs carry: arguments, results, error messages and
#: tracebacks, unique keys, progress notes (Job's Meta).
PAYLOAD_PERMISSION = "skipqueue.view_job_payload"

#: Whether the request being answered may see payloads: set around each view of ours
#: (`PayloadGate`), read by the formatters, which Django calls with a row only. False
#: outside a view: what nobody asked to see is not shown.
_payloads_shown: ContextVar[bool] = ContextVar("skipqueue_payloads_shown", default=False)


def shows_payloads() -> bool:
    """Whether the request being answered may see payloads (PAYLOAD_PERMISSION)."""
    return _payloads_shown.get()


@contextlib.contextmanager
def payloads_for(request: HttpRequest) -> Iterator[None]:
    """Within the block, `shows_payloads()` answers for this request's user."""
    token = _payloads_shown.set(bool(request.user.has_perm(PAYLOAD_PERMISSION)))
    try:
        yield
    finally:
        _payloads_shown.reset(token)


class PayloadGate:
    """A staff user without PAYLOAD_PERMISSION sees task names, states, times, error
    classes and shapes (an argument's type, a result's kind), never the values: a
    view-only operator is safe whatever a masking rule misses. Each view is rendered
    inside `payloads_for` (Django renders a TemplateResponse after the view returns,
    which would be outside it)."""

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        with payloads_for(request):
            return _rendered(super().changelist_view(request, extra_context))  # type: ignore[misc]

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        with payloads_for(request):
            return _rendered(
                super().change_view(request, object_id, form_url, extra_context)  # type: ignore[misc]
            )


def _rendered(response: HttpResponse) -> HttpResponse:
    render = getattr(response, "render", None)
    if render is not None and not getattr(response, "is_rendered", True):
        render()
    return response


def shape(value: Any) -> str:
    """What a payload is without what it says: `str`, `int`, `list of 3`, `dict of 2`."""
    if isinstance(value, dict):
        return f"dict of {len(value)}"
    if isinstance(value, (list, tuple)):
        return f"list of {len(value)}"
    return "null" if value is None else type(value).__name__


def error_class(text: str) -> str:
    """The class of an error summary ('builtins.ValueError: bad input' -> 'ValueError'),
    without its message: what a user without PAYLOAD_PERMISSION sees of an error."""
    kind = (text.splitlines() or [""])[0].partition(": ")[0].strip()
    if not kind or " " in kind:
        return str(_("an error (its message is hidden)"))
    return kind.rpartition(".")[2]


def hidden(what: str | _StrPromise) -> str:
    """What stands in for a payload a user may not see."""
    return format_html('<span class="skipqueue-hidden">{}</span>', what)


class OnePage:
    """An admin index entry whose one URL is its changelist view, a page of ours: the
    models behind such entries are proxies of Job, whose own change page would show a
    job's fields unredacted. Viewing it takes the permission to view jobs."""

    def get_urls(self) -> list[Any]:
        page = self.admin_site.admin_view(self.changelist_view)  # type: ignore[attr-defined]
        info = self.opts.app_label, self.opts.model_name  # type: ignore[attr-defined]
        return [path("", page, name="%s_%s_changelist" % info)]  # noqa: UP031

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm("skipqueue.view_job")


class ReadOnly:
    """Rows are never added, edited or deleted from our admin: operators act through the
    guarded verbs (actions), and the rows are written by the protocol only."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def as_id(text: str) -> int | None:
    """`text` as a row id if it is one: ASCII digits that fit a bigint (`"²".isdigit()`
    is true, and Python refuses to read 5,000 digits), else None."""
    if text.isascii() and text.isdigit() and len(text) <= 18:
        return int(text)
    return None


def arguments_html(args: Any, kwargs: Any, task_name: str = "", skipped: int = 0) -> str:
    """A job's or a schedule's arguments as every page of ours shows them: redacted, and
    a positional argument masked where its parameter's name looks secret, as the same
    value passed by keyword is (`skipped`: the parameters a workflow's inputs fill)."""
    if not shows_payloads():
        positional = ", ".join(shape(item) for item in args) if isinstance(args, list) else "?"
        named = (
            ", ".join(f"{name}: {shape(item)}" for name, item in kwargs.items())
            if isinstance(kwargs, dict)
            else "?"
        )
        return hidden(f"({positional}) {{{named}}}")
    task = registry.get(task_name) if task_name in registry else None
    names = task.positional_names[skipped:] if task is not None else ()
    data = redact_call(args, kwargs, names)
    return format_html("<pre>{}</pre>", json.dumps(data, indent=2, ensure_ascii=False, default=str))


def inputs_before_args(job: Job) -> int:
    """How many parameters a workflow job's inputs fill before its own `args` (see
    Workflow.objects.inputs_of): its parents' results (1), or an on_error job's failed
    job and error (2); 0 for any other job."""
    inputs = job.inputs
    if not inputs or not isinstance(inputs, dict):
        return 0
    return 2 if inputs.get("failure") else 1


def attempts_text(job: Job) -> str:
    """Attempts spent of those allowed: an attempt given back (a release) is neither, so
    a 5-attempt job released once and claimed again shows 1/5, not 2/6."""
    given_back = job.releases or 0
    text = f"{job.attempts - given_back}/{job.max_attempts - given_back}"
    if job.expirations:
        text += " " + str(_("(%(n)d expired)") % {"n": job.expirations})
    return text


def short_error(text: str) -> str:
    """The first line of an error summary with the class named without its module:
    'builtins.ValueError: bad input' reads 'ValueError: bad input'. Text that does not
    start with a dotted class path is left as it is."""
    first = (text.splitlines() or [""])[0]
    kind, sep, message = first.partition(": ")
    if kind and " " not in kind and "." in kind.strip("."):
        kind = kind.rstrip(".").rpartition(".")[2]
    return f"{kind}{sep}{message}"


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


def moment(name: str, label: str | _StrPromise) -> Any:
    """A read-only field or column that shows the datetime field `name` as every time
    on these pages is shown (`_when`), sortable by it. Django's own display of a
    datetime field follows DATETIME_FORMAT ("Dec. 7, 2026, 5:03 p.m."): beside ours it
    made three formats across the pages (issue 54)."""

    @admin.display(description=label, ordering=name)
    def shown(self: Any, obj: Any) -> str:
        return _when(getattr(obj, name))

    return shown


def _parse_time(value: object) -> datetime | None:
    try:
        moment = datetime.fromisoformat(str(value))
        if not timezone.is_aware(moment):
            return None
        timezone.localtime(moment)  # 9999-12-31 at -14:00 has no local time here
        return moment
    except (ValueError, OverflowError):  # another client's text, or out of range here
        return None


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
