"""A failed or cancelled job's page: the banner that says what happened, and its order."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db.models.functions import Now
from django.urls import reverse
from django.utils import timezone

from django_skipqueue.admin.common import short_error
from django_skipqueue.maintenance.reaper import Reaper
from django_skipqueue.models import Job, JobState
from django_skipqueue.runtime.worker import Worker
from tests.factories import JobFactory
from tests.testapp.tasks import add, always_fails

pytestmark = pytest.mark.django_db

CHANGE = "admin:skipqueue_job_change"


@pytest.fixture
def superuser_client(client):
    client.force_login(User.objects.create_superuser("root", "r@example.com", "pw"))
    return client


def run_until_failed(job: Job, timeout: float = 20.0) -> Job:
    """Burst workers until `job` has failed (its retries are due a few ms apart)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        Worker(concurrency=1, burst=True, listen=False, reap_interval=0).run()
        job.refresh_from_db()
        if job.state == JobState.FAILED:
            return job
        time.sleep(0.02)  # its next attempt is due in 10-50 ms
    raise AssertionError(f"job {job.id} did not fail within {timeout}s: {job.state}")


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("builtins.ValueError: bad input", "ValueError: bad input"),
        (
            "shop.errors.PaymentDeclined: card 4242 declined\nTraceback",
            "PaymentDeclined: card 4242 declined",
        ),
        ("RuntimeError: boom", "RuntimeError: boom"),
        ("expired: not started by 2026-01-01", "expired: not started by 2026-01-01"),
        ("builtins.KeyError", "KeyError"),
        ("", ""),
    ],
)
def test_an_error_is_named_by_its_class_without_its_module(text, shown):
    assert short_error(text) == shown


@pytest.mark.django_db(transaction=True)
def test_a_failed_jobs_page_opens_with_its_error_and_its_retry_button(superuser_client):
    job = run_until_failed(always_fails.using(max_attempts=3).enqueue("bad input"))
    page = superuser_client.get(reverse(CHANGE, args=[job.id]))
    html = page.content.decode()
    assert page.context["skipqueue_failed"] == "Failed after 3 attempts: RuntimeError: bad input"
    banner = html.index("skipqueue-failed-banner")
    retry = reverse("admin:skipqueue_job_act", args=[job.id, "retry"])
    assert html.index(f'action="{retry}" class="skipqueue-banner-act"') > banner


@pytest.mark.django_db(transaction=True)
def test_a_failed_jobs_errors_come_right_after_its_banner(superuser_client):
    job = run_until_failed(always_fails.using(max_attempts=2).enqueue("bad input"))
    html = superuser_client.get(reverse(CHANGE, args=[job.id])).content.decode()
    banner = html.index("skipqueue-failed-banner")
    errors = html.index("Errors, newest first")
    assert banner < errors < html.index("field-task") < html.index("field-timeline")
    assert html.count("field-error_history") == 1  # moved, not shown twice
    assert html.index("attempt 2 at") < html.index("attempt 1 at")  # newest first


def test_a_pending_jobs_page_keeps_its_errors_in_its_history(superuser_client):
    job = JobFactory(errors=[{"attempt": 1, "at": "x", "type": "E", "message": "m"}])
    html = superuser_client.get(reverse(CHANGE, args=[job.id])).content.decode()
    assert "Errors, newest first" not in html and "skipqueue-failed-banner" not in html
    assert html.index("field-timeline") < html.index("field-error_history")


def test_the_banner_shows_the_retry_button_only_to_who_may_retry(client):
    from django.contrib.auth.models import Permission

    job = JobFactory(failed=True)
    user = User.objects.create_user("viewer", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(user)
    page = client.get(reverse(CHANGE, args=[job.id]))
    # Without the payload permission, the error's class only.
    assert page.context["skipqueue_failed"] == "Failed after 5 attempts: RuntimeError"
    assert "skipqueue-banner-act" not in page.content.decode()


def test_the_banner_counts_the_attempts_spent_not_those_given_back(superuser_client):
    job = JobFactory(failed=True, attempts=3, releases=2, last_error="builtins.OSError: disk")
    page = superuser_client.get(reverse(CHANGE, args=[job.id]))
    assert page.context["skipqueue_failed"] == "Failed after 1 attempt: OSError: disk"


def test_the_changelist_shows_the_errors_message_without_the_module_path(superuser_client):
    job = JobFactory(failed=True, last_error="builtins.ValueError: bad input\nmore")
    html = superuser_client.get(reverse("admin:skipqueue_job_changelist")).content.decode()
    assert ">ValueError: bad input</small>" in html
    assert 'title="builtins.ValueError: bad input\nmore"' in html  # the whole text on hover
    assert f"/{job.id}/change/" in html


def test_a_cancelled_jobs_page_says_who_cancelled_it_and_when(superuser_client):
    job = JobFactory()
    assert Job.objects.cancel([job.id], by="alice") == 1
    job.refresh_from_db()
    page = superuser_client.get(reverse(CHANGE, args=[job.id]))
    when = timezone.localtime(job.finished_at).strftime("%Y-%m-%d %H:%M:%S")
    assert page.context["skipqueue_cancelled"] == f"Cancelled by alice at {when}."
    assert "skipqueue-cancelled-banner" in page.content.decode()
    assert "skipqueue-banner-act" in page.content.decode()  # Retry applies to it


def test_a_done_job_whose_cancel_came_too_late_says_who_asked(superuser_client):
    """A keyed job keeps its lease until its code returns; a cancel it never read leaves
    it done, its cancelled_by kept: its page said nothing of the cancel (outside trial)."""
    job = JobFactory(state=JobState.DONE, cancelled_by="carol")
    page = superuser_client.get(reverse(CHANGE, args=[job.id]))
    assert page.context["skipqueue_cancelled"] == (
        "Done, though carol asked it to stop: its task finished first."
    )


def test_a_job_that_expired_before_it_started_says_so_in_words(superuser_client):
    job = add.using(expires=timedelta(milliseconds=1)).enqueue(1, 2)
    Job.objects.filter(id=job.id).update(expires_at=Now() - timedelta(seconds=1))
    Reaper().reap()
    job.refresh_from_db()
    assert (job.state, job.cancelled_by) == (JobState.CANCELLED, "skipqueue:expired")
    text = superuser_client.get(reverse(CHANGE, args=[job.id])).context["skipqueue_cancelled"]
    assert text.startswith("Expired before it started: it was not started by its expiry time")
    assert "skipqueue:expired" not in text and "the reaper ended it at" in text


def test_a_job_cancelled_from_code_without_a_name_says_that(superuser_client):
    job = JobFactory()
    Job.objects.cancel([job.id])
    text = superuser_client.get(reverse(CHANGE, args=[job.id])).context["skipqueue_cancelled"]
    assert text.startswith("Cancelled at ") and "named no one" in text
