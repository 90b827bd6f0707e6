"""django-tasks' own test suite (0.12.0, github.com/RealOrangeOne/django-tasks, tests/),
adapted to run against SkipQueueBackend: under the backport on Django 5.2, under
django.tasks on 6.x (core/tasks_api.py; the backport's tests are django.tasks' own).

Each test names the one it adapts (`file::TestCase.test`). What changed, throughout:
- The backend is ours, a database-backed one: where the backport's ImmediateBackend
  runs a task inside `enqueue()`, here `run_jobs()` (our worker's claim and execute, in
  process) runs it, and `refresh()` reads the outcome from the job's row.
- Their tasks (tests/testapp/backport_tasks.py) make one attempt when they fail, as the
  backport's backends do; ours would retry them with backoff.
- Their `SimpleTestCase`s become pytest functions on the real database; async tests
  run through asgiref's `async_to_sync`, as pytest-asyncio is not a dependency.
Left out, with the reason at the end of this module: what tests only the backport's
in-memory backends, its custom-backend scaffolding, its test project's views, and
`test_utils.py` (its helper functions, no backend).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from datetime import datetime

import pytest

tasks_api = pytest.importorskip(
    "django_skipqueue.core.tasks_api",
    reason="neither django.tasks (Django 6.0+) nor the django-tasks backport is installed",
)

from asgiref.sync import async_to_sync  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import override_settings  # noqa: E402
from django.utils import timezone  # noqa: E402
from django.utils.module_loading import import_string  # noqa: E402

from django_skipqueue.backends import SkipQueueBackend  # noqa: E402
from django_skipqueue.backends import Task as SkipQueueTask  # noqa: E402
from django_skipqueue.core.tasks_api import (  # noqa: E402
    InvalidTask,
    Task,
    TaskResultDoesNotExist,
    TaskResultStatus,
    default_task_backend,
    task,
    task_backends,
)
from django_skipqueue.models import Job  # noqa: E402
from django_skipqueue.testing import run_jobs  # noqa: E402
from tests.testapp import backport_tasks as test_tasks  # noqa: E402

pytestmark = pytest.mark.django_db(transaction=True)

_exceptions = importlib.import_module(f"{tasks_api.API}.exceptions")
TaskResultMismatch = _exceptions.TaskResultMismatch
# django.tasks' name, and the backport's up to 0.12 (renamed after it)
InvalidTaskBackend = getattr(_exceptions, "InvalidTaskBackend", None) or getattr(
    _exceptions, "InvalidTaskBackendError", None
)
#: The logger of the API's signal receivers (each logs enqueued, started and finished).
TASKS_LOGGER = "django.tasks" if tasks_api.API == "django.tasks" else "django_tasks"
MIN_PRIORITY, MAX_PRIORITY = -100, 100
OURS = "django_skipqueue.backends.SkipQueueBackend"

#: test_tasks.py::TaskTestCase's TASKS, with ours in place of its Dummy and Immediate
#: backends ("immediate" there is the one without a queue allow-list).
TASKS = {
    "default": {"BACKEND": OURS, "QUEUES": ["default", "queue_1"]},
    "immediate": {"BACKEND": OURS, "QUEUES": []},
    "missing": {"BACKEND": "does.not.exist"},
}


@pytest.fixture(autouse=True)
def _tasks_setting():
    with override_settings(TASKS=TASKS):
        yield


def finished(result):
    """The result after our worker ran every due job (ImmediateBackend ran it already)."""
    run_jobs()
    result.refresh()
    return result


# -- test_tasks.py::TaskTestCase --------------------------------------------------------


def test_using_correct_backend():
    assert default_task_backend == task_backends["default"]
    assert isinstance(task_backends["default"], SkipQueueBackend)


def test_task_decorator():
    assert isinstance(test_tasks.noop_task, Task)
    assert isinstance(test_tasks.noop_task_async, Task)
    assert isinstance(test_tasks.noop_task_from_bare_decorator, Task)


def test_enqueue_task():
    result = test_tasks.noop_task.enqueue()

    assert result.status == TaskResultStatus.READY
    assert result.task == test_tasks.noop_task
    assert (result.args, result.kwargs) == ([], {})
    # Dummy's `results` list: here, the job's row
    assert Job.objects.get(id=int(result.id)).task == test_tasks.noop_task.module_path


def test_enqueue_task_async():
    result = async_to_sync(test_tasks.noop_task.aenqueue)()

    assert result.status == TaskResultStatus.READY
    assert result.task == test_tasks.noop_task
    assert (result.args, result.kwargs) == ([], {})
    assert Job.objects.filter(id=int(result.id)).exists()


def test_enqueue_with_invalid_argument():
    with pytest.raises(TypeError, match=r"Unsupported type: <class 'datetime.datetime'>"):
        test_tasks.noop_task.enqueue(datetime.now())  # noqa: DTZ005


def test_aenqueue_with_invalid_argument():
    with pytest.raises(TypeError, match=r"Unsupported type: <class 'datetime.datetime'>"):
        async_to_sync(test_tasks.noop_task.aenqueue)(datetime.now())  # noqa: DTZ005


def test_using_priority():
    assert test_tasks.noop_task.priority == 0
    assert test_tasks.noop_task.using(priority=1).priority == 1
    assert test_tasks.noop_task.priority == 0


def test_using_queue_name():
    assert test_tasks.noop_task.queue_name == "default"
    assert test_tasks.noop_task.using(queue_name="queue_1").queue_name == "queue_1"
    assert test_tasks.noop_task.queue_name == "default"


def test_using_run_after():
    now = timezone.now()
    assert test_tasks.noop_task.run_after is None
    assert test_tasks.noop_task.using(run_after=now).run_after == now
    assert test_tasks.noop_task.run_after is None


def test_using_unknown_backend():
    assert test_tasks.noop_task.backend == "default"
    with pytest.raises(InvalidTaskBackend, match="The connection 'unknown' doesn't exist."):
        test_tasks.noop_task.using(backend="unknown")


def test_using_missing_backend():
    with pytest.raises(
        InvalidTaskBackend, match="Could not find backend 'does.not.exist': No module named"
    ):
        test_tasks.noop_task.using(backend="missing")


def test_using_creates_new_instance():
    new_task = test_tasks.noop_task.using()
    assert new_task == test_tasks.noop_task
    assert new_task is not test_tasks.noop_task


def test_chained_using():
    now = timezone.now()
    run_after_task = test_tasks.noop_task.using(run_after=now)
    assert run_after_task.run_after == now
    priority_task = run_after_task.using(priority=10)
    assert (priority_task.priority, priority_task.run_after) == (10, now)
    assert run_after_task.priority == 0


def test_refresh_result():
    result = async_to_sync(test_tasks.noop_task.aenqueue)()
    original_result = dataclasses.asdict(result)

    result.refresh()
    assert dataclasses.asdict(result) == original_result

    async_to_sync(result.arefresh)()
    assert dataclasses.asdict(result) == original_result


def test_naive_datetime():
    with pytest.raises(InvalidTask, match="run_after must be an aware datetime"):
        test_tasks.noop_task.using(run_after=datetime.now())  # noqa: DTZ005


@pytest.mark.parametrize("priority", [-101, 101, 3.1])
def test_invalid_priority(priority):
    with pytest.raises(
        InvalidTask, match=f"priority must be a whole number between {MIN_PRIORITY} and"
    ):
        test_tasks.noop_task.using(priority=priority)


@pytest.mark.parametrize("priority", [100, -100, 0])
def test_valid_priority(priority):  # the end of test_invalid_priority
    assert test_tasks.noop_task.using(priority=priority).priority == priority


def test_unknown_queue_name():
    with pytest.raises(InvalidTask, match="Queue 'queue-2' is not valid for backend"):
        test_tasks.noop_task.using(queue_name="queue-2")
    # Validation is bypassed when the backend QUEUES is an empty list.
    without_list = test_tasks.noop_task.using(queue_name="queue-2", backend="immediate")
    assert without_list.queue_name == "queue-2"


def test_call_task():
    assert test_tasks.calculate_meaning_of_life.call() == 42


def test_call_task_async():
    assert async_to_sync(test_tasks.calculate_meaning_of_life.acall)() == 42


def test_call_async_task():
    assert async_to_sync(test_tasks.noop_task_async.acall)() is None


def test_call_async_task_sync():
    assert test_tasks.noop_task_async.call() is None


def test_get_result():
    result = default_task_backend.enqueue(test_tasks.noop_task, (), {})
    assert test_tasks.noop_task.get_result(result.id) == result


def test_get_result_async():
    result = async_to_sync(default_task_backend.aenqueue)(test_tasks.noop_task, (), {})
    assert async_to_sync(test_tasks.noop_task.aget_result)(result.id) == result


def test_get_missing_result():
    with pytest.raises(TaskResultDoesNotExist):
        test_tasks.noop_task.get_result("123")
    with pytest.raises(TaskResultDoesNotExist):
        async_to_sync(test_tasks.noop_task.aget_result)("123")


def test_get_incorrect_result():
    result = default_task_backend.enqueue(test_tasks.noop_task_async, (), {})
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        test_tasks.noop_task.get_result(result.id)


def test_get_incorrect_result_async():
    result = async_to_sync(default_task_backend.aenqueue)(test_tasks.noop_task_async, (), {})
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        async_to_sync(test_tasks.noop_task.aget_result)(result.id)


def test_invalid_function():
    def local() -> None:
        pass

    for invalid_function in [any, local]:
        with pytest.raises(InvalidTask, match="Task function must be defined at a module level"):
            task()(invalid_function)


def test_get_backend():
    assert test_tasks.noop_task.backend == "default"
    assert isinstance(test_tasks.noop_task.get_backend(), SkipQueueBackend)
    other = test_tasks.noop_task.using(backend="immediate")
    assert other.backend == "immediate"
    assert other.get_backend() is task_backends["immediate"]


def test_name():
    assert test_tasks.noop_task.name == "noop_task"
    assert test_tasks.noop_task_async.name == "noop_task_async"


def test_module_path():
    assert test_tasks.noop_task.module_path == "tests.testapp.backport_tasks.noop_task"
    assert import_string(test_tasks.noop_task.module_path) is test_tasks.noop_task
    assert import_string(test_tasks.noop_task_async.module_path) is test_tasks.noop_task_async


def test_no_backends():
    with override_settings(TASKS={}), pytest.raises(InvalidTaskBackend):
        test_tasks.noop_task.enqueue()


def test_task_error_invalid_exception():
    result = finished(test_tasks.failing_task_value_error.using(backend="immediate").enqueue())
    assert len(result.errors) == 1
    object.__setattr__(result.errors[0], "exception_class_path", "subprocess.run")
    with pytest.raises(ValueError, match="'subprocess.run' does not reference a valid exception"):
        result.errors[0].exception_class  # noqa: B018


def test_task_error_unknown_module():
    result = finished(test_tasks.failing_task_value_error.using(backend="immediate").enqueue())
    assert len(result.errors) == 1
    object.__setattr__(result.errors[0], "exception_class_path", "does.not.exist")
    with pytest.raises(ImportError):
        result.errors[0].exception_class  # noqa: B018


def test_takes_context_without_taking_context():
    with pytest.raises(
        InvalidTask, match="Task takes context but does not have a first argument of 'context'"
    ):
        task(takes_context=True)(test_tasks.calculate_meaning_of_life.func)


# -- test_immediate_backend.py::ImmediateBackendTestCase (run by our worker) ------------
# and test_dummy_backend.py::DummyBackendTestCase (the result before a worker runs it)


def test_immediate_using_correct_backend():
    assert default_task_backend.alias == "default"
    assert default_task_backend.options == {}


def test_dummy_enqueue_task_is_ready_until_a_worker_runs_it():
    for each in [test_tasks.noop_task, test_tasks.noop_task_async]:
        result = each.enqueue(1, two=3)

        assert result.status == TaskResultStatus.READY
        assert not result.is_finished
        assert (result.started_at, result.last_attempted_at, result.finished_at) == (None,) * 3
        with pytest.raises(ValueError, match="Task has not finished yet"):
            result.return_value  # noqa: B018
        assert (result.task, result.args, result.kwargs) == (each, [1], {"two": 3})
        assert (result.attempts, result.errors) == (0, [])


@pytest.mark.parametrize("name", ["noop_task", "noop_task_async"])
def test_immediate_enqueue_task(name):
    each = getattr(test_tasks, name)
    result = finished(each.enqueue(1, two=3))

    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.is_finished
    assert None not in (result.started_at, result.last_attempted_at, result.finished_at)
    assert result.started_at >= result.enqueued_at
    assert result.finished_at >= result.started_at
    assert result.return_value is None
    assert (result.task, result.args, result.kwargs) == (each, [1], {"two": 3})
    assert result.attempts == 1


@pytest.mark.parametrize("name", ["noop_task", "noop_task_async"])
def test_immediate_enqueue_task_async(name):
    each = getattr(test_tasks, name)
    result = finished(async_to_sync(each.aenqueue)())

    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.started_at >= result.enqueued_at
    assert result.finished_at >= result.started_at
    assert (result.task, result.args, result.kwargs) == (each, [], {})
    assert result.attempts == 1


@pytest.mark.parametrize(
    ("name", "exception", "message"),
    [
        ("failing_task_value_error", ValueError, "This task failed due to ValueError"),
        ("failing_task_system_exit", SystemExit, "This task failed due to SystemExit"),
    ],
)
def test_catches_exception(caplog, name, exception, message):
    each = getattr(test_tasks, name)
    with caplog.at_level(logging.ERROR, logger=TASKS_LOGGER):
        result = finished(each.enqueue())

    # The API's task_finished receiver logs the failure once. Changed: under
    # ImmediateBackend it logs inside the `except`, with the traceback; our worker sends
    # task_finished after the fenced write, so the message is in `errors`, not the log.
    [record] = [r for r in caplog.records if r.name == TASKS_LOGGER]
    assert result.id in record.getMessage() and "state=FAILED" in record.getMessage()

    assert result.status == TaskResultStatus.FAILED
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018
    assert result.is_finished
    assert result.started_at >= result.enqueued_at
    assert result.finished_at >= result.started_at
    assert result.errors[0].exception_class is exception
    assert result.errors[0].traceback.endswith(f"{exception.__name__}: {message}\n")
    assert (result.task, result.args, result.kwargs) == (each, [], {})


def test_complex_exception():
    result = finished(test_tasks.complex_exception.enqueue())

    assert result.status == TaskResultStatus.FAILED
    assert result.finished_at >= result.started_at >= result.enqueued_at
    assert result._return_value is None
    assert result.errors[0].exception_class is ValueError
    assert 'ValueError(ValueError("This task failed"))' in result.errors[0].traceback
    assert result.task == test_tasks.complex_exception


def test_complex_return_value():
    result = finished(test_tasks.complex_return_value.enqueue())

    assert result.status == TaskResultStatus.FAILED
    assert result.finished_at >= result.started_at >= result.enqueued_at
    assert result._return_value is None
    assert result.errors[0].exception_class is TypeError
    assert "Unsupported type" in result.errors[0].traceback


def test_result():
    result = finished(default_task_backend.enqueue(test_tasks.calculate_meaning_of_life, [], {}))
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42


def test_result_async():
    enqueue = async_to_sync(default_task_backend.aenqueue)
    result = finished(enqueue(test_tasks.calculate_meaning_of_life, [], {}))
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42


def test_get_result_from_different_request():
    """Adapted from the view-based test: another thread (its own connection, as another
    request's) reads the result by id. ImmediateBackend cannot; a database can."""
    result = finished(test_tasks.calculate_meaning_of_life.enqueue())
    seen = []

    def other_request() -> None:
        try:
            seen.append(default_task_backend.get_result(result.id))
        finally:
            connection.close()

    thread = threading.Thread(target=other_request)
    thread.start()
    thread.join(timeout=30)
    [found] = seen
    assert (found.status, found.return_value) == (TaskResultStatus.SUCCESSFUL, 42)


def test_enqueue_logs(caplog):
    with caplog.at_level(logging.DEBUG, logger=TASKS_LOGGER):
        result = finished(test_tasks.noop_task.enqueue())

    output = [r.getMessage() for r in caplog.records if r.name == TASKS_LOGGER]
    assert len(output) == 3
    assert "enqueued" in output[0] and result.id in output[0]
    assert "state=RUNNING" in output[1] and result.id in output[1]
    assert "state=SUCCESSFUL" in output[2] and result.id in output[2]


def test_failed_logs(caplog):
    with caplog.at_level(logging.DEBUG, logger=TASKS_LOGGER):
        result = finished(test_tasks.failing_task_value_error.enqueue())

    output = [r.getMessage() for r in caplog.records if r.name == TASKS_LOGGER]
    assert len(output) == 3
    assert "state=RUNNING" in output[1] and result.id in output[1]
    assert "state=FAILED" in output[2] and result.id in output[2]


def test_check():
    assert list(default_task_backend.check()) == []


def test_takes_context():
    result = finished(test_tasks.get_task_id.enqueue())
    assert result.return_value == result.id


def test_context():
    result = finished(test_tasks.test_context.enqueue(1))
    assert result.status == TaskResultStatus.SUCCESSFUL


def test_validate_on_enqueue():
    with override_settings(TASKS={"default": {"BACKEND": OURS, "QUEUES": []}}):  # Immediate's
        task_with_custom_queue_name = test_tasks.noop_task.using(queue_name="unknown_queue")
    only_queue_1 = {"default": {"BACKEND": OURS, "QUEUES": ["queue-1"]}}
    with (
        override_settings(TASKS=only_queue_1),
        pytest.raises(InvalidTask, match="Queue 'unknown_queue' is not valid for backend"),
    ):
        task_with_custom_queue_name.enqueue()
    assert not Job.objects.exists()


def test_validate_on_aenqueue():
    with override_settings(TASKS={"default": {"BACKEND": OURS, "QUEUES": []}}):  # Immediate's
        task_with_custom_queue_name = test_tasks.noop_task.using(queue_name="unknown_queue")
    only_queue_1 = {"default": {"BACKEND": OURS, "QUEUES": ["queue-1"]}}
    with (
        override_settings(TASKS=only_queue_1),
        pytest.raises(InvalidTask, match="Queue 'unknown_queue' is not valid for backend"),
    ):
        async_to_sync(task_with_custom_queue_name.aenqueue)()


# -- test_custom_backend.py::CustomTaskTestCase (our Task is a custom task_class) -------


def test_custom_task_default_values():
    my_task = task()(test_tasks.noop_task.func)
    assert isinstance(my_task, SkipQueueTask)
    assert (my_task.max_attempts, my_task.concurrency_limit) == (None, 1)


def test_custom_task_with_standard_and_custom_values():
    import django

    if tasks_api.API == "django.tasks" and django.VERSION < (6, 1):
        pytest.skip("Django 6.0's @task takes no backend options (backends.task does)")
    my_task = task(priority=10, queue_name="queue_1", max_attempts=3)(test_tasks.noop_task.func)
    assert isinstance(my_task, SkipQueueTask)
    assert (my_task.priority, my_task.queue_name, my_task.max_attempts) == (10, "queue_1", 3)
    assert not my_task.takes_context and my_task.run_after is None


def test_custom_task_invalid_argument():
    with pytest.raises(TypeError):
        task(unknown_param=123)(test_tasks.noop_task.func)


# -- test_compat.py::DjangoCompatTestCase: a library on the backport, Django 6.x --------


def test_lib_using_django_backend():
    """A library that declares its tasks with the backport's @task (Wagtail,
    modelsearch) on Django 6.x, where our backend serves django.tasks: the backport's
    handler creates our backend from the same TASKS, and the task runs."""
    if tasks_api.API != "django.tasks":
        pytest.skip("Django 5.2: the backport is the API our backend serves")
    backport = pytest.importorskip("django_tasks")

    assert isinstance(backport.task_backends["default"], SkipQueueBackend)
    declared = backport.task(test_tasks.undecorated)
    assert isinstance(declared, Task)  # django.tasks' Task: our backend's task_class
    result = finished(declared.enqueue())
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, "ran")


# -- Not adapted, and why ---------------------------------------------------------------
# test_immediate_backend.py:
#   test_throws_keyboard_interrupt: ImmediateBackend re-raises a task's
#     KeyboardInterrupt into the caller of enqueue(); a worker records it as the job's
#     failure and goes on (tests/runtime/test_executor.py).
#   test_cannot_get_result, test_cannot_refresh_result, test_cannot_pass_run_after:
#     ImmediateBackend lacks these features; ours supports them (supports_get_result,
#     supports_defer: tests/integration/test_backends.py).
#   test_meaning_of_life_view: its test project's view; the same enqueue-and-read is
#     test_result and test_get_result_from_different_request here.
# test_dummy_backend.py: test_clear, test_refresh_result(_async) (they edit DummyBackend's
#   in-memory `results`), test_validate_disallowed_async_task (mock.patch of a backend
#   attribute). Its other tests are test_tasks.py's and test_immediate_backend.py's
#   above, and test_dummy_enqueue_task_is_ready_until_a_worker_runs_it.
# test_custom_backend.py::CustomBackendTestCase: backends defined in that test module
#   (options, abstract enqueue, no priority support); none involves ours.
# test_compat.py: test_uses_lib_tasks_by_default (the backport's default backend when
#   TASKS is unset) and test_django_using_lib_backend (Django's @task with the
#   backport's ImmediateBackend) involve no backend of ours.
# test_utils.py: the backport's helper functions (normalize_json and others).
