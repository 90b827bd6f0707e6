"""The words of a job's page: its progress bar, and the banners of a failed or a
cancelled job (the errors masked as everywhere in the admin)."""

from __future__ import annotations

from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from django_skipqueue.admin.common import (
    _entries,
    _when,
    error_class,
    short_error,
    shows_payloads,
)
from django_skipqueue.core.redaction import redact, redact_text
from django_skipqueue.core.states import EXPIRED, UNNEEDED, UPSTREAM
from django_skipqueue.models import Job


def progress_html(job: Job) -> str:
    """A bar and the words of a job's last progress report ("" if it made none)."""
    text = job.describe_progress()
    if not text:
        return ""
    fraction = job.progress_fraction
    bar = (
        format_html('<progress max="100" value="{}"></progress> ', round(fraction * 100))
        if fraction is not None
        else ""
    )
    return format_html('<div class="skipqueue-progress">{}{}</div>', bar, text)


def failed_headline(job: Job) -> str:
    """'Failed after 3 attempts: ValueError: bad input': a failed job's banner (the
    attempts spent, as the list counts them; the class without its module path)."""
    spent = job.attempts - (job.releases or 0)
    if not shows_payloads():
        error = error_class(job.last_error) if job.last_error else ""
    else:
        error = short_error(redact_text(job.last_error)[:2000]) if job.last_error else ""
    if not error:
        entries = _entries(job.errors)
        if entries:
            last = entries[-1]
            message = redact(last.get("message")) if shows_payloads() else "(hidden)"
            error = short_error(f"{last.get('type')}: {message}")
    if len(error) > 500:
        error = error[:500] + "…"
    text = ngettext("Failed after %(n)d attempt", "Failed after %(n)d attempts", spent) % {
        "n": spent
    }
    return f"{text}: {error}" if error else text


def cancelled_headline(job: Job) -> str:
    """Who cancelled the job and when, in words (the reserved names of our own ends
    said as what happened)."""
    when = _when(job.finished_at)
    if job.cancelled_by == EXPIRED:
        return _(
            "Expired before it started: it was not started by its expiry time (%(expires)s), "
            "so it never ran; the reaper ended it at %(when)s."
        ) % {"expires": _when(job.expires_at), "when": when}
    if job.cancelled_by == UPSTREAM:
        return _(
            "Cancelled at %(when)s by its workflow: a job it waits on failed or was "
            "cancelled. Retrying that job runs this one again."
        ) % {"when": when}
    if job.cancelled_by == UNNEEDED:
        return _(
            "Cancelled at %(when)s by its workflow: it runs only when the workflow fails, "
            "and the workflow succeeded."
        ) % {"when": when}
    if job.cancelled_by:
        text = _("Cancelled by %(who)s at %(when)s.") % {"who": job.cancelled_by, "when": when}
    else:
        text = _("Cancelled at %(when)s, from code that named no one (cancel() without by=).") % {
            "when": when
        }
    if job.cancel_requested_at is not None:
        text += " " + _("It was running and was asked to stop at %(asked)s.") % {
            "asked": _when(job.cancel_requested_at)
        }
    return str(text)
