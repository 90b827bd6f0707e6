"""The admin and queuestats: render, permissions, actions that leave changed rows alone."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from urllib.parse import quote

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.db import connection
from django.db.models.functions import Now
from django.urls import reverse

from django_skipqueue.models import Job, JobState, WorkerProcess
from tests.factories import BULK_BATCH, JobFactory
from tests.guard import setting_up

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:skipqueue_job_changelist"


@pytest.fixture
def superuser_client(client):
    client.force_login(User.objects.create_superuser("root", "r@example.com", "pw"))
    return client


def staff(client, *perms: str):
    user = User.objects.create_user("staff", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_job"))
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(user)
    return client


def test_pages_render_for_a_superuser(superuser_client):
    job = JobFactory(
        failed=True,
        errors=[
            {"attempt": 1, "at": "x", "type": "E", "message": "m", "traceback": "Traceback (boom)"}
        ],
        kwargs={"password": "hunter2"},
    )
    JobFactory(expired=True)
    WorkerProcess.objects.create(hostname="h", pid=1, queues=["default"])
    for url in [
        reverse(CHANGELIST),
        reverse(CHANGELIST) + "?health=stuck",
        reverse(CHANGELIST) + "?health=repeatedly_expired",
        reverse(CHANGELIST) + "?health=scheduled",
        reverse(CHANGELIST) + "?q=add",
        reverse("admin:skipqueue_job_change", args=[job.id]),
        reverse("admin:skipqueue_overview"),
        reverse("admin:skipqueue_workerprocess_changelist"),
    ]:
        response = superuser_client.get(url)
        assert response.status_code == 200, url
    detail = superuser_client.get(reverse("admin:skipqueue_job_change", args=[job.id]))
    assert b"Traceback (boom)" in detail.content
    assert b"hunter2" not in detail.content  # redacted
    done = JobFactory(state="done", result={"api_key": "s3cr3t-value", "sent": 3})  # S14
    detail = superuser_client.get(reverse("admin:skipqueue_job_change", args=[done.id]))
    assert b"s3cr3t-value" not in detail.content and b"sent" in detail.content
    assert b"Trends per queue" in superuser_client.get(reverse("admin:skipqueue_overview")).content


def test_anonymous_users_are_sent_to_the_login_page(client):
    for url in [reverse(CHANGELIST), reverse("admin:skipqueue_overview")]:
        response = client.get(url)
        assert response.status_code == 302 and "/login/" in response["Location"]


def test_staff_without_view_permission_are_refused(client):
    client.force_login(User.objects.create_user("nobody", is_staff=True))
    assert client.get(reverse(CHANGELIST)).status_code == 403
    assert client.get(reverse("admin:skipqueue_overview")).status_code == 403


def test_the_stuck_filter_shows_only_expired_running_jobs(superuser_client):
    stuck, live = JobFactory(expired=True), JobFactory(running=True)
    response = superuser_client.get(reverse(CHANGELIST) + "?health=stuck")
    ids = [job.id for job in response.context["cl"].result_list]
    assert ids == [stuck.id] and live.id not in ids


def test_the_expired_filter_and_badge_show_jobs_that_expired_before_they_started(
    superuser_client,
):
    from django.utils import timezone

    from django_skipqueue.maintenance.reaper import Reaper
    from tests.testapp.tasks import add

    late = add.using(expires=timezone.now() - timedelta(seconds=1)).enqueue(1, 2)
    cancelled = JobFactory(state=JobState.CANCELLED, cancelled_by="ops")
    Reaper().reap()
    response = superuser_client.get(reverse(CHANGELIST) + "?health=expired")
    assert [job.id for job in response.context["cl"].result_list] == [late.id]
    assert cancelled.id != late.id
    assert "expired</b>" in response.content.decode()
    page = superuser_client.get(reverse("admin:skipqueue_job_change", args=[late.id]))
    assert page.status_code == 200 and "Expires at" in page.content.decode()
    rated = tasks_rated().enqueue(1)
    page = superuser_client.get(reverse("admin:skipqueue_job_change", args=[rated.id]))
    assert "Rate limit" in page.content.decode() and "3/m" in page.content.decode()


def tasks_rated():
    from tests.testapp.tasks import three_a_minute

    return three_a_minute


def act(client, action: str, ids: list[int]):
    return client.post(
        reverse(CHANGELIST), {"action": action, "_selected_action": ids}, follow=True
    )


def test_retry_now_moves_failed_jobs_back_and_skips_others(superuser_client):
    failed, done = JobFactory(failed=True), JobFactory(done=True)
    response = act(superuser_client, "retry_now", [failed.id, done.id])
    failed.refresh_from_db()
    assert (failed.state, failed.max_attempts) == (JobState.PENDING, 6)
    assert Job.objects.get(id=done.id).state == JobState.DONE
    assert "1 job(s) retried; 1 skipped (not failed or cancelled" in response.content.decode()


def test_cancel_ends_pending_jobs_and_asks_running_ones_to_stop(superuser_client):
    pending, claimed, done = JobFactory(), JobFactory(), JobFactory(state=JobState.DONE)
    Job.objects.filter(id=claimed.id).update(state=JobState.RUNNING)  # a worker got there first
    response = act(superuser_client, "cancel", [pending.id, claimed.id, done.id])
    assert Job.objects.get(id=pending.id).state == JobState.CANCELLED
    running = Job.objects.get(id=claimed.id)
    assert running.state == JobState.RUNNING  # its task is told; the worker ends it
    assert running.cancel_requested_at is not None and running.cancelled_by == "root"
    assert "2 job(s) cancelled or asked to stop; 1 skipped" in response.content.decode()
    page = superuser_client.get(reverse("admin:skipqueue_job_change", args=[claimed.id]))
    assert "Cancel requested" in page.content.decode()


def test_a_queue_is_paused_from_the_overview_under_its_own_permission(client):
    from django_skipqueue.models import Queue

    JobFactory()
    viewer = staff(client)
    overview = reverse("admin:skipqueue_overview")
    assert 'value="Pause"' not in viewer.get(overview).content.decode()
    pause = reverse("admin:skipqueue_queue_act", args=["pause"])
    assert viewer.post(pause, {"queue": "default"}).status_code == 403
    assert not Queue.objects.paused().exists()
    user = User.objects.get(username="staff")
    user.user_permissions.add(Permission.objects.get(codename="pause_queue"))
    client.force_login(user)
    assert client.get(pause).status_code == 405  # POST only
    client.post(pause, {"queue": "default", "confirm": "yes"})
    assert Queue.objects.get(name="default").paused_by == "staff"
    page = client.get(overview).content.decode()
    assert ">paused<" in page and 'value="Resume"' in page
    client.post(reverse("admin:skipqueue_queue_act", args=["resume"]), {"queue": "default"})
    assert not Queue.objects.paused().exists()


def test_requeue_takes_back_stuck_jobs_only(superuser_client):
    stuck, live = JobFactory(expired=True), JobFactory(running=True)
    act(superuser_client, "requeue", [stuck.id, live.id])
    stuck.refresh_from_db()
    assert (stuck.state, stuck.expirations) == (JobState.PENDING, 1)
    assert Job.objects.get(id=live.id).state == JobState.RUNNING


@pytest.mark.parametrize(
    ("action", "perm"),
    [("retry_now", "retry_job"), ("cancel", "cancel_job"), ("requeue", "requeue_job")],
)
def test_an_action_needs_its_own_permission(client, action, perm):
    job = (
        JobFactory(failed=True)
        if action == "retry_now"
        else (JobFactory() if action == "cancel" else JobFactory(expired=True))
    )
    before = Job.objects.get(id=job.id).state
    viewer = staff(client)
    page = viewer.get(reverse(CHANGELIST))
    assert f'<option value="{action}"' not in page.content.decode()
    act(viewer, action, [job.id])  # a forged POST
    assert Job.objects.get(id=job.id).state == before

    user = User.objects.get(username="staff")
    user.user_permissions.add(Permission.objects.get(codename=perm))
    client.force_login(user)
    act(client, action, [job.id])
    assert Job.objects.get(id=job.id).state != before


def test_the_admin_adds_no_jobs_edits_none_and_deletes_none(superuser_client):
    job = JobFactory()
    assert superuser_client.get(reverse("admin:skipqueue_job_add")).status_code == 403
    superuser_client.post(reverse("admin:skipqueue_job_change", args=[job.id]), {"state": "done"})
    assert Job.objects.get(id=job.id).state == JobState.PENDING
    act(superuser_client, "delete_selected", [job.id])
    assert Job.objects.filter(id=job.id).exists()


def test_queuestats_json_matches_a_known_set_of_jobs():
    JobFactory.create_batch(3)
    JobFactory(queue_name="mail")
    JobFactory(run_at=Now() + timedelta(hours=1))
    JobFactory(running=True)
    JobFactory(expired=True, queue_name="mail")
    JobFactory.create_batch(2, failed=True)
    JobFactory.create_batch(4, done=True)
    WorkerProcess.objects.create(hostname="h", pid=1, queues=["default", "mail"])
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    queues = {row["queue"]: row for row in json.loads(out.getvalue())["queues"]}
    default, mail = queues["default"], queues["mail"]
    assert (
        default["pending_due"],
        default["scheduled"],
        default["running"],
        default["stuck"],
        default["failed"],
        default["done_5m"],
        default["done_1h"],
        default["live_workers"],
    ) == (3, 1, 1, 0, 2, 4, 4, 1)
    assert (mail["pending_due"], mail["running"], mail["stuck"], mail["live_workers"]) == (
        1,
        1,
        1,
        1,
    )
    assert default["lag_seconds"] >= 0


def test_queuestats_prints_a_table():
    JobFactory()
    out = StringIO()
    call_command("queuestats", stdout=out)
    assert out.getvalue().splitlines()[0].startswith("queue")
    assert "default" in out.getvalue()


def test_queuestats_prints_a_200_byte_queue_name_on_a_line_of_its_own():
    """Trial finding 11: one long name padded every row of the table to its width."""
    long = "reports.monthly.finance.accounts-receivable." * 4 + "end"
    JobFactory()
    JobFactory(queue_name=long)
    out = StringIO()
    call_command("queuestats", stdout=out)
    lines = out.getvalue().splitlines()
    assert long in lines  # whole, alone: copied into a command as it is
    numbers = lines[lines.index(long) + 1]
    assert numbers.split()[0] == "1"  # its due count, under the header's first numbers
    assert max(len(line) for line in lines if line != long) < 200


# -- issue 12, item 7: the admin accepts only its own filters' lookups -------------------


@pytest.fixture
def viewer(client):
    """A view-only staff user: the attacker of item 7."""
    return staff(client)


@pytest.mark.parametrize(
    "query",
    [
        "kwargs__password__startswith=h",
        "kwargs__password=hunter2",
        "result__token__startswith=s",
        "args__0__startswith=x",
        "errors__0__message__contains=boom",
        "last_error__icontains=boom",
        "kwargs__nested__password__startswith=h",
        "task__regex=(a",
        "id__gt=0",
    ],
)
def test_a_lookup_no_filter_of_ours_uses_is_refused_with_a_400(viewer, query):
    JobFactory(kwargs={"password": "hunter2", "nested": {"password": "hunter2"}}, result=None)
    response = viewer.get(reverse(CHANGELIST) + "?" + query)
    assert response.status_code == 400
    assert b"hunter2" not in response.content


def test_a_redacted_secret_cannot_be_probed_one_character_at_a_time(viewer):
    JobFactory(kwargs={"password": "hunter2"})
    answers = {
        viewer.get(reverse(CHANGELIST) + f"?kwargs__password__startswith={c}").status_code
        for c in "abcdefghijklmnopqrstuvwxyz"
    }
    assert answers == {400}  # the same answer whatever the secret starts with


@pytest.mark.parametrize(
    "query",
    [
        "q=%00",
        "queue=%00",
        "task=a%00b",
        "health=nonsense",
        "state__exact=nonsense",
        "run_at__gte=not-a-date",
        "run_at__gte=2030-13-45",
        "p=abc",
        "p=999999",
        "o=99",
        "o=abc",
        "q=" + "x" * 5000,
        "q=%25%5F%5C",
        "_to_field=kwargs",
        "e=1",
    ],
)
def test_a_bad_query_string_gets_a_400_or_a_page_never_a_500(viewer, query):
    JobFactory(failed=True)
    viewer.raise_request_exception = False
    response = viewer.get(reverse(CHANGELIST) + "?" + query)
    assert response.status_code in (200, 302, 400), response.status_code


def test_every_filter_link_on_the_changelist_works(superuser_client):
    import re

    JobFactory(failed=True)
    JobFactory(expired=True)
    JobFactory(queue_name="other", task="tests.other")
    page = superuser_client.get(reverse(CHANGELIST)).content.decode()
    links = set(re.findall(r'href="(\?[^"]+)"', page))
    assert len(links) > 10
    for link in links:
        link = link.replace("&amp;", "&")
        assert superuser_client.get(reverse(CHANGELIST) + link).status_code == 200, link


def test_a_history_that_is_not_a_list_of_entries_is_shown_not_a_500(superuser_client):
    odd = [
        JobFactory(failed=True, errors={"from": "a hand edit"}),
        JobFactory(failed=True, errors=["not an entry", 3]),
    ]
    for job in odd:
        url = reverse("admin:skipqueue_job_change", args=[job.id])
        assert superuser_client.get(url).status_code == 200


def test_the_worker_list_costs_the_same_queries_for_one_worker_or_ten(superuser_client):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def queries(workers: int) -> int:
        WorkerProcess.objects.all().delete()
        for pid in range(workers):
            worker = WorkerProcess.objects.create(hostname="h", pid=pid, queues=["default"])
            JobFactory(running=True, worker=worker)
        with CaptureQueriesContext(connection) as captured:
            assert (
                superuser_client.get(
                    reverse("admin:skipqueue_workerprocess_changelist")
                ).status_code
                == 200
            )
        return len(captured)

    assert queries(1) == queries(10)


def test_worker_rows_cannot_be_deleted_from_the_admin(superuser_client):
    worker = WorkerProcess.objects.create(hostname="h", pid=1, queues=["default"])
    url = reverse("admin:skipqueue_workerprocess_delete", args=[worker.id])
    assert superuser_client.post(url, {"post": "yes"}).status_code == 403
    assert WorkerProcess.objects.filter(id=worker.id).exists()


# -- triage (issue 13, part C) ---------------------------------------------------------


def test_attempts_count_those_spent_of_those_allowed_not_the_raised_fence():
    from django_skipqueue.admin.common import attempts_text

    job = JobFactory(max_attempts=5)
    [claimed] = Job.objects.claim(queues=["default"])
    assert Job.objects.release(claimed.id, claimed.attempts)
    Job.objects.claim(queues=["default"])
    job.refresh_from_db()
    assert (job.attempts, job.max_attempts, job.releases) == (2, 6, 1)
    assert attempts_text(job) == "1/5"  # not 2/6
    job.expirations = 1
    assert attempts_text(job) == "1/5 (1 expired)"


def test_the_timeline_is_in_order_and_in_one_format(superuser_client):
    job = JobFactory(
        failed=True,
        attempts=2,
        errors=[  # stored newest last, but written here out of order on purpose
            {"attempt": 2, "at": "2026-11-30T10:05:00+00:00", "type": "E2", "message": "m"},
            {"attempt": 1, "at": "2026-11-30T10:01:00+00:00", "type": "E1", "message": "m"},
        ],
    )
    with setting_up():
        Job.objects.filter(id=job.id).update(created_at="2026-11-30T10:00:00+00:00")
    html = superuser_client.get(reverse("admin:skipqueue_job_change", args=[job.id])).content
    timeline = html.decode().split('class="skipqueue-timeline">')[1].split("</ol>")[0]
    stamps = [item.split("<code>")[1].split("</code>")[0] for item in timeline.split("<li>")[1:]]
    assert stamps[:3] == ["2026-11-30 10:00:00", "2026-11-30 10:01:00", "2026-11-30 10:05:00"]
    assert stamps == sorted(stamps)
    assert "attempt 1: E1" in timeline.split("10:01:00")[1].split("</li>")[0]


def test_a_stuck_job_page_says_so_and_offers_requeue(superuser_client):
    stuck = JobFactory(expired=True)
    healthy = JobFactory(running=True)
    page = superuser_client.get(reverse("admin:skipqueue_job_change", args=[stuck.id]))
    assert b"Stuck: its lease expired 5 min ago" in page.content
    assert b'name="requeue"' in page.content
    page = superuser_client.get(reverse("admin:skipqueue_job_change", args=[healthy.id]))
    assert b"Stuck:" not in page.content and b'name="requeue"' not in page.content


@pytest.mark.parametrize(
    ("trait", "verb", "before", "after"),
    [
        ("failed", "retry", JobState.FAILED, JobState.PENDING),
        (None, "cancel", JobState.PENDING, JobState.CANCELLED),
        ("expired", "requeue", JobState.RUNNING, JobState.PENDING),
    ],
)
def test_a_jobs_page_acts_on_it_by_post_only(superuser_client, trait, verb, before, after):
    job = JobFactory(**({trait: True} if trait else {}))
    url = reverse("admin:skipqueue_job_act", args=[job.id, verb])
    page = superuser_client.get(reverse("admin:skipqueue_job_change", args=[job.id]))
    assert f'name="{verb}"'.encode() in page.content
    assert superuser_client.get(url).status_code == 405
    job.refresh_from_db()
    assert job.state == before
    response = superuser_client.post(url)
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.state == after
    again = superuser_client.post(url, follow=True)  # the state moved on: nothing changes
    assert b"was not" in again.content


def test_a_jobs_page_action_needs_its_permission(client):
    job = JobFactory(failed=True)
    staff(client)  # may view jobs, not retry them
    page = client.get(reverse("admin:skipqueue_job_change", args=[job.id]))
    assert page.status_code == 200 and b'name="retry"' not in page.content
    act = reverse("admin:skipqueue_job_act", args=[job.id, "retry"])
    assert client.post(act).status_code == 403
    job.refresh_from_db()
    assert job.state == JobState.FAILED


def test_the_overview_is_listed_on_the_admin_index_for_whoever_may_view_jobs(client):
    staff(client)
    index = client.get(reverse("admin:index")).content.decode()
    assert "Queue overview" in index
    entry = reverse("admin:skipqueue_queueoverview_changelist")
    assert entry in index
    assert client.get(entry)["Location"] == reverse("admin:skipqueue_overview")


def test_a_queue_with_due_jobs_and_no_live_worker_is_flagged(superuser_client):
    JobFactory(queue_name="mail")
    JobFactory(queue_name="served")
    WorkerProcess.objects.create(hostname="h", pid=1, queues=["served"])
    page = superuser_client.get(reverse("admin:skipqueue_overview")).content.decode()
    rows = {row.split("</a>")[0].rsplit(">", 1)[1]: row for row in page.split("<tr")[2:]}
    assert "no live worker" in rows["mail"] and "skipqueue-unattended" in page
    assert "no live worker" not in rows["served"]


def test_the_overview_breadcrumbs_use_this_djangos_markup(superuser_client):
    import django

    page = superuser_client.get(reverse("admin:skipqueue_overview")).content.decode()
    if django.VERSION >= (6, 1):
        assert '<ol class="breadcrumbs">' in page and '<div class="breadcrumbs">' not in page
    else:
        assert '<div class="breadcrumbs">' in page


def test_the_worker_list_filters_alive_and_dead_and_puts_the_live_first(superuser_client):
    dead = WorkerProcess.objects.create(hostname="old", pid=1, queues=["default"])
    WorkerProcess.objects.filter(id=dead.id).update(heartbeat_at=Now() - timedelta(hours=1))
    alive = WorkerProcess.objects.create(hostname="new", pid=2, queues=["default"])
    url = reverse("admin:skipqueue_workerprocess_changelist")
    page = superuser_client.get(url).content.decode()
    assert page.index(str(alive.id)) < page.index(str(dead.id))
    only_dead = superuser_client.get(url + "?status=dead").content.decode()
    assert str(dead.id) in only_dead and str(alive.id) not in only_dead
    only_alive = superuser_client.get(url + "?status=alive").content.decode()
    assert str(alive.id) in only_alive and str(dead.id) not in only_alive


def test_the_task_and_queue_filters_offer_finished_and_known_values(superuser_client):
    from tests.testapp import tasks

    JobFactory(failed=True, task="billing.tasks.gone", queue_name="billing")
    page = superuser_client.get(reverse(CHANGELIST)).content.decode()
    assert "?task=billing.tasks.gone" in page and "?queue=billing" in page  # failed jobs'
    assert f"?task={tasks.add.name}" in page  # registered, though no job has run it


# -- trial finding 11: queue names written by other clients -------------------------------

ODD_QUEUE_NAMES = ["a/b", "x/y/z", "with space", "new\nline", "q?#%", "é/ü", "/", "ends/"]


@pytest.fixture
def pauser(client):
    """A staff user who may view jobs and pause queues."""
    return staff(client, "pause_queue")


def queue_act(client, verb: str, queue: str):
    """What the overview's button posts: the name percent-encoded."""
    url = reverse("admin:skipqueue_queue_act", args=[verb])
    return client.post(url, {"queue": quote(queue, safe="")})


def test_the_overview_renders_queues_whose_names_hold_any_characters(pauser):
    for name in ODD_QUEUE_NAMES[:4]:
        JobFactory(queue_name=name)  # written by another client (our enqueue refuses "\n")
    WorkerProcess.objects.create(hostname="h", pid=1, queues=ODD_QUEUE_NAMES[4:])
    response = pauser.get(reverse("admin:skipqueue_overview"))
    assert response.status_code == 200
    assert [row["queue"] for row in response.context["queues"]] == sorted(ODD_QUEUE_NAMES)
    assert response.content.decode().count('value="Pause"') == len(ODD_QUEUE_NAMES)


@pytest.mark.parametrize("name", ODD_QUEUE_NAMES)
def test_a_paused_queue_whose_name_holds_any_characters_is_resumed_by_its_button(pauser, name):
    import html
    import re

    from django_skipqueue.models import Queue

    JobFactory(queue_name=name)
    Queue.objects.create(name=name, paused_at=Now(), paused_by="other-client")
    page = pauser.get(reverse("admin:skipqueue_overview")).content.decode()
    (action, value) = re.findall(
        r'<form method="post"[^>]* action="([^"]+)">.*?'
        r'name="queue" value="([^"]*)"',
        page,
    )[0]
    response = pauser.post(html.unescape(action), {"queue": html.unescape(value)})
    assert response.status_code == 302
    assert not Queue.objects.paused().exists()


def test_pausing_a_queue_whose_name_our_workers_refuse_says_why_and_writes_nothing(pauser):
    from django_skipqueue.models import Queue

    JobFactory(queue_name="new\nline")  # written by another client: our enqueue refuses it
    response = queue_act(pauser, "pause", "new\nline")
    assert response.status_code == 302
    page = pauser.get(response["Location"]).content.decode()
    assert "cannot be paused" in page and "control characters" in page
    assert not Queue.objects.exists()


@pytest.mark.parametrize("data", [{}, {"queue": ""}, {"queue": "a%00b"}])
def test_a_queue_action_without_a_storable_name_is_a_400(pauser, data):
    response = pauser.post(reverse("admin:skipqueue_queue_act", args=["resume"]), data)
    assert response.status_code == 400


# -- trial finding 16: every admin of ours offers its own lookups only, and masks ----------


def our_admins():
    from django.contrib import admin

    return {
        model._meta.model_name: model_admin
        for model, model_admin in admin.site._registry.items()
        if model._meta.app_label == "skipqueue"
    }


@pytest.mark.parametrize("name", sorted(our_admins()))
def test_every_admin_of_ours_refuses_a_lookup_it_does_not_offer(name):
    model_admin = our_admins()[name]
    for lookup in ("id__gt", "kwargs__password__startswith", "task__regex", "pk"):
        assert not model_admin.lookup_allowed(lookup, "x", None), (name, lookup)


@pytest.mark.parametrize(
    "changelist",
    [
        "admin:skipqueue_job_changelist",
        "admin:skipqueue_workerprocess_changelist",
        "admin:skipqueue_schedule_changelist",
    ],
)
def test_every_filter_link_of_every_list_is_a_lookup_its_admin_allows(superuser_client, changelist):
    import re

    JobFactory(failed=True)
    WorkerProcess.objects.create(hostname="h", pid=1, queues=["default"])
    page = superuser_client.get(reverse(changelist)).content.decode()
    links = {link.replace("&amp;", "&") for link in re.findall(r'href="\?([^"]+)"', page)}
    assert links
    for link in links:
        assert superuser_client.get(reverse(changelist) + "?" + link).status_code == 200, link


def test_the_overview_entry_has_no_page_of_its_own_for_a_job(client):
    job = JobFactory(kwargs={"password": "hunter2"}, unique_key="reset-8f14e45fceea167a5a36")
    viewer = staff(client)
    viewer.raise_request_exception = False
    for view in ("change", "history", "delete"):
        entry = reverse("admin:skipqueue_queueoverview_changelist")
        response = viewer.get(f"{entry}{job.id}/{view}/")
        assert response.status_code == 404, view
        assert b"hunter2" not in response.content


# A reset token, a session id, a hex digest, a UUID, a key=value secret.
SECRET_KEYS = [
    ("reset:user:42:Zt9xQ2vLp8", "Zt9xQ2vLp8"),
    ("session_3f2a9c1b7e6d5a4f", "3f2a9c1b7e6d5a4f"),
    ("invite:550e8400-e29b-41d4-a716-446655440000", "446655440000"),
    ("token=tok_visa_4242", "tok_visa_4242"),
]


@pytest.mark.parametrize(("key", "secret"), SECRET_KEYS)
def test_a_unique_key_that_may_be_a_token_is_masked_on_the_list_and_the_page(
    superuser_client, key, secret
):
    job = JobFactory(unique_key=key)
    listed = superuser_client.get(reverse(CHANGELIST)).content.decode()
    page = superuser_client.get(reverse("admin:skipqueue_job_change", args=[job.id]))
    assert secret not in listed and secret not in page.content.decode()
    assert "***" in listed and "***" in page.content.decode()


@pytest.mark.parametrize("key", ["invoice_id=5", "order-42:2024-06-01", "nightly-report"])
def test_a_unique_key_that_is_plainly_not_a_secret_is_shown_as_written(superuser_client, key):
    job = JobFactory(unique_key=key)
    page = superuser_client.get(reverse("admin:skipqueue_job_change", args=[job.id]))
    assert key in page.content.decode()


def test_a_secret_passed_positionally_is_masked_as_by_keyword(client):
    """`call_partner(url, "p@ssw0rd")`: a view-only user saw the password, which the same
    call by keyword masks; the task's parameter names mask it now. A chain step's own
    arguments come after its parent's result, and are matched past it."""
    from tests.testapp.tasks import call_partner

    viewer = staff(client, "view_job_payload")
    job = JobFactory(task=call_partner.name, args=["https://partner", "p@ssw0rd-1", 5])
    step = JobFactory(task=call_partner.name, args=["p@ssw0rd-2"], inputs={"results": {"job": 1}})
    for one in (job, step):
        page = viewer.get(reverse("admin:skipqueue_job_change", args=[one.id])).content.decode()
        assert "p@ssw0rd" not in page and "***" in page
    page = viewer.get(reverse("admin:skipqueue_job_change", args=[job.id])).content.decode()
    assert "https://partner" in page


def test_a_user_without_the_payload_permission_sees_classes_and_shapes_only(client):
    """A view-only operator is safe whatever a masking rule misses: without
    `view_job_payload`, no argument, result, error message, traceback, unique key or
    progress note reaches any page (jobs, workflows, schedules); task names, states,
    error classes and shapes do."""
    from tests.testapp.tasks import call_partner

    plain = "plain-value-no-rule-masks"
    job = JobFactory(
        failed=True,
        task=call_partner.name,
        args=["https://partner", plain],
        kwargs={"note": plain},
        result={"echo": plain},
        unique_key=f"k-{plain}",
        progress={"done": 1, "total": 2, "note": plain},
        last_error=f"builtins.ValueError: {plain}",
        errors=[
            {
                "attempt": 1,
                "at": "2030-01-01T00:00:00+00:00",
                "type": "builtins.ValueError",
                "message": plain,
                "traceback": f"Traceback\nValueError: {plain}",
            }
        ],
    )
    viewer = staff(client)
    for url in (reverse(CHANGELIST), reverse("admin:skipqueue_job_change", args=[job.id])):
        text = viewer.get(url).content.decode()
        assert plain not in text, url
        assert "ValueError" in text and "call_partner" in text
    page = viewer.get(reverse("admin:skipqueue_job_change", args=[job.id])).content.decode()
    assert "(str, str)" in page and "note: str" in page and "dict of 1" in page
    client.logout()
    User.objects.filter(username="staff").delete()
    seeing = staff(client, "view_job_payload")
    text = seeing.get(reverse("admin:skipqueue_job_change", args=[job.id])).content.decode()
    assert plain in text  # no rule masks it: the permission shows it


def test_errors_written_by_another_client_are_masked_on_the_list_and_the_page(superuser_client):
    leak = "ConnectionError: postgres://app:pw-leaked@db/x Authorization: Bearer tok-leaked"
    entry = {"attempt": 1, "at": "2030-01-01T00:00:00+00:00", "type": "E"}
    job = JobFactory(
        failed=True,
        last_error=leak,
        errors=[entry | {"message": leak, "traceback": "Traceback\n" + leak}],
    )
    listed = superuser_client.get(reverse(CHANGELIST)).content.decode()
    page = superuser_client.get(reverse("admin:skipqueue_job_change", args=[job.id]))
    for text in (listed, page.content.decode()):
        assert "pw-leaked" not in text and "tok-leaked" not in text
        assert "postgres://app:***@db/x" in text


# -- trial finding 19: a select-all action is bounded per request -------------------------


def act_on_all(client, action: str, url: str = ""):
    """The changelist's "Select all N" and then the action, as a browser posts them."""
    return client.post(
        url or reverse(CHANGELIST),
        {"action": action, "select_across": "1", "index": "0", "_selected_action": ["0"]},
        follow=True,
    )


def reported(response) -> str:
    return " ".join(str(message) for message in response.context["messages"])


def insert_pending_jobs(count: int) -> None:
    """`count` pending jobs in one statement (the factory takes half a millisecond a row)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
                lease, attempts, max_attempts, expirations, releases, last_error, errors,
                created_at)
            SELECT 'tests.testapp.tasks.add', '[]', '{}', 'default', 0, 'pending', now(),
                   interval '5 minutes', 0, 5, 0, 0, '', '[]', now()
            FROM generate_series(1, %s)
            """,
            [count],
        )


def test_a_select_all_cancel_past_the_bound_cancels_the_bound_and_says_what_is_left(
    superuser_client, monkeypatch
):
    from django_skipqueue.admin import JobAdmin

    monkeypatch.setattr(JobAdmin, "action_max_rows", 10_000)
    insert_pending_jobs(30_000)
    first = act_on_all(superuser_client, "cancel")
    assert "10000 job(s) cancelled or asked to stop" in reported(first)
    assert "20000 more of the selection" in reported(first)
    cancelled = Job.objects.filter(state=JobState.CANCELLED)
    assert cancelled.count() == 10_000 and Job.objects.filter(state=JobState.PENDING).count()
    pending_ids = Job.objects.filter(state=JobState.PENDING).values_list("id", flat=True)
    assert max(cancelled.values_list("id", flat=True)) < min(pending_ids)  # in id order
    act_on_all(superuser_client, "cancel")
    last = act_on_all(superuser_client, "cancel")
    assert "10000 job(s) cancelled or asked to stop" in reported(last)
    assert "more of the selection" not in reported(last)
    assert cancelled.count() == 30_000


def test_a_select_all_cancel_stops_starting_batches_when_its_time_is_up(
    superuser_client, monkeypatch
):
    from django_skipqueue.admin import JobAdmin

    monkeypatch.setattr(JobAdmin, "action_seconds", 0.0)  # time is up after one batch
    insert_pending_jobs(3_000)
    response = act_on_all(superuser_client, "cancel")
    assert "1000 job(s) cancelled or asked to stop" in reported(response)
    assert "2000 more of the selection" in reported(response)
    assert Job.objects.filter(state=JobState.CANCELLED).count() == 1_000


@pytest.mark.parametrize(
    ("action", "trait", "after", "verb"),
    [
        ("retry_now", "failed", JobState.PENDING, "retried"),
        ("requeue", "expired", JobState.PENDING, "requeued"),
        ("cancel", "running", JobState.RUNNING, "cancelled or asked to stop"),
    ],
)
def test_every_bulk_action_is_bounded_and_goes_on_where_it_stopped(
    superuser_client, monkeypatch, action, trait, after, verb
):
    from django_skipqueue.admin import JobAdmin

    monkeypatch.setattr(JobAdmin, "action_max_rows", 500)
    monkeypatch.setattr(JobAdmin, "action_batch_size", 200)
    Job.objects.bulk_create(JobFactory.build_batch(1_250, **{trait: True}), batch_size=BULK_BATCH)
    JobFactory.create_batch(5, done=True)  # selected too, never touched, never "left"
    messages = [reported(act_on_all(superuser_client, action)) for _ in range(3)]
    assert f"500 job(s) {verb}" in messages[0] and "750 more of the selection" in messages[0]
    assert f"500 job(s) {verb}" in messages[1] and "250 more of the selection" in messages[1]
    assert f"250 job(s) {verb}" in messages[2] and "more of the selection" not in messages[2]
    assert Job.objects.filter(state=JobState.DONE).count() == 5
    if action == "cancel":
        assert Job.objects.filter(cancel_requested_at__isnull=False).count() == 1_250
    else:
        assert Job.objects.filter(state=after).count() == 1_250


def test_a_bounded_retry_goes_past_unique_jobs_whose_keys_are_held(superuser_client, monkeypatch):
    from django_skipqueue.admin import JobAdmin

    monkeypatch.setattr(JobAdmin, "action_max_rows", 500)
    held = [JobFactory.build(failed=True, unique_key=f"k{n}") for n in range(600)]
    Job.objects.bulk_create(held)  # the lowest ids: a retry would take them first
    Job.objects.bulk_create([JobFactory.build(unique_key=f"k{n}") for n in range(600)])
    Job.objects.bulk_create(JobFactory.build_batch(300, failed=True))

    message = reported(act_on_all(superuser_client, "retry_now"))

    assert "300 job(s) retried" in message and "more of the selection" not in message
    assert Job.objects.filter(state=JobState.FAILED, unique_key__isnull=False).count() == 600


@pytest.mark.parametrize(
    ("column", "stored"),
    [
        ("run_at", "infinity"),
        ("scheduled_for", "-infinity"),
        ("finished_at", "20000-01-01 00:00+00"),
        ("created_at", "0001-01-01 00:00+00 BC"),
    ],
)
def test_a_row_with_a_timestamp_python_cannot_load_is_shown(superuser_client, column, stored):
    from django.db import connection

    poison = JobFactory(failed=True, schedule="nightly")
    JobFactory()  # an innocent neighbour on the same page
    with setting_up(), connection.cursor() as cursor:  # another client's write
        cursor.execute(f"UPDATE skipqueue_job SET {column} = %s WHERE id = %s", [stored, poison.id])

    for url in [
        reverse(CHANGELIST),
        reverse(CHANGELIST) + "?o=-2",  # sorted by its column too
        reverse("admin:skipqueue_job_change", args=[poison.id]),
        reverse("admin:skipqueue_overview"),
    ]:
        response = superuser_client.get(url)
        assert response.status_code == 200, url
    assert Job.objects.get(id=poison.id).id == poison.id  # the ORM loads it, clamped
    assert Job.objects.filter(**{f"{column}__isnull": False}).count() >= 1


def test_our_pages_link_the_stylesheet_and_our_code_has_no_inline_style(superuser_client):
    from pathlib import Path

    JobFactory(failed=True)
    for url in [
        reverse(CHANGELIST),
        reverse("admin:skipqueue_job_change", args=[Job.objects.get().id]),
        reverse("admin:skipqueue_overview"),
        reverse("admin:skipqueue_schedule_changelist"),
        reverse("admin:skipqueue_workerprocess_changelist"),
    ]:
        assert b"skipqueue/admin.css" in superuser_client.get(url).content, url
    package = Path(__file__).resolve().parents[2] / "django_skipqueue"
    sources = [*(package / "admin").glob("*.py"), *(package / "templates").rglob("*.html")]
    assert [str(path) for path in sources if "style=" in path.read_text()] == []


@pytest.mark.parametrize(
    ("method", "path", "data"),
    [
        ("get", "?q=%C2%B2", None),  # '²'.isdigit() is true, int('²') is not
        ("get", "?q=" + "9" * 5000, None),  # past Python's 4,300 digits
        ("get", "change:%C2%B2", None),
        ("get", "change:" + "9" * 5000, None),
        ("post", "", {"action": "cancel", "_selected_action": ["abc"]}),
        ("post", "", {"action": "cancel", "_selected_action": ["1\x00"]}),
    ],
)
def test_odd_ids_and_selections_never_answer_500(superuser_client, method, path, data):
    base = reverse(CHANGELIST)
    if path.startswith("change:"):
        url = base + path.removeprefix("change:") + "/change/"
    else:
        url = base + path
    response = getattr(superuser_client, method)(url, data) if data else superuser_client.get(url)
    assert response.status_code in {200, 302, 400}


def test_a_schedule_action_with_a_nul_in_its_selection_is_a_400(superuser_client):
    url = reverse("admin:skipqueue_schedule_changelist")
    response = superuser_client.post(url, {"action": "pause", "_selected_action": ["a\x00"]})
    assert response.status_code == 400


def test_rows_other_clients_broke_render_on_every_page(superuser_client):
    """A lease longer than a timedelta holds, an error entry whose time cannot be shown in
    this time zone, a due job from '-infinity', and worker rows whose queues are not a
    list of names (trial finding F8): every page answers 200."""
    job = JobFactory(failed=True)
    with setting_up(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE skipqueue_job SET lease = interval '100000000 years', errors = %s::jsonb "
            "WHERE id = %s",
            [json.dumps([{"attempt": 1, "at": "9999-12-31T23:59:59-14:00", "type": "E",
                          "message": "m"}]), job.id],
        )  # fmt: skip
        cursor.execute(
            "INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, "
            "run_at, lease, attempts, max_attempts, expirations, releases, last_error, errors, "
            "created_at, cancelled_by) VALUES ('t', '[]', '{}', 'old', 0, 'pending', "
            "'-infinity', interval '1 minute', 0, 1, 0, 0, '', '[]', now(), '')"
        )
        for queues in ('[["x"]]', '[1, "a"]', "[null]", '"default"', "{}"):
            cursor.execute(
                "INSERT INTO skipqueue_workerprocess (id, hostname, pid, queues, concurrency, "
                "started_at, heartbeat_at) VALUES (gen_random_uuid(), 'h', 1, %s::jsonb, 1, "
                "now(), now() + interval '1 hour')",
                [queues],
            )
    for url in [
        reverse(CHANGELIST),
        reverse(CHANGELIST) + "?_facets=1",
        reverse("admin:skipqueue_job_change", args=[job.id]),
        reverse("admin:skipqueue_overview"),
        reverse("admin:skipqueue_workerprocess_changelist"),
    ]:
        assert superuser_client.get(url).status_code == 200, url
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    assert any(row["queue"] == "old" for row in json.loads(out.getvalue())["queues"])
