from __future__ import annotations

import pytest
from django.core.checks import run_checks

from django_skipqueue.checks import check_database, check_settings


def ids(errors) -> list[str]:
    return [error.id for error in errors]


def test_valid_settings_pass(settings):
    assert check_settings() == []
    assert check_database() == []


def test_unknown_key_is_reported_with_the_nearest_valid_one(settings):
    settings.SKIPQUEUE = {"LEASE_SECOND": 10}
    [error] = check_settings()
    assert error.id == "skipqueue.E001"
    assert "LEASE_SECOND" in error.msg
    assert error.hint == "Did you mean 'LEASE_SECONDS'?"


def test_values_of_the_wrong_type_are_reported_not_raised(settings):
    settings.SKIPQUEUE = {"LEASE_SECONDS": "soon", "MAX_ATTEMPTS": 0, "RETRY_JITTER": 2}
    errors = check_settings()
    assert ids(errors) == ["skipqueue.E002"] * 3
    assert "LEASE_SECONDS" in errors[0].msg
    assert all(len(error.msg) < 80 for error in errors)


def test_skipqueue_must_be_a_dict(settings):
    settings.SKIPQUEUE = ["LEASE_SECONDS"]
    assert ids(check_settings()) == ["skipqueue.E003"]


def test_an_unknown_database_alias_is_reported(settings):
    settings.SKIPQUEUE = {"DATABASE_ALIAS": "queue"}
    assert ids(check_database()) == ["skipqueue.E004"]


@pytest.mark.django_db(transaction=True)
def test_a_queue_database_without_autocommit_is_refused_and_the_worker_does_not_start(
    monkeypatch,
):
    """With AUTOCOMMIT = False the worker claimed and acked in a transaction nobody
    committed: it reported successes while every job stayed pending."""
    from django.core.management import call_command
    from django.core.management.base import CommandError, SystemCheckError
    from django.db import connection

    from django_skipqueue.models import Job
    from tests.testapp import tasks

    job = tasks.add.enqueue(1, 2)
    monkeypatch.setitem(connection.settings_dict, "AUTOCOMMIT", False)
    [error] = check_database()
    assert error.id == "skipqueue.E013" and "'default' has AUTOCOMMIT off" in error.msg
    with pytest.raises(SystemCheckError, match="skipqueue.E013"):
        call_command("runworker", "--burst", skip_checks=False)
    with pytest.raises(CommandError, match="has AUTOCOMMIT off"):  # checks skipped
        call_command("runworker", "--burst")
    monkeypatch.setitem(connection.settings_dict, "AUTOCOMMIT", 0)  # falsy is off too
    assert [error.id for error in check_database()] == ["skipqueue.E013"]
    monkeypatch.undo()
    assert Job.objects.get(id=job.id).state == "pending"  # nothing ran
    assert check_database() == []


def test_checks_run_through_djangos_framework(settings):
    settings.SKIPQUEUE = {"MAX_ATTEMPT": 3}
    assert "skipqueue.E001" in ids(run_checks())


def test_without_either_tasks_api_the_backend_is_refused_clearly():
    """Django 5.2 without the django-tasks backport: neither API can be imported (a None
    in sys.modules makes an import raise ImportError, as for a missing package)."""
    import importlib
    import sys

    import pytest
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    from django_skipqueue.checks import check_tasks_backend

    ours = {"default": {"BACKEND": "django_skipqueue.backends.SkipQueueBackend"}}
    with override_settings(TASKS=ours), pytest.MonkeyPatch.context() as patch:
        for name in ("django.tasks", "django_tasks"):
            patch.setitem(sys.modules, name, None)
        for name in ("django_skipqueue.core.tasks_api", "django_skipqueue.backends"):
            patch.delitem(sys.modules, name, raising=False)
        assert ids(check_tasks_backend()) == ["skipqueue.E006"]
        with pytest.raises(ImproperlyConfigured, match=r"or, on Django 5.2, the django-tasks"):
            importlib.import_module("django_skipqueue.backends")


def test_every_broken_schedule_is_reported_each_with_why_its_task_is_not_one(settings):
    from django_skipqueue.checks import check_schedules

    settings.SKIPQUEUE = {
        "SCHEDULES": {
            "undecorated": {"task": "json.dumps", "cron": "0 3 * * *"},
            "misspelt": {"task": "tests.testapp.tasks.ad", "cron": "0 3 * * *"},
            "unimported": {"task": "nowhere.tasks.job", "cron": "0 3 * * *"},
            "fine": {"task": "tests.testapp.tasks.add", "cron": "0 3 * * *", "args": [1, 2]},
        }
    }
    hints = [error.hint for error in check_schedules()]

    assert len(hints) == 3, hints
    assert "json.dumps is a function, but not a task" in hints[0]
    assert "call task(dumps)" in hints[0]
    assert "the module tests.testapp.tasks has no 'ad'" in hints[1]
    assert "no module imported at start-up is named 'nowhere.tasks'" in hints[2]
