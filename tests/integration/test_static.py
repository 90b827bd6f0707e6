"""Static checks of the package source: clock, data path, SQL (T34, T15, S1, S6)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "django_skipqueue"


def source(*names: str) -> dict[str, str]:
    paths = [PACKAGE / name for name in names] if names else sorted(PACKAGE.rglob("*.py"))
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in paths}


def hits(pattern: str, files: dict[str, str]) -> list[str]:
    found = []
    for name, text in files.items():
        for number, line in enumerate(text.splitlines(), 1):
            if re.search(pattern, line) and not line.lstrip().startswith("#"):
                found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_t34_lease_and_fence_decisions_never_read_the_process_clock():
    verbs = ("base", "claim", "limited", "enqueue", "relaying", "outcomes", "reap", "operator")
    files = source(
        "queue/managers.py",
        *(f"queue/{name}.py" for name in verbs),
        "maintenance/reaper.py",
        "models.py",
        "queue/sql.py",
    )
    assert hits(r"timezone\.now\(|datetime\.now\(|datetime\.utcnow\(|time\.time\(", files) == []


def test_s1_no_pickle_eval_or_exec_anywhere_in_the_package():
    assert hits(r"\bpickle\b|\bmarshal\b|\beval\(|\bexec\(|yaml\.load\(", source()) == []


def test_s2_the_worker_and_executor_never_import_a_path():
    assert (
        hits(
            r"import_string\(|import_module\(|__import__\(",
            source("runtime/worker.py", "runtime/executor.py"),
        )
        == []
    )


def test_t15_nothing_session_scoped_behind_a_pooler():
    files = source()
    # runtime/runner.py names these statements in the patterns by which it notices a task
    # that ran one (changes_session): naming them there is the guard, not a use.
    # db/direct.py's named enqueue statements are the one session-scoped state, kept
    # only outside transactions and given up behind a transaction pooler (`_lost`,
    # docs/howto/pgbouncer.md); it sends them with libpq's protocol, never SQL PREPARE.
    found = hits(r"pg_advisory_lock\(|WITH HOLD|\bPREPARE\b", files)
    assert [hit for hit in found if hit.startswith("db/direct.py:") and "WITH HOLD" in hit] == []
    assert [hit for hit in found if "pg_advisory_lock(" in hit] == []
    found = [hit for hit in found if not hit.startswith("db/direct.py:")]
    assert [hit for hit in found if not hit.startswith("runtime/runner.py:")] == []
    detector = [hit for hit in found if hit.startswith("runtime/runner.py:")]
    assert all(': r"' in hit for hit in detector)  # regular expressions only
    assert hits(r"""["']SET (?!LOCAL)""", files) == []


def test_no_loop_stands_in_a_block_that_holds_a_database_connections_lock():
    """A `with` block holding a driver connection's lock (psycopg's `Connection.lock`,
    taken in db/direct.py) has no `for` or `while` in its own frame: on CPython 3.13,
    Ctrl-C or a time limit's exception landing at such a loop's backward jump can skip
    the block's exits and leave the lock held for good (`direct._last_result`). Loops go
    in a function it calls, or in a comprehension, which has an exit of its own."""
    found = []
    for name, text in source().items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.With):
                continue
            if not any(ast.unparse(item.context_expr).endswith(".lock") for item in node.items):
                continue
            inner = [child for statement in node.body for child in _frame_nodes(statement)]
            found += [
                f"{name}:{child.lineno}"
                for child in inner
                if isinstance(child, (ast.For, ast.While))
            ]
    assert found == []


def _frame_nodes(node: ast.AST) -> list[ast.AST]:
    """`node` and what it holds, without the bodies of the functions and classes it
    defines (frames of their own)."""
    found = [node]
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            found += _frame_nodes(child)
    return found


@pytest.mark.parametrize(
    "pattern",
    [
        r"execute\(\s*f[\"']",  # an f-string
        r"execute\([^)]*[\"']\s*%\s*[(\w]",  # "..." % values
        r"execute\(\s*[\"'][^\"']*[\"']\s*\.format\(",  # "...".format(values)
    ],
)
def test_s6_sql_is_never_built_by_formatting_values_into_it(pattern):
    files = {name: text for name, text in source().items() if "migrations" not in name}
    assert hits(pattern, files) == []


def test_the_classifiers_name_every_django_and_python_that_tox_tests():
    root = PACKAGE.parent
    pyproject = (root / "pyproject.toml").read_text()
    envs = re.findall(r"^\s+py(\d)(\d+)-django(\d)(\d)$", (root / "tox.ini").read_text(), re.M)
    assert envs
    for py_major, py_minor, dj_major, dj_minor in envs:
        assert f'"Programming Language :: Python :: {py_major}.{py_minor}"' in pyproject
        assert f'"Framework :: Django :: {dj_major}.{dj_minor}"' in pyproject
