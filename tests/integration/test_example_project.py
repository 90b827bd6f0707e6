"""The example project's own tests stay green whichever django.tasks backend it uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.processes import REPO_ROOT, child_env

pytest.importorskip("django.tasks", reason="django.tasks needs Django 6.0 or newer")

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize(
    "backend",
    [
        "django.tasks.backends.immediate.ImmediateBackend",
        "django_skipqueue.backends.SkipQueueBackend",
    ],
)
def test_the_example_projects_tests_pass_under_both_backends(backend):
    env = child_env(TASKS_BACKEND=backend)
    env.pop("DJANGO_SETTINGS_MODULE")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", "pytest.ini", "-q"],
        cwd=REPO_ROOT / "example_project",
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout
