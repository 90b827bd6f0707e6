"""The workflow trigger's body is a file (django_skipqueue/queue/workflow_step.sql): the
newest migration that wrote it holds the same text, a migrated database runs it, and
its literals name what the Python side names (issue 53, point 3)."""

from __future__ import annotations

import re
from importlib import resources

import pytest
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.operations import RunSQL

from django_skipqueue.core.states import UNNEEDED, UPSTREAM, JobState, WorkflowState
from django_skipqueue.queue.finished import FINISHED_CHANNEL
from django_skipqueue.queue.sql import KEYED_CHANNEL

FUNCTION = "skipqueue_workflow_step()"


def the_file() -> str:
    text = resources.files("django_skipqueue.queue").joinpath("workflow_step.sql").read_text()
    return text[text.index("CREATE") :]  # after the header's comments


def function_text(sql: str) -> str:
    """The CREATE [OR REPLACE] FUNCTION statement in `sql`, through its closing `$$;`."""
    start = re.search(r"CREATE (OR REPLACE )?FUNCTION skipqueue_workflow_step\(\)", sql)
    assert start is not None
    opened = sql.index("$$", start.start()) + 2
    end = sql.index("$$;", opened) + 3
    return sql[start.start() : end].replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def newest_migration_body() -> tuple[str, str]:
    loader = MigrationLoader(None, ignore_no_migrations=True)
    plan = loader.graph.forwards_plan(loader.graph.leaf_nodes("skipqueue")[0])
    found = None
    for key in plan:
        if key[0] != "skipqueue":
            continue
        for operation in loader.graph.nodes[key].operations:
            forward = getattr(operation, "sql", "") if isinstance(operation, RunSQL) else ""
            if isinstance(forward, str) and f"FUNCTION {FUNCTION}" in forward:
                found = (key[1], function_text(forward))
    assert found is not None
    return found


def test_the_newest_migration_that_wrote_the_trigger_holds_the_files_text():
    name, body = newest_migration_body()
    assert name == "0019_workflow_step_by_primary_key"
    assert body == function_text(the_file()), (
        "django_skipqueue/queue/workflow_step.sql is not the body the newest migration "
        f"({name}) writes: a change to the body needs a migration with its own copy"
    )


@pytest.mark.django_db
def test_a_migrated_database_runs_the_files_body():
    with connection.cursor() as cursor:
        cursor.execute("SELECT prosrc FROM pg_proc WHERE proname = 'skipqueue_workflow_step'")
        [(source,)] = cursor.fetchall()
    text = the_file()
    assert source == text[text.index("$$") + 2 : text.rindex("$$")]


def test_its_literals_name_the_states_reasons_and_channels_of_the_python_side():
    text = the_file()
    states = set(JobState.values) | set(WorkflowState.values)
    compared = re.findall(r"state\s*(?:=|<>)\s*'([^']*)'", text)
    listed = re.findall(r"state\s+(?:NOT\s+)?IN\s*\(([^)]*)\)", text)
    compared += [item.strip().strip("'") for group in listed for item in group.split(",")]
    set_to = re.findall(r"state\s*=\s*CASE\b.*?END", text, flags=re.S)
    compared += [value for case in set_to for value in re.findall(r"'([a-z]+)'", case)]
    assert len(compared) > 20 and set(compared) <= states, set(compared) - states
    reasons = set(re.findall(r"'(skipqueue:[a-z]+)'", text))
    assert reasons == {UPSTREAM, UNNEEDED}
    channels = set(re.findall(r"pg_notify\('([^']*)'", text))
    assert channels == {KEYED_CHANNEL, FINISHED_CHANNEL}
