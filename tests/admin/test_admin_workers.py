"""The worker list: alive, stopped cleanly, or lost; heartbeats on the database's clock."""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db.models.functions import Now
from django.urls import reverse

from django_skipqueue.models import WorkerKind, WorkerProcess
from tests.processes import wait_until

LIST = "admin:skipqueue_workerprocess_changelist"


@pytest.fixture
def superuser_client(client):
    client.force_login(User.objects.create_superuser("root", "r@example.com", "pw"))
    return client


def statuses(client, query: str = "") -> dict[str, str]:
    """{pid: status} as the list shows them."""
    page = client.get(reverse(LIST) + query)
    assert page.status_code == 200
    return {str(row.pid): row.status for row in page.context["cl"].result_list}


def registered(pid: int, kind: str = WorkerKind.WORKER, **columns) -> WorkerProcess:
    worker = WorkerProcess.objects.register(queues=["default"], concurrency=2, kind=kind)
    WorkerProcess.objects.filter(id=worker.id).update(pid=pid, **columns)
    return worker


@pytest.mark.django_db
def test_the_list_tells_alive_stopped_and_lost_workers_apart(superuser_client, settings):
    settings.SKIPQUEUE = {"WORKER_DEAD_AFTER_SECONDS": 60}
    registered(1)
    WorkerProcess.objects.mark_stopped(registered(2).id)
    registered(3, heartbeat_at=Now() - timedelta(seconds=61))  # silent, never said it stopped
    assert statuses(superuser_client) == {"1": "alive", "2": "stopped", "3": "lost"}
    html = superuser_client.get(reverse(LIST)).content.decode()
    assert 'class="skipqueue-worker-lost"' in html
    # Alive first, then the lost (what an operator looks for), then the stopped.
    assert list(statuses(superuser_client).values()) == ["alive", "lost", "stopped"]


@pytest.mark.django_db
def test_the_status_filter_shows_one_status(superuser_client):
    registered(1)
    WorkerProcess.objects.mark_stopped(registered(2).id)
    registered(3, heartbeat_at=Now() - timedelta(hours=1))
    assert statuses(superuser_client, "?status=lost") == {"3": "lost"}
    assert statuses(superuser_client, "?status=stopped") == {"2": "stopped"}
    assert statuses(superuser_client, "?status=alive") == {"1": "alive"}
    assert statuses(superuser_client, "?status=dead") == {"2": "stopped", "3": "lost"}


@pytest.mark.django_db
def test_heartbeats_read_as_ages_on_the_database_clock(superuser_client):
    registered(1, heartbeat_at=Now() - timedelta(seconds=4))
    WorkerProcess.objects.mark_stopped(registered(2).id)
    WorkerProcess.objects.filter(pid=2).update(stopped_at=Now() - timedelta(minutes=3))
    html = superuser_client.get(reverse(LIST)).content.decode()
    assert ">4 s ago</span>" in html
    assert ">stopped 3 min ago</span>" in html  # not its backdated heartbeat


@pytest.mark.django_db
def test_the_list_shows_and_filters_by_kind(superuser_client):
    registered(1)
    registered(2, kind=WorkerKind.CONSUMER)
    registered(3, kind=WorkerKind.RELAY)
    html = superuser_client.get(reverse(LIST)).content.decode()
    assert "broker consumer" in html and "relay" in html
    assert statuses(superuser_client, "?kind__exact=relay") == {"3": "alive"}
    assert statuses(superuser_client, "?kind__exact=consumer") == {"2": "alive"}


@pytest.mark.django_db
def test_a_workers_page_shows_its_status_and_when_it_stopped(superuser_client):
    worker = registered(1)
    WorkerProcess.objects.mark_stopped(worker.id)
    page = superuser_client.get(
        reverse("admin:skipqueue_workerprocess_change", args=[worker.id])
    ).content.decode()
    assert ">stopped<" in page and "Stopped at" in page


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_stopped_by_sigterm_is_stopped_and_a_killed_one_is_lost(
    superuser_client, settings, start_worker
):
    fast = {"HEARTBEAT_SECONDS": 0.2, "WORKER_DEAD_AFTER_SECONDS": 1.0}
    settings.SKIPQUEUE = fast
    clean, killed = start_worker(settings=fast), start_worker(settings=fast)
    for handle in (clean, killed):
        handle.wait_for_output("worker started")
    assert statuses(superuser_client) == {str(clean.pid): "alive", str(killed.pid): "alive"}
    clean.signal(signal.SIGTERM)
    assert clean.wait(20) == 0
    killed.signal(signal.SIGKILL)
    killed.wait(20)
    wait_until(
        lambda: statuses(superuser_client).get(str(killed.pid)) == "lost",
        timeout=10,
        message="a killed worker was not shown lost",
    )
    assert statuses(superuser_client)[str(clean.pid)] == "stopped"
