"""Helpers for tests that run real child processes against the test database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

from django.db import connection

REPO_ROOT = Path(__file__).resolve().parent.parent


def database_url() -> str:
    """A URL for the database this test runs against (the test database, not the main one)."""
    settings = connection.settings_dict
    user = quote(settings["USER"] or "", safe="")
    password = quote(str(settings["PASSWORD"] or ""), safe="")
    host = settings["HOST"] or ""
    if host.startswith("/"):
        return f"postgresql://{user}:{password}@/{settings['NAME']}?host={host}"
    return f"postgresql://{user}:{password}@{host}:{settings['PORT'] or 5432}/{settings['NAME']}"


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url(),
        DJANGO_SETTINGS_MODULE="tests.settings",
        PYTHONPATH=str(REPO_ROOT),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def start_python(code: str, **extra_env: str) -> subprocess.Popen[str]:
    """Run `code` in a fresh interpreter with Django set up against the test database."""
    prelude = "import django; django.setup()\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code],
        env=child_env(**extra_env),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
