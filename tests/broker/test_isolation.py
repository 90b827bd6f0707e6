"""broker/isolation.py: a redelivered relay job runs in a process of its own, and what
becomes of that process (a verdict, a crash, a kill at its deadline) is what the
consumer acts on. Real child processes; the tasks touch no database (the child reads
the settings as a consumer would, not the test database's renamed ones)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from django_skipqueue.broker.isolation import Crashed, run_isolated
from django_skipqueue.broker.message import Message
from django_skipqueue.runtime.executor import Outcome


def message(task: str, **kwargs: object) -> Message:
    return Message(
        job_id=41,
        task=task,
        queue="default",
        args=[],
        kwargs=dict(kwargs),
        attempt=1,
        max_attempts=1,
        lease_seconds=30.0,
    )


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_job_runs_in_another_process_and_its_verdict_comes_back():
    verdict = run_isolated(
        message("tests.testapp.tasks.ends_its_process", how="return"),
        database="default",
        deadline=None,
    )
    assert verdict.outcome is Outcome.SUCCEEDED
    assert verdict.result != str(os.getpid())  # the child's pid, not ours
    assert gone(int(verdict.result))  # and it was waited for


@pytest.mark.parametrize(
    ("how", "reason"), [("exit", "exit code 7"), ("kill", "killed by SIGKILL")]
)
def test_a_job_that_ends_its_process_is_a_crash_and_the_caller_lives_on(how, reason):
    ran = run_isolated(
        message("tests.testapp.tasks.ends_its_process", how=how),
        database="default",
        deadline=None,
    )
    assert ran == Crashed(reason)


def test_a_job_still_running_at_its_deadline_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    started = time.monotonic()
    ran = run_isolated(
        message(
            "tests.testapp.tasks.ends_its_process", how="return", after=60, pid_file=str(pid_file)
        ),
        database="default",
        deadline=time.monotonic() + 4,
    )
    assert ran is None
    assert time.monotonic() - started < 10
    assert gone(int(pid_file.read_text()))  # killed and reaped


def test_a_task_that_raises_fails_with_its_error_from_the_child():
    verdict = run_isolated(
        message("tests.testapp.tasks.rejects_input", value=1), database="default", deadline=None
    )
    assert verdict.outcome is Outcome.FAILED
    assert verdict.error.type == "builtins.ValueError"
    assert "cannot use 1" in verdict.error.message


def test_the_module_imports_no_model_at_its_top():
    """The child runs it before Django is set up."""
    code = "import django_skipqueue.broker.isolation"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
