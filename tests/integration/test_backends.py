"""The Tasks API's backend contract, against SkipQueueBackend: django.tasks on Django
6.x, the django-tasks backport (django_tasks) on Django 5.2 (core/tasks_api.py)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

tasks_api = pytest.importorskip(
    "django_skipqueue.core.tasks_api",
    reason="neither django.tasks (Django 6.0+) nor the django-tasks backport is installed",
)

from django.db import transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from django_skipqueue import Cron, backends  # noqa: E402
from django_skipqueue.backends import SkipQueueBackend  # noqa: E402
from django_skipqueue.core.tasks_api import (  # noqa: E402
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    default_task_backend,
    task_enqueued,
    task_finished,
    task_started,
)
from django_skipqueue.models import Job, JobState  # noqa: E402
from django_skipqueue.testing import run_jobs  # noqa: E402
from tests.testapp import django_tasks, tasks  # noqa: E402

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_backend_serves_djangos_api_where_it_exists_else_the_backports():
    import importlib

    import django

    expected = "django.tasks" if django.VERSION >= (6, 0) else "django_tasks"
    assert tasks_api.API == expected
    base = importlib.import_module(f"{expected}.backends.base").BaseTaskBackend
    assert issubclass(SkipQueueBackend, base)
    assert issubclass(backends.Task, importlib.import_module(f"{expected}.base").Task)


def test_the_backend_declares_what_it_supports():
    task_backends = tasks_api.task_backends

    backend = task_backends["default"]
    assert isinstance(backend, SkipQueueBackend)
    assert backend.supports_defer and backend.supports_priority
    assert backend.supports_get_result and backend.supports_async_task


def test_the_backend_without_the_app_installed_is_a_check_error(settings):
    from django.test import override_settings

    without = [name for name in settings.INSTALLED_APPS if name != "django_skipqueue"]
    assert default_task_backend.check() == []
    with override_settings(INSTALLED_APPS=without):
        [error] = default_task_backend.check()
    assert error.id == "skipqueue.E008"
    assert "'django_skipqueue' is not in INSTALLED_APPS" in error.msg


def test_enqueue_writes_a_job_row_and_returns_a_ready_result():
    result = django_tasks.dj_add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY
    job = Job.objects.get(id=int(result.id))
    assert (job.task, job.args, job.state) == (
        "tests.testapp.django_tasks.dj_add",
        [2, 3],
        JobState.PENDING,
    )
    assert result.enqueued_at == job.created_at


def test_get_result_follows_the_job_through_every_status():
    result = django_tasks.dj_add.enqueue(2, 3)
    [job] = Job.objects.claim(queues=["default"])
    assert default_task_backend.get_result(result.id).status == TaskResultStatus.RUNNING
    from django_skipqueue.runtime.executor import execute

    execute(job)
    result.refresh()
    assert (result.status, result.return_value, result.attempts) == (
        TaskResultStatus.SUCCESSFUL,
        5,
        1,
    )
    assert result.finished_at is not None and result.is_finished


def test_a_raising_task_ends_failed_with_its_errors():
    result = django_tasks.dj_fails.enqueue()
    Job.objects.filter(id=int(result.id)).update(max_attempts=1)
    run_jobs()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    [error] = result.errors
    assert error.exception_class is ValueError
    assert "nope" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018


def test_defer_with_run_after_is_not_run_before_it():
    later = timezone.now() + timedelta(hours=1)
    result = django_tasks.dj_add.using(run_after=later).enqueue(1, 1)
    assert Job.objects.get(id=int(result.id)).run_at == later
    assert run_jobs() == []


def test_priority_orders_the_claim():
    low = django_tasks.dj_add.using(priority=-10).enqueue(1, 1)
    high = django_tasks.dj_add.using(priority=50).enqueue(1, 1)
    assert [execution.job_id for execution in run_jobs()] == [int(high.id), int(low.id)]


def test_a_context_task_gets_djangos_context():
    result = django_tasks.dj_context.enqueue()
    run_jobs()
    result.refresh()
    assert result.return_value == {"attempt": 1, "id": result.id}


def test_an_async_task_runs():
    result = django_tasks.dj_async.enqueue(21)
    run_jobs()
    result.refresh()
    assert result.return_value == 42


def test_our_options_work_under_our_task_decorator_on_every_django():
    result = django_tasks.dj_options.enqueue()
    job = Job.objects.get(id=int(result.id))
    assert (job.max_attempts, job.lease) == (3, timedelta(seconds=60))


def test_the_options_a_celery_port_uses_reach_the_job_and_the_worker():
    from django_skipqueue.tasks.registry import registry

    result = django_tasks.dj_celery_options.enqueue()
    job = Job.objects.get(id=int(result.id))
    assert job.expires_at == job.created_at + timedelta(seconds=600)
    assert (job.rate_key, job.rate_limit) == (django_tasks.dj_celery_options.module_path, "100/m")
    native = registry.get(job.task)
    assert (native.time_limit, native.soft_time_limit) == (
        timedelta(seconds=30),
        timedelta(seconds=10),
    )


@pytest.mark.skipif(
    not django_tasks.OWN_TASK_TAKES_OPTIONS, reason="Django 6.0's @task takes no options"
)
def test_our_options_work_under_djangos_task_decorator():
    result = django_tasks.dj_options_django.enqueue()
    job = Job.objects.get(id=int(result.id))
    assert (job.max_attempts, job.lease) == (4, timedelta(seconds=30))


def test_an_option_our_backend_does_not_know_is_named():
    with pytest.raises(TypeError, match=r"got max_tries: not an option of TASKS\['default'\]"):
        backends.task(max_tries=3)(django_tasks.dj_add.func)


def test_an_unknown_id_raises_task_result_does_not_exist():
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("999999")
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result("not-a-number")


def test_a_queue_outside_the_allowlist_is_refused():
    with pytest.raises(InvalidTask, match="not valid for backend"):
        django_tasks.dj_add.using(queue_name="elsewhere")


def test_arguments_that_are_not_json_are_refused_with_djangos_type_error_too():
    with pytest.raises(InvalidTask, match="argument 0 is a builtins.object"):
        django_tasks.dj_add.enqueue(object(), 1)
    with pytest.raises(TypeError, match="argument 0 is a builtins.object"):  # Django's docs
        django_tasks.dj_add.enqueue(object(), 1)
    with pytest.raises(TypeError) as raised:
        django_tasks.dj_add.enqueue(1, {"when": timezone.now()})
    # normalize_json's words, as Django's and the backport's TaskResult say them
    assert "Unsupported type: <class 'datetime.datetime'>" in str(raised.value)
    assert "argument 1['when'] is a datetime.datetime" in str(raised.value)
    assert not Job.objects.exists()


def test_a_return_value_that_is_not_json_fails_with_djangos_type_error_once():
    result = django_tasks.dj_returns_object.enqueue()
    run_jobs()
    result.refresh()
    [error] = result.errors  # one attempt: another would return the same
    assert error.exception_class_path == "builtins.TypeError"  # as Django's backends record
    assert error.exception_class is TypeError
    assert "Unsupported type: <class 'object'>" in error.traceback
    assert "the return value is a builtins.object" in error.traceback
    assert (result.status, result.attempts) == (TaskResultStatus.FAILED, 1)


def test_started_at_is_the_first_attempts_and_worker_ids_name_each_attempt(worker_process):
    result = django_tasks.dj_add.enqueue(1, 2)
    [first] = Job.objects.claim(queues=["default"], worker=worker_process)
    assert Job.objects.release(first.id, first.attempts)
    run_jobs()

    result.refresh()
    job = Job.objects.get(id=int(result.id))
    assert result.started_at == first.started_at < job.started_at
    assert result.last_attempted_at == job.started_at
    assert result.attempts == 2
    assert result.worker_ids[0] == str(worker_process.id)
    assert result.worker_ids[1].startswith("in-process:") and result.worker_ids[1].endswith(
        f":{os.getpid()}"
    )


# -- a result's task is the job's own (issue 13, A1) -----------------------------------


def test_a_result_carries_its_own_jobs_options_not_the_last_using():
    later = timezone.now() + timedelta(hours=1)
    first = django_tasks.dj_add.using(priority=10, queue_name="other", run_after=later)
    result = first.enqueue(1, 2)
    django_tasks.dj_add.enqueue(3, 4)  # validates a copy with the default options

    task = default_task_backend.get_result(result.id).task
    assert (task.priority, task.queue_name, task.run_after, task.backend) == (
        10,
        "other",
        later,
        "default",
    )
    assert task.func is django_tasks.dj_add.func
    assert django_tasks.dj_add.get_result(result.id).id == result.id  # same function


def test_a_task_that_enqueues_itself_from_its_context_keeps_its_queue_and_priority():
    django_tasks.dj_add.enqueue(0, 0)  # the default options validated last
    result = django_tasks.dj_reenqueues.using(priority=7, queue_name="other").enqueue(1)
    django_tasks.dj_reenqueues.enqueue(0)

    run_jobs(queues=["other"])

    again = Job.objects.filter(task=result.task.module_path).exclude(id=int(result.id))
    assert sorted(again.values_list("queue_name", "priority")) == [
        ("default", 0),
        ("other", 7),
    ]
    result.refresh()
    assert result.return_value == {"priority": 7, "queue_name": "other"}


# -- every row has a result; a task workers cannot find is refused (A2) ----------------


def test_get_result_returns_a_row_whose_task_this_process_does_not_know():
    from tests.queue.test_managers import insert_raw

    job_id = insert_raw(task="'reports.tasks.monthly_totals'")
    result = default_task_backend.get_result(str(job_id))
    assert (result.id, result.status) == (str(job_id), TaskResultStatus.READY)
    assert result.task.module_path == "reports.tasks.monthly_totals"
    with pytest.raises(Exception, match="no task named 'reports.tasks.monthly_totals'"):
        result.task.call()


def test_a_django_task_in_a_module_workers_never_import_is_refused_when_defined():
    import importlib

    with pytest.raises(InvalidTask, match=r"workers do not import.*TASK_MODULES"):
        importlib.import_module("tests.testapp.undiscovered_django_tasks")
    assert not Job.objects.exists()


def test_an_enqueue_inside_a_rolled_back_transaction_never_exists():
    with pytest.raises(RuntimeError), transaction.atomic():
        django_tasks.dj_add.enqueue(1, 1)
        raise RuntimeError
    assert not Job.objects.exists()


def test_djangos_task_signals_are_sent_with_the_backend_as_sender():
    seen = []

    def record(sender, task_result, signal, **kwargs):
        seen.append((signal, sender, task_result.status))

    for signal in (task_enqueued, task_started, task_finished):
        signal.connect(record, weak=False)
    try:
        django_tasks.dj_add.enqueue(1, 1)
        run_jobs()
    finally:
        for signal in (task_enqueued, task_started, task_finished):
            signal.disconnect(record)
    assert [(s, status) for s, _, status in seen] == [
        (task_enqueued, TaskResultStatus.READY),
        (task_started, TaskResultStatus.RUNNING),
        (task_finished, TaskResultStatus.SUCCESSFUL),
    ]
    assert {sender for _, sender, _ in seen} == {SkipQueueBackend}


def test_a_failed_tasks_task_finished_is_sent_while_its_exception_is_handled():
    """As Django's own backends do: its receiver logs a failure with logger.exception
    (for error monitoring), which needs the exception in sys.exc_info()."""
    import sys

    seen = []

    def record(sender, task_result, **kwargs):
        seen.append((task_result.status, sys.exc_info()[1]))

    task_finished.connect(record, weak=False)
    try:
        result = django_tasks.dj_fails.enqueue()
        Job.objects.filter(id=int(result.id)).update(max_attempts=1)
        run_jobs()
    finally:
        task_finished.disconnect(record)
    [(status, handled)] = seen
    assert status == TaskResultStatus.FAILED
    assert isinstance(handled, ValueError) and str(handled) == "nope"


def test_djangos_task_signals_are_bridged_only_once_a_django_task_is_registered():
    """A project whose tasks are all @skipqueue.task keeps our job signals without
    receivers (each one costs about 3 us a send, twice a job); the first Task declared
    with the API's @task connects them, before any job of it can run. A fresh
    interpreter: this one registered the test app's Tasks at start-up."""
    import subprocess
    import sys

    code = (
        "import django\n"
        "from django.conf import settings\n"
        "settings.configure(\n"
        "    INSTALLED_APPS=['django_skipqueue'], USE_TZ=True,\n"
        "    DATABASES={'default': {'ENGINE': 'django.db.backends.postgresql', 'NAME': 'x'}},\n"
        "    TASKS={'default': {'BACKEND': 'django_skipqueue.backends.SkipQueueBackend'}},\n"
        "    SKIPQUEUE={'TASK_MODULES': ['bridged']},\n"
        ")\n"
        "django.setup()\n"
        "from django_skipqueue import signals, task\n"
        "from django_skipqueue.core.tasks_api import task as api_task\n"
        "task(lambda: None, name='ours')\n"
        "def counts():\n"
        "    return [len(s.receivers) for s in\n"
        "            (signals.job_started, signals.job_succeeded, signals.job_failed)]\n"
        "print(counts(), end=' ')\n"
        "import types, sys\n"
        "module = sys.modules['bridged'] = types.ModuleType('bridged')\n"
        "def work(): return 1\n"
        "work.__module__ = 'bridged'\n"
        "module.work = api_task(work)\n"
        "print(counts())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 0, 0] [1, 1, 1]"


@pytest.mark.slow
def test_a_django_task_runs_under_runworker(start_worker):
    from tests.processes import wait_until

    result = django_tasks.dj_other.enqueue()
    start_worker("--queue", "other")
    wait_until(lambda: default_task_backend.get_result(result.id).is_finished, timeout=30)
    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, "other")


def test_a_unique_task_under_the_backend_returns_the_holders_result():
    first = django_tasks.dj_unique.enqueue(7)
    second = django_tasks.dj_unique.enqueue(order_id=7)
    assert second.id == first.id
    assert Job.objects.filter(task=django_tasks.dj_unique.module_path).count() == 1


def test_a_schedule_under_the_backend_is_bound_to_its_task():
    from django_skipqueue.core.compat import build_unvalidated

    declared = build_unvalidated(
        backends.Task,
        func=django_tasks.dj_add.func,
        priority=0,
        backend="default",
        queue_name="default",
        run_after=None,
        takes_context=False,
        schedule=Cron(expression="0 3 * * *", args=[1, 2]),
    )
    (cron,) = default_task_backend._native(declared).schedules
    assert (cron.name, cron.task, cron.args) == (
        django_tasks.dj_add.module_path,
        django_tasks.dj_add.module_path,
        [1, 2],
    )


@pytest.mark.parametrize(
    ("column", "stored"),
    [
        ("run_at", "'infinity'"),
        ("scheduled_for", "'-infinity'"),
        ("finished_at", "'20000-01-01 00:00+00'"),
        ("args", "'\"abc\"'::jsonb"),
        ("kwargs", "'[1]'::jsonb"),
        ("args", "'[1e4400]'::jsonb"),
        ("kwargs", "'{\"n\": 1e4400}'::jsonb"),
    ],
)
def test_get_result_of_a_row_another_client_wrote_badly_answers(column, stored):
    from django.db import connection

    result = django_tasks.dj_add.enqueue(1, 2)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE skipqueue_job SET {column} = {stored} WHERE id = %s", [result.id])

    found = default_task_backend.get_result(result.id)

    assert found.status == TaskResultStatus.READY
    assert isinstance(found.args, list) and isinstance(found.kwargs, dict)
    if column == "args" and "abc" in stored:
        assert found.args == []  # not ["a", "b", "c"]
    if column != "run_at":  # 'infinity' is never due
        run_jobs()
        failed = default_task_backend.get_result(result.id)
        assert failed.status == TaskResultStatus.FAILED and failed.errors  # with the reason


@pytest.mark.parametrize(
    "assignment",
    [
        "errors = '{\"x\": 1}'::jsonb",
        "errors = '[[[[1]]], \"x\"]'::jsonb",
        "worker_ids = '5'::jsonb",
        "lease = interval '100000000 years'",
        "attempts = 2147483647, max_attempts = 2147483647",
    ],
)
def test_get_result_of_other_broken_rows_answers_in_bounded_memory(assignment):
    """Trial finding F4: an attempt count of two billion built a list of two billion
    worker ids (16 GB); an errors object, a worker_ids number and an interval longer than
    a timedelta raised."""
    from django.db import connection

    from django_skipqueue.backends import WORKER_IDS_SHOWN
    from tests.guard import setting_up

    result = django_tasks.dj_add.enqueue(1, 2)
    with setting_up(), connection.cursor() as cursor:
        cursor.execute(f"UPDATE skipqueue_job SET {assignment} WHERE id = %s", [result.id])

    found = default_task_backend.get_result(result.id)

    assert found.status == TaskResultStatus.READY
    assert len(found.worker_ids) <= WORKER_IDS_SHOWN
    assert all(isinstance(error.traceback, str) for error in found.errors)


def test_django_tasks_are_steps_of_workflows():
    """A django.tasks Task under SkipQueueBackend has .s() and .si(): its jobs run in a
    chain as ours do, each receiving its parent's result first."""
    from django_skipqueue import chain, chord, group

    workflow = chain(django_tasks.dj_add.s(1, 2), django_tasks.dj_add.s(10)).enqueue()
    run_jobs()
    assert workflow.wait(timeout=5) == 13
    fan = chord(group(django_tasks.dj_add.si(n, n) for n in range(3)), tasks.total.s()).enqueue()
    run_jobs()
    assert fan.wait(timeout=5) == 6


def test_a_failed_tasks_traceback_is_logged_once(caplog):
    """Django's task_finished receiver logs a failure with its traceback (for error
    monitoring); ours said it again, so every failure showed twice. Ours is one line now,
    for the last failure of such a Task; an attempt that is retried keeps its own."""
    import logging

    caplog.set_level(logging.INFO)
    result = django_tasks.dj_fails.enqueue()
    Job.objects.filter(id=int(result.id)).update(max_attempts=1)
    run_jobs()
    with_traceback = [
        r for r in caplog.records if r.exc_info or "Traceback (most recent call last)" in r.message
    ]
    assert [r.name for r in with_traceback] == [tasks_api_logger_name()]
    assert any(
        "job raised" in r.message and r.name.startswith("django_skipqueue") for r in caplog.records
    )


def tasks_api_logger_name() -> str:
    """Django's own tasks logger: "django.tasks", or the backport's "django_tasks"."""
    backport = TaskResultStatus.__module__.startswith("django_tasks")
    return "django_tasks" if backport else "django.tasks"
