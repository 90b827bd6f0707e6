"""A durable job's steps on its admin page (docs/howto/durable-jobs.md): each recorded
step, its kind, the attempt that recorded it and when, its result under the payload
permission, whether the job sleeps, and the buttons that restart it from a step."""

from __future__ import annotations

import json
from contextvars import ContextVar
from datetime import datetime, timedelta

from django.db.models.functions import Now
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.translation import gettext as _

from django_skipqueue.admin.common import _age, _when, hidden, shape, shows_payloads
from django_skipqueue.core.redaction import redact
from django_skipqueue.core.states import JobState
from django_skipqueue.models import Job, Step, StepKind

#: The most steps a job's page lists (the newest are shown past it).
STEPS_SHOWN = 200

#: The id of the form the restart buttons post: the job page's template draws it outside
#: the change form (a form may not be nested in another), and the buttons name it.
RESTART_FORM = "skipqueue-restart"

#: RESTART_FORM while a page whose user may restart the job is drawn, else "".
restart_form: ContextVar[str] = ContextVar("skipqueue_restart_form", default="")

#: The states a job may be restarted from a step in (Job.objects.restart_from_step).
RESTARTABLE = (JobState.FAILED, JobState.CANCELLED, JobState.PENDING)


def steps_html(job: Job) -> str:
    steps = list(
        Step.objects.using(job._state.db)
        .filter(job_id=job.id)
        .annotate(db_now=Now())
        .order_by("-position")[:STEPS_SHOWN]
    )[::-1]
    if not steps:
        return "-"
    form = restart_form.get() if job.state in RESTARTABLE else ""
    rows = format_html_join("", "{}", ((_row(step, form),) for step in steps))
    return format_html(
        '{}<table class="skipqueue-steps"><thead><tr><th>#</th><th>{}</th><th>{}</th>'
        "<th>{}</th><th>{}</th><th>{}</th>{}</tr></thead><tbody>{}</tbody></table>",
        _status(job, steps[-1]),
        _("step"),
        _("kind"),
        _("attempt"),
        _("recorded"),
        _("result"),
        mark_safe("<th></th>") if form else "",  # noqa: S308  (a constant)
        rows,
    )


def _named(step: Step) -> str:
    """A step's name, with its occurrence when it repeats (`page #2`)."""
    return step.name if step.occurrence == 1 else f"{step.name} #{step.occurrence}"


def _row(step: Step, form: str) -> str:
    name = _named(step)
    took = (step.recorded_at - step.started_at).total_seconds()
    button = (
        format_html(
            '<td><button type="submit" form="{}" name="position" value="{}" class="button" '
            'title="{}">{}</button></td>',
            form,
            step.position,
            _("Drop this step's record and the later ones, and run the job again from here"),
            _("Restart here"),
        )
        if form
        else ""
    )
    return format_html(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code> ({})</td>"
        "<td>{}</td>{}</tr>",
        step.position,
        name,
        StepKind(step.kind).label if step.kind in StepKind.values else step.kind,
        step.attempt,
        _when(step.recorded_at),
        _("took %(t)s") % {"t": f"{took:.3f} s"},
        _result(step),
        button,
    )


def _result(step: Step) -> str:
    if step.kind == StepKind.SLEEP:
        return _("a sleep of %(t)s") % {"t": _age(_slept(step))}
    if step.kind == StepKind.SIGNAL:
        return _waited(step)
    if step.result is None:
        return "-"
    if not shows_payloads():
        return hidden(shape(step.result))
    return format_html("<code>{}</code>", json.dumps(redact(step.result))[:500])


def _waited(step: Step) -> str:
    """A wait's outcome: waiting (its timeout), received (the payload, under the
    permission) or timed out."""
    result = step.result if isinstance(step.result, dict) else {}
    outcome = result.get("outcome")
    timeout = result.get("timeout")
    within = _("no timeout") if timeout is None else _age(timedelta(seconds=float(timeout)))
    if outcome == "received":
        payload = result.get("payload")
        shown = (
            format_html("<code>{}</code>", json.dumps(redact(payload))[:500])
            if shows_payloads()
            else hidden(shape(payload))
        )
        return format_html("{} {}", _("received:"), shown)
    if outcome == "timed out":
        return _("timed out (%(t)s)") % {"t": within}
    return _("waiting (%(t)s)") % {"t": within}


def _deadline(step: Step) -> datetime | None:
    """A wait's timeout as a time (its record's time plus the timeout), or None."""
    timeout = step.result.get("timeout") if isinstance(step.result, dict) else None
    return None if timeout is None else step.recorded_at + timedelta(seconds=float(timeout))


def kept_signals_html(job: Job) -> str:
    """The signals sent to the job that no wait has taken yet (oldest first): name, when
    sent, and the payload under the permission."""
    signals = list(job.signals.using(job._state.db).order_by("id")[:STEPS_SHOWN])
    if not signals:
        return "-"
    rows = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
        (
            (
                signal.name,
                _when(signal.sent_at),
                format_html("<code>{}</code>", json.dumps(redact(signal.payload))[:500])
                if shows_payloads()
                else hidden(shape(signal.payload)),
            )
            for signal in signals
        ),
    )
    return format_html(
        '<table class="skipqueue-steps"><thead><tr><th>{}</th><th>{}</th><th>{}</th></tr>'
        "</thead><tbody>{}</tbody></table>",
        _("signal"),
        _("sent"),
        _("payload"),
        rows,
    )


def _slept(step: Step) -> timedelta:
    """A sleep step's length, as its record holds it (`{"seconds": ...}`)."""
    seconds = step.result.get("seconds", 0) if isinstance(step.result, dict) else 0
    return timedelta(seconds=float(seconds))


def _status(job: Job, last: Step) -> str:
    """Whether the job sleeps, and until when, or which step it is past."""
    if last.kind == StepKind.SLEEP and job.state == JobState.PENDING:
        wake = last.recorded_at + _slept(last)
        if wake > last.db_now:  # type: ignore[attr-defined]
            return format_html(
                '<p class="skipqueue-sleeping">{}</p>',
                _("Sleeping (%(name)s) until %(when)s: in %(left)s.")
                % {
                    "name": _named(last),
                    "when": _when(wake),
                    "left": _age(wake - last.db_now),  # type: ignore[attr-defined]
                },
            )
    waiting = isinstance(last.result, dict) and last.result.get("outcome") == "waiting"
    if last.kind == StepKind.SIGNAL and waiting and job.state == JobState.PENDING:
        deadline = _deadline(last)
        return format_html(
            '<p class="skipqueue-sleeping">{}</p>',
            _("Waiting for the signal %(name)s, without a timeout.") % {"name": last.name}
            if deadline is None
            else _("Waiting for the signal %(name)s until %(when)s.")
            % {"name": last.name, "when": _when(deadline)},
        )
    if job.state == JobState.RUNNING:
        return format_html(
            "<p>{}</p>",
            _("Running the step after step %(n)s (%(name)s).")
            % {"n": last.position, "name": last.name},
        )
    return ""
