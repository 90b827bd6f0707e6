"""The schedules in the admin and `manage.py schedules`: read-only, pause under its own
permission, next occurrences, and the jobs of each occurrence."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.db.models.functions import Now
from django.test import override_settings
from django.urls import reverse

from django_skipqueue.maintenance.scheduler import defined_schedules, sync, tick
from django_skipqueue.models import Job, Schedule
from tests.testapp.tasks import add, send_invoice

pytestmark = pytest.mark.django_db

SCHEDULES = {
    "SCHEDULES": {
        "every-second": {"task": add.name, "cron": "* * * * * *", "args": [1, 2]},
        "nightly": {
            "task": add.name,
            "cron": "30 2 * * *",
            "args": [3, 4],
            "timezone": "Europe/Paris",
        },
    }
}
CHANGELIST = "admin:skipqueue_schedule_changelist"


@pytest.fixture
def synced():
    with override_settings(SKIPQUEUE=SCHEDULES):
        defined = defined_schedules()
    sync(defined, database="default")
    Schedule.objects.filter(name="every-second").update(last_occurrence_at=Now())
    return defined


def staff_with(client, *codenames: str):
    user = User.objects.create_user("staff", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(user)
    return client


def pause_action(client, names: list[str]):
    return client.post(
        reverse(CHANGELIST), {"action": "pause", "_selected_action": names}, follow=True
    )


def test_the_schedule_pages_show_next_runs_and_the_jobs_of_recent_occurrences(client, synced):
    import time

    time.sleep(1.1)
    tick(synced, database="default")
    job = Job.objects.filter(schedule="every-second").latest("scheduled_for")
    viewer = staff_with(client, "view_schedule", "view_job")
    page = viewer.get(reverse(CHANGELIST)).content.decode()
    assert "every-second" in page and "30 2 * * *" in page and "Europe/Paris" in page
    detail = viewer.get(reverse("admin:skipqueue_schedule_change", args=["every-second"]))
    content = detail.content.decode()
    assert reverse("admin:skipqueue_job_change", args=[job.id]) in content
    jobs_page = viewer.get(reverse("admin:skipqueue_job_changelist") + "?schedule=every-second")
    assert jobs_page.status_code == 200 and f">{job.id}<" in jobs_page.content.decode()
    job_page = viewer.get(reverse("admin:skipqueue_job_change", args=[job.id])).content.decode()
    assert "?schedule=every-second" in job_page


def test_pausing_needs_its_own_permission(client, synced):
    viewer = staff_with(client, "view_schedule")
    assert '<option value="pause"' not in viewer.get(reverse(CHANGELIST)).content.decode()
    pause_action(viewer, ["nightly"])  # a forged POST
    assert not Schedule.objects.get(name="nightly").is_paused

    user = User.objects.get(username="staff")
    user.user_permissions.add(Permission.objects.get(codename="pause_schedule"))
    client.force_login(user)
    response = pause_action(client, ["nightly"])
    assert "1 schedule(s) paused" in response.content.decode()
    paused = Schedule.objects.get(name="nightly")
    assert paused.is_paused and paused.paused_by == "staff"


def test_the_list_filters_active_or_paused_schedules_in_those_words(admin_client, synced):
    Schedule.objects.pause(["nightly"], by="ops")
    page = admin_client.get(reverse(CHANGELIST)).content.decode()
    assert "By status" in page and ">Active<" in page and ">Paused<" in page
    assert "paused at" not in page.lower()  # Django's "By paused at: Empty / Not empty"
    paused = admin_client.get(reverse(CHANGELIST) + "?status=paused")
    assert [s.name for s in paused.context["cl"].result_list] == ["nightly"]
    active = admin_client.get(reverse(CHANGELIST) + "?status=active")
    assert "nightly" not in [s.name for s in active.context["cl"].result_list]


def test_schedules_cannot_be_added_edited_or_deleted_in_the_admin(admin_client, synced):
    assert admin_client.get(reverse("admin:skipqueue_schedule_add")).status_code == 403
    admin_client.post(
        reverse("admin:skipqueue_schedule_change", args=["nightly"]), {"expression": "* * * * *"}
    )
    admin_client.post(
        reverse(CHANGELIST), {"action": "delete_selected", "_selected_action": ["nightly"]}
    )
    assert Schedule.objects.get(name="nightly").expression == "30 2 * * *"


def test_a_unique_job_shows_its_key(admin_client):
    job = send_invoice.enqueue(5)
    page = admin_client.get(reverse("admin:skipqueue_job_change", args=[job.id]))
    assert "invoice_id=5" in page.content.decode()
    assert (
        "key invoice_id=5"
        in admin_client.get(reverse("admin:skipqueue_job_changelist")).content.decode()
    )


def test_the_schedules_command_lists_last_and_next_occurrences(synced):
    out = StringIO()
    with override_settings(SKIPQUEUE=SCHEDULES):
        call_command("schedules", "--json", stdout=out)
    rows = {row["name"]: row for row in json.loads(out.getvalue())["schedules"]}
    assert rows["every-second"]["state"] == "active"
    assert rows["every-second"]["last_occurrence_at"] is not None
    assert rows["nightly"]["next_occurrence_at"].endswith(("T00:30:00+00:00", "T01:30:00+00:00"))


def test_the_schedules_command_pauses_resumes_and_names_unknown_ones(synced):
    out = StringIO()
    with override_settings(SKIPQUEUE=SCHEDULES):
        call_command("schedules", "--pause", "nightly", stdout=out)
        assert Schedule.objects.get(name="nightly").is_paused
        assert "paused" in out.getvalue() and "nightly" in out.getvalue()
        call_command("schedules", "--resume", "nightly", stdout=out)
        assert not Schedule.objects.get(name="nightly").is_paused
        with pytest.raises(CommandError, match="no schedule named 'nightlyy'"):
            call_command("schedules", "--pause", "nightlyy", stdout=out)


def test_a_schedule_gone_from_the_code_is_listed_as_such_until_a_worker_deletes_it(synced):
    out = StringIO()
    call_command("schedules", "--json", stdout=out)  # this code has no schedules
    states = {row["name"]: row["state"] for row in json.loads(out.getvalue())["schedules"]}
    assert states == {"every-second": "removed from code", "nightly": "removed from code"}


# -- trial finding 16: the schedule admin offers its own filters only, and masks -----------

SECRETS = {
    "args": ["postgres://u:pw-in-url@h/db", "Authorization: Bearer tok-in-header"],
    "kwargs": {"password": "hunter2", "note": "keep me"},
}


@pytest.fixture
def viewer(client):
    """A view-only staff user: the attacker of the trial."""
    return staff_with(client, "view_schedule")


@pytest.fixture
def secretive():
    return Schedule.objects.create(
        name="secretive",
        task=add.name,
        expression="* * * * *",
        timezone="UTC",
        queue_name="default",
        **SECRETS,
    )


@pytest.mark.parametrize(
    "query",
    [
        "kwargs__password__startswith=h",
        "kwargs__password=hunter2",
        "args__0__startswith=p",
        "task__regex=(a",
        "name__regex=(a",
        "expression__contains=*",
        "paused_by=x",
    ],
)
def test_a_lookup_the_schedule_list_does_not_offer_is_refused_with_a_400(viewer, secretive, query):
    response = viewer.get(reverse(CHANGELIST) + "?" + query)
    assert response.status_code == 400
    assert b"hunter2" not in response.content


def test_a_masked_schedule_argument_cannot_be_probed_one_character_at_a_time(viewer, secretive):
    answers = {
        viewer.get(reverse(CHANGELIST) + f"?kwargs__password__startswith={c}").status_code
        for c in "abcdefghijklmnopqrstuvwxyz"
    }
    assert answers == {400}


@pytest.mark.parametrize(
    "query",
    [
        "q=%00",
        "q=a%00b",
        "name=a%00b",
        "paused_at__isempty=%00",
        "paused_at__isempty=7",
        "status=%00",
        "status=nonsense",
        "o=99",
        "p=abc",
        "_to_field=kwargs",
    ],
)
def test_a_bad_query_string_on_the_schedule_list_is_a_400_or_a_page_never_a_500(
    viewer, secretive, query
):
    viewer.raise_request_exception = False
    response = viewer.get(reverse(CHANGELIST) + "?" + query)
    assert response.status_code in (200, 302, 400), response.status_code


@pytest.mark.parametrize("view", ["change", "history", "delete"])
def test_a_schedule_name_holding_nul_in_the_url_is_not_a_500(viewer, view):
    viewer.raise_request_exception = False
    response = viewer.get(reverse(f"admin:skipqueue_schedule_{view}", args=["a\x00b"]))
    assert response.status_code in (302, 403, 404), response.status_code


def test_a_schedules_page_masks_its_arguments_as_a_jobs_page_does(client, secretive):
    viewer = staff_with(client, "view_schedule", "view_job_payload")
    page = viewer.get(reverse("admin:skipqueue_schedule_change", args=["secretive"]))
    text = page.content.decode()
    assert page.status_code == 200
    for secret in ("pw-in-url", "tok-in-header", "hunter2"):
        assert secret not in text
    assert "keep me" in text and "postgres://u:***@h/db" in text


def test_a_schedule_and_a_job_with_the_same_arguments_show_the_same_text(secretive):
    from django.contrib import admin

    from tests.factories import JobFactory

    job = JobFactory(**SECRETS)
    shown_by_job = admin.site._registry[Job].pretty_args(job)
    assert admin.site._registry[Schedule].pretty_args(secretive) == shown_by_job


def test_a_schedule_row_python_cannot_load_is_shown(admin_client, synced):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE skipqueue_schedule SET last_occurrence_at = 'infinity', "
            "paused_at = '-infinity' WHERE name = 'nightly'"
        )

    assert admin_client.get(reverse(CHANGELIST)).status_code == 200
    out = StringIO()
    call_command("schedules", stdout=out)
    assert "nightly" in out.getvalue()


def test_the_list_shows_the_next_three_runs_in_the_schedules_own_zone(admin_client, synced):
    page = admin_client.get(reverse(CHANGELIST))
    html = page.content.decode()
    assert "Last and next runs (in the schedule&#x27;s time zone)" in html
    [nightly] = [s for s in page.context["cl"].result_list if s.name == "nightly"]
    cell = page.context["cl"].model_admin.next_runs(nightly)
    runs = cell.split('class="skipqueue-runs"', 1)[1].split(">", 1)[1].split("</span>")[0]
    assert len(runs.split("<br>")) == 3
    assert all(run.endswith(" 02:30:00") for run in runs.split("<br>"))  # Paris, not UTC
    assert "<small>Europe/Paris · every day</small>" in cell
    assert 'title="next runs ' in cell  # the sentence of `manage.py schedules`, on hover
