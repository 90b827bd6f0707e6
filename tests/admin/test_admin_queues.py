"""Pausing a queue from the overview: a confirmation first, then who paused it and when."""

from __future__ import annotations

import html
import re
from datetime import timedelta
from urllib.parse import quote

import pytest
from django.contrib.auth.models import User
from django.db.models.functions import Now
from django.urls import reverse

from django_skipqueue.models import Queue
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db

OVERVIEW = "admin:skipqueue_overview"


@pytest.fixture
def superuser_client(client):
    client.force_login(User.objects.create_superuser("ops", "o@example.com", "pw"))
    return client


def pause_button(page: str, queue: str) -> tuple[str, dict[str, str]]:
    """The action and fields of the overview's Pause form for `queue`."""
    for action, fields in re.findall(
        r'<form method="post"[^>]* action="([^"]+)">(.*?)</form>', page, re.S
    ):
        inputs = dict(re.findall(r'name="([^"]+)" value="([^"]*)"', fields))
        if html.unescape(inputs.get("queue", "")) == quote(queue, safe=""):
            return html.unescape(action), {k: html.unescape(v) for k, v in inputs.items()}
    raise AssertionError(f"no form for {queue!r}")


def test_the_pause_button_asks_to_confirm_and_pauses_nothing_yet(superuser_client):
    JobFactory.create_batch(2, queue_name="mail")
    JobFactory(queue_name="mail", running=True)
    action, fields = pause_button(superuser_client.get(reverse(OVERVIEW)).content.decode(), "mail")
    page = superuser_client.post(action, fields)
    assert page.status_code == 200 and not Queue.objects.paused().exists()
    text = page.content.decode()
    assert "Pause queue mail?" in text
    assert "2 jobs are due now and will wait." in text
    assert "1 job is running and will finish." in text
    assert 'value="Yes, pause mail"' in text and "No, take me back" in text


@pytest.mark.parametrize("name", ["mail", "a/b", "with space", "q?#%"])
def test_confirming_pauses_the_queue_named_on_the_page(superuser_client, name):
    JobFactory(queue_name=name)
    action, fields = pause_button(superuser_client.get(reverse(OVERVIEW)).content.decode(), name)
    confirmation = superuser_client.post(action, fields).content.decode()
    confirm_action, confirm_fields = pause_button(confirmation, name)
    assert confirm_fields["confirm"] == "yes"
    response = superuser_client.post(confirm_action, confirm_fields)
    assert response.status_code == 302
    paused = Queue.objects.get(name=name)
    assert paused.is_paused and paused.paused_by == "ops"


def test_resuming_needs_no_confirmation(superuser_client):
    JobFactory(queue_name="mail")
    Queue.objects.pause(["mail"], by="alice")
    action, fields = pause_button(superuser_client.get(reverse(OVERVIEW)).content.decode(), "mail")
    assert action.endswith("/resume/")
    assert superuser_client.post(action, fields).status_code == 302
    assert not Queue.objects.paused().exists()


def test_the_overview_says_who_paused_a_queue_and_when(superuser_client):
    JobFactory(queue_name="mail")
    Queue.objects.pause(["mail"], by="alice")
    Queue.objects.filter(name="mail").update(paused_at=Now() - timedelta(minutes=12))
    page = superuser_client.get(reverse(OVERVIEW))
    [row] = [row for row in page.context["queues"] if row["queue"] == "mail"]
    assert (row["paused_by"], row["paused_ago"]) == ("alice", "12 min")
    assert "by alice, 12 min ago</small>" in page.content.decode()
