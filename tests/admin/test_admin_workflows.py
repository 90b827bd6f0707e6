"""The workflow admin and the workflow numbers of queuestats (admin/workflows.py)."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.urls import reverse

from django_skipqueue import chain, chord, group
from django_skipqueue.models import Job, JobState, Workflow, WorkflowState
from django_skipqueue.testing import run_jobs
from tests.testapp.tasks import add, breaks, double, note_failure, total

pytestmark = pytest.mark.django_db


def staff(client, *perms: str):
    user = User.objects.create_user("staff", is_staff=True)
    for codename in ("view_job", *perms):
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(user)
    return client


def test_a_workflows_on_error_job_is_labelled_in_its_tree(client):
    workflow = chain(add.s(1, 2), double.s()).enqueue(on_error=note_failure.s(where="x"))
    page = staff(client).get(reverse("admin:skipqueue_workflow_change", args=[workflow.id]))
    page = page.content.decode()
    [label] = [line for line in page.split("<li") if "on_error: runs if a job" in line]
    assert f"#{workflow.on_error_job_id}<" in label


def test_a_workflows_page_draws_its_jobs_under_their_parents_and_why_it_failed(client):
    workflow = chain(add.s(1, 2), group(breaks.si("s3cret"), double.s()), total.s()).enqueue()
    run_jobs()
    workflow.refresh_from_db()
    assert workflow.state == WorkflowState.FAILED
    response = staff(client).get(reverse("admin:skipqueue_workflow_change", args=[workflow.id]))
    assert response.status_code == 200
    page = response.content.decode()
    ids = list(workflow.jobs.order_by("id").values_list("id", flat=True))
    for job_id in ids:
        assert reverse("admin:skipqueue_job_change", args=[job_id]) in page
    assert 'class="skipqueue-tree-0"' in page  # add
    assert page.count('class="skipqueue-tree-1"') == 2  # the group's members
    assert 'class="skipqueue-tree-2"' in page  # total
    # A view-only user: the error's class, never its message (the payload permission).
    assert "ValueError" in page and "s3cret" not in page
    assert f"upstream job {workflow.failed_job_id}" not in page
    client.logout()
    User.objects.all().delete()
    page = staff(client, "view_job_payload").get(
        reverse("admin:skipqueue_workflow_change", args=[workflow.id])
    )
    assert f"upstream job {workflow.failed_job_id}" in page.content.decode()
    listing = client.get(reverse("admin:skipqueue_workflow_changelist") + "?state__exact=failed")
    assert listing.status_code == 200 and str(workflow.id) in listing.content.decode()


def test_a_jobs_page_links_its_workflow_and_the_list_filters_by_it(client):
    workflow = chain(add.s(1, 2), double.s()).enqueue()
    Job.objects.create(task=add.name, args=[0, 0], lease="00:05:00", max_attempts=1)
    waiting = workflow.jobs.get(state=JobState.WAITING)
    staff(client)
    page = client.get(reverse("admin:skipqueue_job_change", args=[waiting.id])).content.decode()
    assert reverse("admin:skipqueue_workflow_change", args=[workflow.id]) in page
    assert "waits on 1 more" in page
    listing = client.get(reverse("admin:skipqueue_job_changelist") + f"?workflow={workflow.id}")
    assert listing.status_code == 200
    assert listing.context["cl"].result_count == 2
    assert client.get(reverse("admin:skipqueue_job_changelist") + "?workflow=x").status_code == 200


def test_cancel_and_retry_take_the_job_permissions(client):
    workflow = chord(group(breaks.si(), double.s(1)), total.s()).enqueue()
    run_jobs()
    url = reverse("admin:skipqueue_workflow_changelist")
    viewer = staff(client)
    response = viewer.post(url, {"action": "retry_failed", "_selected_action": [workflow.id]})
    assert response.status_code == 200  # no such action for a viewer: nothing happened
    assert Job.objects.filter(workflow=workflow, state=JobState.FAILED).count() == 1
    client.logout()
    User.objects.all().delete()
    staff(client, "retry_job", "cancel_job")
    client.post(url, {"action": "retry_failed", "_selected_action": [workflow.id]})
    workflow.refresh_from_db()
    assert workflow.state == WorkflowState.RUNNING
    assert Job.objects.get(workflow=workflow, task=total.name).state == JobState.WAITING
    client.post(url, {"action": "cancel_workflows", "_selected_action": [workflow.id]})
    workflow.refresh_from_db()
    assert workflow.state == WorkflowState.CANCELLED
    assert not workflow.jobs.exclude(state__in=["done", "cancelled"]).exists()


def test_queuestats_counts_jobs_waiting_on_a_parent_apart_from_due_ones():
    chord(group(double.s(n) for n in range(3)), total.s()).enqueue()
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    (row,) = json.loads(out.getvalue())["queues"]
    assert (row["pending_due"], row["waiting"]) == (3, 1)
    assert Workflow.objects.count() == 1


def test_a_failed_workflows_page_retries_its_failed_job_with_the_retry_permission(client):
    workflow = chain(add.s(1, 2), breaks.si("x"), total.s()).enqueue()
    run_jobs()
    workflow.refresh_from_db()
    assert workflow.state == WorkflowState.FAILED
    url = reverse("admin:skipqueue_workflow_change", args=[workflow.id])
    retry = reverse("admin:skipqueue_workflow_retry", args=[workflow.id])
    viewer = staff(client)
    assert retry not in viewer.get(url).content.decode()  # no button without the permission
    assert viewer.post(retry).status_code == 403
    client.logout()
    User.objects.all().delete()
    operator = staff(client, "retry_job")
    page = operator.get(url).content.decode()
    assert retry in page and "Retry the failed job" in page
    assert operator.get(retry).status_code == 405
    response = operator.post(retry, follow=True)
    assert "1 failed job(s) retried" in response.content.decode()
    failed = Job.objects.get(id=workflow.failed_job_id)
    assert failed.state == JobState.PENDING
    assert retry not in operator.get(url).content.decode()  # running again: no button
