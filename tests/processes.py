"""Helpers for tests that run real child processes against the test database."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import psutil
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


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    """`python *args` against the test database, run to its end (60 s at most)."""
    return subprocess.run(
        [sys.executable, *args],
        env=child_env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


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


class WorkerHandle:
    """A real `python -m django runworker` (or another command) whose output goes to a file."""

    def __init__(
        self, args: list[str], log_path: Path, command: str = "runworker", **extra_env: str
    ) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115  (closed in stop())
        self.process = subprocess.Popen(
            [sys.executable, "-m", "django", command, *args],
            env=child_env(**extra_env),
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: stop() ends the pool's children too
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_for_output(self, text: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited {self.process.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {text!r} in worker output after {timeout}s:\n{self.output()}"
                )
            time.sleep(0.02)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        """Kill the worker, its process group and its children: a `--processes` pool's
        children (each in a process group of its own) outlived a SIGKILL of their parent
        for a moment, and their queries then raced the test database's flush at teardown
        (a deadlock on its TRUNCATE, seen once)."""
        children = descendants(self.process.pid)  # read while the parent holds them
        with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self._log.close()


def descendants(pid: int) -> list[int]:
    """The pids of `pid`'s children, theirs, and so on ([] once it is gone)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02, message: str = "") -> None:
    """Poll `predicate` until true, failing the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(message or f"condition not met within {timeout}s")
        time.sleep(interval)


def run_in_threads(target, count: int, timeout: float = 60.0) -> None:
    """Run `target` on `count` threads at once and wait for all of them (each closes its
    own database connection when done)."""
    import threading

    from django.db import connection as thread_connection

    def run() -> None:
        try:
            target()
        finally:
            thread_connection.close()

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)


def listening_backends() -> int:
    """How many backends of the test database sit in a LISTEN (the waiters' shared one)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query ILIKE 'LISTEN%%'"
        )
        return int(cursor.fetchone()[0])
