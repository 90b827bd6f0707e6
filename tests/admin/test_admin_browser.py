"""A real browser (Debian's chromium, driven by playwright) triages a stuck job in the admin.

At 1280 px, the width of an operator's laptop. Screenshots of the job list, a stuck
job's page and the queue overview are saved to test-artifacts/.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from django_skipqueue.models import Job, JobState, QueueMinute
from tests.factories import JobFactory
from tests.processes import REPO_ROOT, child_env, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
WIDTH, HEIGHT = 1280, 800

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
            yield browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        finally:
            # The ORM calls made inside playwright's event loop opened a connection of
            # their own (Django's connections are per context); close it here.
            from django.db import connections

            connections.close_all()
            browser.close()


def log_in(page, server_url: str) -> None:
    User.objects.create_superuser("ops", "ops@example.com", "correct-horse")
    page.goto(f"{server_url}/admin/login/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "correct-horse")
    page.click("input[type=submit]")
    # click() waits for the navigation to start, not to end: a goto() right after it
    # could cancel the login's POST. The user tools show once logged in.
    page.locator("#user-tools").wait_for(state="visible", timeout=10_000)


def expect(locator):
    """playwright's retrying assertions (imported here: the module loads without it)."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


def in_view(locator) -> bool:
    """Wholly inside the 1280 x 800 window, without scrolling."""
    box = locator.bounding_box()
    return (
        box is not None
        and box["x"] >= 0
        and box["y"] >= 0
        and box["x"] + box["width"] <= WIDTH
        and box["y"] + box["height"] <= HEIGHT
    )


def test_at_1280_px_the_job_list_shows_what_an_operator_triages_by(server_url, page):
    stuck = JobFactory(expired=True, task="shop.tasks.send_welcome_email", worker_id=uuid.uuid4())
    JobFactory(running=True, task="shop.tasks.send_welcome_email", worker_id=uuid.uuid4())
    failed = JobFactory(
        failed=True,
        task="billing.webhooks.deliver_invoice_to_accounting_system",
        last_error="ConnectionError: HTTPSConnectionPool(host='accounts.example.com', port=443): "
        "Max retries exceeded with url: /v2/invoices/ (Caused by NewConnectionError) " * 3,
    )
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/job/")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "admin-job-list-1280.png"))

    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    for job in (stuck, failed):
        row = page.locator(f"#result_list tbody tr:has(input[value='{job.id}'])")
        for part in ("td.field-state_and_health", "td.field-attempts_of_max", "td.field-timing"):
            assert in_view(row.locator(part)), (job.task, part)
    stuck_row = page.locator(f"#result_list tbody tr:has(input[value='{stuck.id}'])")
    assert in_view(stuck_row.locator(".skipqueue-stuck"))
    assert "stuck 5 min" in stuck_row.locator(".skipqueue-stuck").inner_text()
    assert page.locator(".skipqueue-stuck").count() == 1  # the healthy running job is not
    error = page.locator(f"#result_list tbody tr:has(input[value='{failed.id}']) .skipqueue-error")
    assert in_view(error)
    assert error.inner_text().startswith("ConnectionError: HTTPSConnectionPool")
    assert error.get_attribute("title") == failed.last_error  # the whole text on hover


def test_an_operator_requeues_a_stuck_job_from_its_page_and_reaches_the_overview(server_url, page):
    stuck = JobFactory(expired=True, task="shop.tasks.send_welcome_email")
    JobFactory.create_batch(3, done=True)
    QueueMinute.objects.add(
        {
            "default": {
                "succeeded": 3,
                "pickups": 3,
                "pickup_seconds": 0.03,
                "pickup_buckets": [0, 3],
                "oldest_due_seconds": 2.0,
            }
        }
    )
    log_in(page, server_url)
    ARTIFACTS.mkdir(exist_ok=True)

    page.goto(f"{server_url}/admin/skipqueue/job/?health=stuck")
    assert page.locator("#result_list tbody tr").count() == 1
    page.click(f"#result_list tbody tr a:text-is('{stuck.id}')")
    banner = page.locator(".skipqueue-stuck-banner")
    # expect() retries until the new page holds the text; inner_text() reads once, and
    # can read a page still loading (CI saw an empty message list that way).
    expect(banner).to_contain_text("Stuck: its lease expired 5 min ago", timeout=10_000)
    assert in_view(banner)
    page.screenshot(path=str(ARTIFACTS / "admin-stuck-job-1280.png"))
    page.click("button[name=requeue]")
    expect(page.locator("ul.messagelist")).to_contain_text(
        f"Job {stuck.id} requeued.", timeout=10_000
    )
    stuck.refresh_from_db()
    assert (stuck.state, stuck.expirations) == (JobState.PENDING, 1)
    assert page.locator(".skipqueue-stuck-banner").count() == 0

    page.goto(f"{server_url}/admin/")  # the overview is one click from the admin index
    page.click("a:text-is('Queue overview')")
    # click() does not wait for the new page: wait for the table (is_visible() does not).
    page.locator("#queue-overview").wait_for(state="visible", timeout=10_000)
    charts = page.locator(".skipqueue-trends .skipqueue-chart")
    assert charts.count() == 4  # one queue's counts (counted_minutes): four charts
    assert charts.first.locator(".tick-label").count() == 3  # a scale
    assert charts.first.locator("rect").count() >= 1
    assert page.locator(".breadcrumbs a").first.inner_text() == "Home"
    page.screenshot(path=str(ARTIFACTS / "admin-queue-overview-1280.png"), full_page=True)
    assert Job.objects.filter(state=JobState.DONE).count() == 3


# -- issue 28: the pages an operator opens at 3 a.m., at two widths ----------------------

SIZES = [(1280, 800), (1920, 1080)]


def shoot(page, tmp_path: Path, name: str) -> None:
    """Screenshots of the page at each size, into the test's tmp dir (paths printed)."""
    for width, height in SIZES:
        page.set_viewport_size({"width": width, "height": height})
        path = tmp_path / f"{name}-{width}.png"
        page.screenshot(path=str(path))
        print(f"screenshot: {path}")  # noqa: T201  (to look at: pytest -s)
    page.set_viewport_size({"width": WIDTH, "height": HEIGHT})


def table_fits(page) -> bool:
    """The list's right edge within the window and within its container, which would
    scroll (and so hide) what overflows it."""
    table = page.locator("#result_list").bounding_box()
    shown = page.locator("#changelist .results").bounding_box()
    assert table is not None and shown is not None
    return table["x"] + table["width"] <= min(WIDTH, shown["x"] + shown["width"])


def test_a_failed_jobs_page_opens_with_its_error_and_retry(server_url, page, tmp_path):
    from django_skipqueue.runtime.worker import Worker
    from tests.testapp.tasks import always_fails

    job = always_fails.using(max_attempts=1).enqueue("bad input for invoice 42")
    Worker(concurrency=1, burst=True, listen=False, reap_interval=0).run()
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/job/")
    cell = page.locator(f"#result_list tbody tr:has(input[value='{job.id}']) .skipqueue-error")
    assert cell.inner_text() == "RuntimeError: bad input for invoice 42"
    page.goto(f"{server_url}/admin/skipqueue/job/{job.id}/change/")
    banner = page.locator(".skipqueue-failed-banner")
    assert "Failed after 1 attempt: RuntimeError: bad input for invoice 42" in banner.inner_text()
    assert in_view(banner) and in_view(banner.locator("button"))
    errors = page.locator(".field-error_history")
    assert errors.bounding_box()["y"] < HEIGHT  # right under the banner, not far below
    assert "bad input for invoice 42" in errors.inner_text()
    shoot(page, tmp_path, "failed-job")
    banner.locator("button").click()
    assert f"Job {job.id} retried." in page.locator("ul.messagelist").inner_text()
    job.refresh_from_db()
    assert job.state == JobState.PENDING


def test_a_cancelled_jobs_page_says_who_and_when(server_url, page, tmp_path):
    job = JobFactory(task="shop.tasks.send_welcome_email")
    Job.objects.cancel([job.id], by="alice")
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/job/{job.id}/change/")
    banner = page.locator(".skipqueue-cancelled-banner")
    assert banner.inner_text().startswith("Cancelled by alice at ")
    assert in_view(banner)
    shoot(page, tmp_path, "cancelled-job")


def test_the_worker_list_shows_alive_stopped_and_lost(server_url, page, tmp_path):
    from datetime import timedelta

    from django.db.models.functions import Now

    from django_skipqueue.models import WorkerKind, WorkerProcess

    def row(pid: int, kind: str, queues: list[str]) -> WorkerProcess:
        worker = WorkerProcess.objects.register(queues=queues, concurrency=4, kind=kind)
        WorkerProcess.objects.filter(id=worker.id).update(pid=pid, hostname="web-3.example.com")
        return worker

    row(101, WorkerKind.WORKER, ["default", "mail"])
    WorkerProcess.objects.mark_stopped(row(102, WorkerKind.WORKER, ["default"]).id)
    lost = row(103, WorkerKind.CONSUMER, ["webhooks"])
    WorkerProcess.objects.filter(id=lost.id).update(heartbeat_at=Now() - timedelta(minutes=7))
    row(104, WorkerKind.RELAY, ["webhooks"])
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/workerprocess/")
    statuses = page.locator("#result_list tbody td.field-shown_status").all_inner_texts()
    assert statuses == ["alive", "alive", "lost", "stopped"]
    shoot(page, tmp_path, "worker-list")
    lost_row = page.locator("#result_list tbody tr", has_text="lost")
    assert in_view(lost_row.locator("td.field-heartbeat"))
    assert lost_row.locator("td.field-heartbeat").inner_text() == "7 min ago"
    assert table_fits(page)


def test_the_schedules_list_fits_1280_px_with_the_next_runs_in_their_zone(
    server_url, page, tmp_path
):
    from django.db.models.functions import Now

    from django_skipqueue.maintenance.scheduler import defined_schedules, sync
    from tests.testapp.tasks import add

    schedules = {
        "SCHEDULES": {
            "nightly-invoice-reconciliation-for-accounting": {
                "task": add.name,
                "cron": "30 2 * * 1-5",
                "args": [1, 2],
                "timezone": "America/Los_Angeles",
            },
            "every-ten-seconds": {"task": add.name, "cron": "@every 10s", "args": [3, 4]},
        }
    }
    from django.test import override_settings

    with override_settings(SKIPQUEUE=schedules):
        sync(defined_schedules(), database="default")
    from django_skipqueue.models import Schedule

    Schedule.objects.update(last_occurrence_at=Now())
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/schedule/")
    shoot(page, tmp_path, "schedule-list")  # before the assertions: seen when they fail
    header = page.locator("#result_list thead th.column-next_runs")
    assert "schedule's time zone" in header.inner_text().lower()
    assert table_fits(page)
    assert in_view(header)
    cell = page.locator("#result_list tbody tr", has_text="nightly").locator("td.field-next_runs")
    assert cell.inner_text().count("02:30:00") == 3
    assert "America/Los_Angeles" in cell.inner_text()


def test_pausing_a_queue_asks_first_then_the_overview_says_who(server_url, page, tmp_path):
    from django_skipqueue.models import Queue

    JobFactory.create_batch(3, queue_name="mail")
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/job/overview/")
    page.locator("#queue-overview tr", has_text="mail").locator("input[value=Pause]").click()
    confirm = page.locator("input[value='Yes, pause mail']")
    confirm.wait_for(state="visible", timeout=10_000)
    assert "3 jobs are due now and will wait." in page.locator("#content-main").inner_text()
    assert not Queue.objects.paused().exists()
    assert in_view(confirm)
    shoot(page, tmp_path, "pause-confirmation")
    confirm.click()
    page.locator("#queue-overview").wait_for(state="visible", timeout=10_000)
    assert Queue.objects.get(name="mail").paused_by == "ops"
    flow = page.locator("#queue-overview tr", has_text="mail").locator(".skipqueue-paused-by")
    assert flow.inner_text().startswith("by ops, ")


def test_a_running_jobs_progress_and_the_overviews_trends(server_url, page, tmp_path):
    """Progress while a job runs (a real worker in this process writes it), then the
    overview's four charts per queue, readable at both widths."""
    import threading

    from django_skipqueue.runtime.worker import Worker
    from tests.testapp import tasks

    tasks.progress_release.clear()
    worker = Worker(concurrency=1, listen=False, poll_interval=0.05, reap_interval=0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        job = tasks.reports_progress.enqueue(steps=400)
        wait_until(lambda: (Job.objects.get(id=job.id).progress or {}).get("done") == 400)
        for name, scale in (("default", 40), ("mail", 7), ("reports", 1)):
            QueueMinute.objects.add(
                {
                    name: {
                        "succeeded": 12 * scale,
                        "retried": scale,
                        "failed": scale // 2,
                        "pickups": 13 * scale,
                        "pickup_buckets": [0, 0, 5 * scale, 8 * scale],
                        "oldest_due_seconds": 3.5 * scale,
                    }
                }
            )
        log_in(page, server_url)
        page.goto(f"{server_url}/admin/skipqueue/job/?state__exact=running")
        row = page.locator(f"#result_list tbody tr:has(input[value='{job.id}'])")
        assert row.locator("progress").get_attribute("value") == "100"
        assert "400 of 400 (100%): step 400" in row.inner_text()
        assert in_view(row.locator(".skipqueue-progress"))
        shoot(page, tmp_path, "job-list-progress")
        page.goto(f"{server_url}/admin/skipqueue/job/{job.id}/change/")
        assert "400 of 400 (100%): step 400" in page.locator(".field-progress_shown").inner_text()
        tasks.add.using(queue_name="nightly-" + "long" * 10).enqueue(1, 2)  # nobody serves it
        page.goto(f"{server_url}/admin/skipqueue/job/overview/")
        assert page.locator(".skipqueue-unattended").count() == 1
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        assert in_view(page.locator(".skipqueue-unattended .skipqueue-badge"))
        charts = page.locator(".skipqueue-trends .skipqueue-chart")
        assert charts.count() == 12  # three queues, four charts each
        for width, height in SIZES:
            page.set_viewport_size({"width": width, "height": height})
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
        legend = charts.first.locator(".skipqueue-legend")
        assert [item.inner_text().strip() for item in legend.all()] == [
            "succeeded",
            "retried",
            "failed",
        ]
        shoot(page, tmp_path, "overview-trends")
    finally:
        tasks.progress_release.set()
        worker.stop()
        thread.join(timeout=20)


# -- issue 54: every page within 1280 and 1920 px, the end of an error in view -----------


def fits_at_both_widths(page, tmp_path: Path, name: str, *selectors: str) -> None:
    """At 1280 and 1920 px: nothing wider than the window (no page scroll sideways), and
    each element of `selectors` ends within it (its text wraps, or scrolls in its box)."""
    for width, height in SIZES:
        page.set_viewport_size({"width": width, "height": height})
        page.screenshot(path=str(tmp_path / f"{name}-{width}.png"))
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), (
            name,
            width,
        )
        for selector in selectors:
            for box in (item.bounding_box() for item in page.locator(selector).all()):
                assert box is not None and box["x"] + box["width"] <= width, (name, width, selector)
    page.set_viewport_size({"width": WIDTH, "height": HEIGHT})


def test_a_long_error_and_its_traceback_wrap_within_the_page(server_url, page, tmp_path):
    """Trial finding: a failed job's error lines and traceback ran off the right edge,
    and the end of the message, the part that says what went wrong, was out of sight."""
    from django_skipqueue.runtime.worker import Worker
    from tests.testapp.tasks import always_fails

    message = "charge refused for " + "customer-account-7f3a9c2e1b " * 12 + "END-OF-MESSAGE"
    job = always_fails.using(max_attempts=1).enqueue(message)
    Worker(concurrency=1, burst=True, listen=False, reap_interval=0).run()
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/job/{job.id}/change/")
    fits_at_both_widths(
        page,
        tmp_path,
        "long-error",
        ".field-error_history p",
        ".field-error_history pre",
        ".skipqueue-failed-banner",
    )
    end = page.locator(".field-error_history p", has_text="END-OF-MESSAGE")
    box = end.bounding_box()
    assert box is not None and box["x"] + box["width"] <= WIDTH
    page.goto(f"{server_url}/admin/skipqueue/job/")
    fits_at_both_widths(page, tmp_path, "long-error-list", "#result_list")


def test_the_workflow_list_and_page_fit_with_finished_at_in_view(server_url, page, tmp_path):
    from django_skipqueue import chain, group
    from django_skipqueue.testing import run_jobs
    from tests.testapp.tasks import add

    workflow = chain(group(add.s(n, n) for n in range(3)), add.si(1, 1)).enqueue()
    run_jobs()
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/workflow/")
    fits_at_both_widths(page, tmp_path, "workflow-list", "#result_list")
    assert in_view(page.locator("#result_list thead th.column-shown_finished_at"))
    page.goto(f"{server_url}/admin/skipqueue/workflow/{workflow.id}/change/")
    fits_at_both_widths(page, tmp_path, "workflow-page", "fieldset")
    # The job tree starts at the other values' edge (Django's aligned forms indent a
    # list by 160 px: the tree stood ~130 px right of them).
    tree = page.locator(".field-job_tree ul.skipqueue-tree").bounding_box()
    name = page.locator(".field-name .readonly").bounding_box()
    assert tree is not None and name is not None
    assert abs(tree["x"] - name["x"]) <= 2, (tree, name)


def test_the_overview_says_why_a_queue_lags_and_fits(server_url, page, tmp_path):
    from django_skipqueue.models import WorkerProcess
    from django_skipqueue.testing import run_jobs
    from tests.testapp.tasks import three_a_minute

    WorkerProcess.objects.create(hostname="web-1", pid=7, queues=["default"])
    for n in range(5):
        three_a_minute.enqueue(n)
    run_jobs()
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/job/overview/")
    reason = page.locator("#queue-overview .skipqueue-reason")
    assert "three_a_minute's rate limit (3/m)" in reason.first.inner_text()
    fits_at_both_widths(page, tmp_path, "overview-reasons", "#queue-overview")


def test_the_task_overview_fits_with_a_long_name_and_error(server_url, page, tmp_path):
    from django_skipqueue.models import TaskMinute

    name = "partners.integrations.salesforce.tasks." + "synchronise_account_" * 6 + "end"
    error = "builtins.RuntimeError: refused for " + "customer-account-7f3a9c2e1b " * 12 + "END"
    TaskMinute.objects.add({name: {"runs": 3, "failed": 1, "last_error": (1, error)}})
    TaskMinute.objects.add({"mail.send": {"runs": 90, "succeeded": 90}})
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/job/overview/")
    page.get_by_role("link", name="Per task: the task overview.").click()
    fits_at_both_widths(page, tmp_path, "task-overview", "#task-overview", ".skipqueue-last-error")
    assert in_view(page.locator("#task-overview td.skipqueue-last-error", has_text="END"))


def test_a_200_byte_queue_name_keeps_the_overview_row_short_and_fits_the_job_page(
    server_url, page, tmp_path
):
    """Trial finding 11: the name made its overview row ten lines tall, and its end ran
    out of the job page's box."""
    long = "reports.monthly.finance.accounts-receivable." * 4 + "END"
    job = JobFactory(queue_name=long)
    JobFactory()
    log_in(page, server_url)
    page.goto(f"{server_url}/admin/skipqueue/job/overview/")
    fits_at_both_widths(page, tmp_path, "long-queue-overview", "#queue-overview")
    row = page.locator("#queue-overview tbody tr", has=page.locator(f"a[title='{long}']"))
    other = page.locator("#queue-overview tbody tr", has=page.get_by_role("link", name="default"))
    tall, short = row.bounding_box(), other.bounding_box()
    assert tall is not None and short is not None
    assert tall["height"] <= 3 * short["height"], (tall, short)  # three lines at most
    page.goto(f"{server_url}/admin/skipqueue/job/{job.id}/change/")
    fits_at_both_widths(page, tmp_path, "long-queue-job", ".field-queue_name .readonly")
