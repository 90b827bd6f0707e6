"""A newcomer's setup mistakes: each is a system check or a one-line message, never a
traceback, and never a worker that idles without a word (issue 13, part B)."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO

import pytest
from django.core.checks import run_checks
from django.core.management import call_command

from django_skipqueue.tasks.registry import autodiscover, registry
from tests.processes import REPO_ROOT, child_env


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "django", *args],
        env=child_env(**env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_a_typo_in_task_modules_is_a_check_error_not_a_broken_manage_py():
    typo = json.dumps({"TASK_MODULES": ["tests.testapp.taskz"]})

    checked = manage("check", SKIPQUEUE_TEST_SETTINGS=typo)
    other = manage("shell", "-c", "print('started')", SKIPQUEUE_TEST_SETTINGS=typo)

    assert checked.returncode == 1
    assert "skipqueue.E009" in checked.stderr and "'tests.testapp.taskz'" in checked.stderr
    assert "Traceback" not in checked.stderr
    assert other.returncode == 0, other.stderr  # Django starts: it was a traceback in ready()
    assert other.stdout.endswith("started\n")


def test_the_task_modules_check_names_the_module_and_the_import_error(settings):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, "TASK_MODULES": ["tests.testapp.taskz"]}
    try:
        autodiscover()
        [error] = [e for e in run_checks() if e.id == "skipqueue.E009"]
        assert "tests.testapp.taskz" in error.msg
        assert "No module named 'tests.testapp.taskz'" in error.hint
    finally:
        settings.SKIPQUEUE = {k: v for k, v in settings.SKIPQUEUE.items() if k != "TASK_MODULES"}
        registry.import_errors = {}


@pytest.mark.slow
def test_sqlite_is_caught_by_plain_check_with_a_hint_naming_the_alias_setting(tmp_path):
    result = manage("check", DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}")
    assert result.returncode == 1
    assert "skipqueue.E005" in result.stderr
    assert "SKIPQUEUE['DATABASE_ALIAS']" in result.stderr


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("command", [["runworker", "--burst"], ["queuestats"], ["reapjobs"]])
def test_a_command_before_migrate_says_to_migrate(empty_database_url, command):
    result = manage(*command, DATABASE_URL=empty_database_url)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    migrations = len(list((REPO_ROOT / "django_skipqueue" / "migrations").glob("0*.py")))
    assert f"lacks {migrations} migration(s) of django_skipqueue" in result.stderr
    assert "run `python manage.py migrate` first" in result.stderr


@pytest.mark.django_db
def test_the_quick_migration_check_sends_a_missing_migration_the_long_way():
    """`_all_applied` reads django_migrations once instead of importing every app's
    migrations; a migration of ours not recorded there fails it, and MigrationLoader
    then names it."""
    from django.core.management import CommandError
    from django.db.migrations.recorder import MigrationRecorder

    from django_skipqueue.management.preflight import _all_applied, require_migrated

    assert _all_applied("default")
    require_migrated("default")
    MigrationRecorder.Migration.objects.filter(
        app="skipqueue", name="0016_notify_waiting_workers"
    ).delete()  # rolled back with the test's transaction
    assert not _all_applied("default")
    with pytest.raises(CommandError, match=r"lacks 1 migration\(s\) of django_skipqueue \(0016_"):
        require_migrated("default")
    # django_migrations has no unique key: a row recorded twice does not stand in for
    # the missing one (an outside trial: a count of rows passed it).
    MigrationRecorder.Migration.objects.create(app="skipqueue", name="0001_initial")
    assert not _all_applied("default")


@pytest.mark.django_db(transaction=True)
def test_runworker_on_a_queue_nothing_uses_says_so_and_suggests_the_nearest(caplog):
    call_command("runworker", "--burst", "--no-listen", "--queue", "defualt", stdout=StringIO())
    assert "no registered task uses queue 'defualt' and no job is in it" in caplog.text
    assert "did you mean 'default'?" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_queue_with_jobs_but_no_registered_task_is_not_flagged(caplog):
    from tests.testapp import tasks

    tasks.add.using(queue_name="imports").enqueue(1, 2)
    call_command("runworker", "--burst", "--no-listen", "--queue", "imports", stdout=StringIO())
    assert "no registered task uses queue" not in caplog.text


@pytest.mark.django_db
def test_a_role_that_cannot_read_the_migrations_gets_the_job_tables_columns_checked():
    """A least-privilege worker role cannot read django_migrations (fault test S13 runs
    a worker as one); the preflight then checks the job table it uses."""
    from django.core.management import CommandError
    from django.db import connection

    from django_skipqueue.management.preflight import _require_job_table

    _require_job_table("default")  # the migrated table passes
    with connection.cursor() as cursor:  # rolled back with the test's transaction
        cursor.execute("ALTER TABLE skipqueue_job DROP COLUMN worker_ids")
    with pytest.raises(CommandError, match=r"lacks worker_ids: run `python manage.py migrate`"):
        _require_job_table("default")


@pytest.mark.slow
def test_a_bad_schedule_is_a_check_error_and_stops_runworker():
    bad = json.dumps(
        {"SCHEDULES": {"nightly": {"task": "tests.testapp.tasks.ad", "cron": "0 3 * * *"}}}
    )

    checked = manage("check", SKIPQUEUE_TEST_SETTINGS=bad)
    started = manage("runworker", "--burst", "--no-schedules", SKIPQUEUE_TEST_SETTINGS=bad)

    assert checked.returncode == 1
    assert "skipqueue.E010" in checked.stderr and "'tests.testapp.tasks.ad'" in checked.stderr
    assert "Traceback" not in checked.stderr
    assert started.returncode == 1  # runworker runs the checks first
    assert "skipqueue.E010" in started.stderr
