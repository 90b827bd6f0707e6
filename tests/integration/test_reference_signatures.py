"""Every signature written in docs/reference matches the code (`inspect.signature`).

Each backticked call of a public function or method in the reference, such as
`task.enqueue_many([(args, kwargs), ...], batch_size=5000)`, is read: every keyword it
names must be a parameter of the real function, with the default the docs give.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from django_skipqueue import Cron, testing
from django_skipqueue.exceptions import Retry
from django_skipqueue.tasks.base import Task
from django_skipqueue.tasks.context import TaskContext

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference"

#: How a call is written in the reference -> the function it documents.
DOCUMENTED: dict[str, Callable[..., Any]] = {
    "task.enqueue": Task.enqueue,
    "task.enqueue_many": Task.enqueue_many,
    "task.using": Task.using,
    "task.build": Task.build,
    "task.call": Task.call,
    "extend_lease": TaskContext.extend_lease,
    "Retry": Retry.__init__,
    "django_skipqueue.testing.run_jobs": testing.run_jobs,
    "Cron": Cron.__init__,
}
CALL = re.compile(r"`(?:@)?([\w.]+)\(([^`]*)\)(?: -> [^`]*)?`")


def split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def documented_calls() -> list[tuple[str, str, str]]:
    found = []
    for page in sorted(REFERENCE.glob("*.md")):
        for name, arguments in CALL.findall(page.read_text()):
            if name in DOCUMENTED:
                found.append((page.name, name, arguments))
    return found


def test_the_reference_documents_the_calls_this_test_checks():
    assert {name for _, name, _ in documented_calls()} == set(DOCUMENTED)


@pytest.mark.parametrize(
    ("page", "name", "arguments"),
    documented_calls(),
    ids=[f"{page}:{name}" for page, name, _ in documented_calls()],
)
def test_a_documented_signature_matches_the_code(page, name, arguments):
    parameters = inspect.signature(DOCUMENTED[name]).parameters
    for part in split_top_level(arguments):
        if "=" not in part or part.startswith(("*", "[")):
            continue
        keyword, _, default = (piece.strip() for piece in part.partition("="))
        assert keyword in parameters, f"{page}: {name}() has no parameter {keyword!r}"
        if default:
            real = parameters[keyword].default
            assert default == repr(real).replace("'", '"'), (
                f"{page}: {name}({keyword}={default}) but the code's default is {real!r}"
            )
