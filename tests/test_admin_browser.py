"""A real browser (Debian's chromium, driven by playwright) triages a stuck job in the admin.

Screenshots of the changelist and the queue overview are saved to test-artifacts/.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from django_skipqueue.models import Job, JobState
from tests.factories import JobFactory
from tests.processes import REPO_ROOT, child_env, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install chromium"),
]


@pytest.fixture
def server_url():
    """`runserver` on a free loopback port, against the test database; killed at teardown."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "django", "runserver", f"127.0.0.1:{port}", "--noreload"],
        env=child_env(DJANGO_SETTINGS_MODULE="tests.settings_browser"),
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            login = urllib.request.urlopen(f"{url}/admin/login/", timeout=1)  # noqa: S310
            return login.status == 200
        except OSError:
            return False

    try:
        wait_until(up, timeout=30, interval=0.1)
        yield url
    finally:
        server.kill()
        server.wait(timeout=10)


@pytest.fixture
def page(monkeypatch):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    # playwright's sync API runs an event loop in this thread; the ORM calls the test
    # makes between browser steps are still synchronous (pytest-django's advice).
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 900})
        finally:
            # The ORM calls made inside playwright's event loop opened a connection of
            # their own (Django's connections are per context); close it here.
            from django.db import connections

            connections.close_all()
            browser.close()


def test_an_operator_requeues_a_stuck_job_from_the_browser(server_url, page):
    User.objects.create_superuser("ops", "ops@example.com", "correct-horse")
    stuck = JobFactory(expired=True, task="shop.tasks.send_welcome_email")
    JobFactory.create_batch(3, done=True)
    ARTIFACTS.mkdir(exist_ok=True)

    page.goto(f"{server_url}/admin/login/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct-horse")
    page.click("input[type=submit]")
    page.goto(f"{server_url}/admin/skipqueue/job/?health=stuck")
    assert page.locator("#result_list tbody tr").count() == 1
    page.screenshot(path=str(ARTIFACTS / "admin-stuck-changelist.png"), full_page=True)

    page.check("#result_list tbody input[type=checkbox]")
    page.select_option("select[name=action]", "requeue")
    page.click("button[name=index]")
    assert "1 job(s) requeued" in page.locator("ul.messagelist").inner_text()
    stuck.refresh_from_db()
    assert (stuck.state, stuck.expirations) == (JobState.PENDING, 1)

    page.goto(f"{server_url}/admin/skipqueue/job/overview/")
    assert page.locator("#queue-overview").is_visible()
    assert page.locator("#throughput-chart rect").count() == 12
    page.screenshot(path=str(ARTIFACTS / "admin-queue-overview.png"), full_page=True)
    assert Job.objects.filter(state=JobState.DONE).count() == 3
