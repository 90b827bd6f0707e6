"""The statements live in .sql files beside the verbs (django_skipqueue/queue/*.sql):
each is loaded once, named once, bound to a name in queue/sql.py, and read as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from django_skipqueue.queue import sql

QUEUE = Path(sql.__file__).parent


def test_every_statement_of_the_files_is_bound_in_the_sql_module_and_each_file_is_loaded():
    bound = {value for value in vars(sql).values() if isinstance(value, str)}
    formatted = {"REPLACE_PENDING", "MARK_AWAITED", "FINISHED_AMONG", "RECORD_STEP"}
    formatted |= {"FAIR_LOCKING", "FAIR_WALK_END", "FAIR_WALK"}  # a part of the two; filled
    unbound = [
        name
        for name, text in sql.STATEMENTS.items()
        if text not in bound and name not in formatted  # .format()ed
    ]
    assert unbound == []
    assert {path.stem for path in QUEUE.glob("*.sql")} == {*sql.SQL_FILES, "workflow_step"}


def test_a_statement_is_its_lines_after_its_comments_kept_as_written():
    text = (
        "-- header of the file\n\n"
        "-- name: ONE\n-- why it is raw\nSELECT '{}'::jsonb\n  -- inline, kept\nFROM t\n\n"
        "-- name: TWO\nSELECT 2\n"
    )
    assert sql.load_statements(text) == {
        "ONE": "\nSELECT '{}'::jsonb\n  -- inline, kept\nFROM t\n",
        "TWO": "\nSELECT 2\n",
    }


def test_a_name_given_twice_across_the_files_is_refused(monkeypatch, tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.sql").write_text("-- name: SAME\nSELECT 1\n")
    monkeypatch.setattr(sql, "SQL_FILES", ("a", "b"))
    monkeypatch.setattr(sql, "__file__", str(tmp_path / "sql.py"))
    with pytest.raises(RuntimeError, match=r"b.sql names \['SAME'\] again"):
        sql._read_all()
