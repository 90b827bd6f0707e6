"""The reference names every setting, command flag, check id and signal."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from django_skipqueue import signals
from django_skipqueue.conf import SkipQueueSettings
from django_skipqueue.stats import QueueStats

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"


def page(name: str) -> str:
    return (REFERENCE / name).read_text()


@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(SkipQueueSettings)])
def test_every_setting_is_in_the_reference(key):
    assert f"`{key}`" in page("settings.md")


@pytest.mark.parametrize(
    "command", ["runworker", "reapjobs", "queuestats", "schedules", "pausequeue", "resumequeue"]
)
def test_every_command_flag_is_in_the_reference(command):
    from django.core.management import load_command_class

    parser = load_command_class("django_skipqueue", command).create_parser("manage.py", command)
    flags = {
        opt
        for action in parser._actions
        for opt in action.option_strings
        if opt.startswith("--")
        and action.dest
        not in {
            "help",
            "version",
            "verbosity",
            "settings",
            "pythonpath",
            "traceback",
            "no_color",
            "force_color",
            "skip_checks",
        }
    }
    missing = [flag for flag in flags if f"`{flag}" not in page("commands.md")]
    assert missing == []


def test_every_check_id_is_in_the_reference():
    source = (Path(__file__).resolve().parents[2] / "django_skipqueue" / "checks.py").read_text()
    ids = set(re.findall(r'id="(skipqueue\.[EW]\d{3})"', source))
    assert ids and all(f"`{check}`" in page("checks.md") for check in ids)


def test_every_signal_is_in_the_reference():
    from django.dispatch import Signal

    names = [name for name, value in vars(signals).items() if isinstance(value, Signal)]
    assert names and all(f"`{name}`" in page("signals.md") for name in names)


ROOT = REFERENCE.parent.parent
FAILURE_MODEL = ROOT / "docs" / "explanation" / "failure-model.md"


def project_texts() -> dict[Path, str]:
    """The package, tests, docs and benchmarks: every text that may cite a case."""
    found = {}
    for folder in ("django_skipqueue", "tests", "docs", "benchmarks", "example_project"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".md", ".html", ".txt"} and "__pycache__" not in path.parts:
                found[path] = path.read_text()
    return found


#: A citation of the planning material that lives beside the repository, not in it.
OUTSIDE_CITATION = re.compile(r"RELIABILITY\.md|\bshared[/]")


def test_the_repository_cites_no_file_outside_it():
    outside = [
        str(path.relative_to(ROOT))
        for path, text in project_texts().items()
        if OUTSIDE_CITATION.search(text)
    ]
    assert outside == []


def test_every_numbered_case_cited_is_defined_in_the_failure_model():
    defined = set(re.findall(r"^\| ([TSC]\d+)\b", FAILURE_MODEL.read_text(), re.MULTILINE))
    defined |= set(re.findall(r"^- \*\*(0\.\d+)\b", FAILURE_MODEL.read_text(), re.MULTILINE))
    cited = set()
    for path, text in project_texts().items():
        if path != FAILURE_MODEL:
            cited |= set(re.findall(r"\b([TS](?:[1-9]\d?)|C[1-7])\b", text))
    assert cited - defined == set()


HOWTO = REFERENCE.parent / "howto"


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(QueueStats)])
def test_every_queuestats_field_is_explained_in_the_monitoring_howto(field):
    table = (HOWTO / "monitoring.md").read_text()
    assert re.search(rf"^\| `{field}` \| [^|]+ \| \w", table, re.M), field


@pytest.mark.parametrize("status", ["alive", "stopped", "lost"])
def test_every_worker_status_is_explained_in_the_monitoring_howto(status):
    from django_skipqueue.admin.workers import STATUS_HELP

    assert status in STATUS_HELP
    assert re.search(rf"^\| {status} \| \w", (HOWTO / "monitoring.md").read_text(), re.M)
