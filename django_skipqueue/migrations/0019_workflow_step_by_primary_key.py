# The workflow trigger (0012) finds the jobs it moves on by their ids: a finished job's
# dependents, and a workflow's on_error job. Its lookups also said `state = 'waiting'`
# and `workflow_id = <the workflow>`, which match the partial index over waiting jobs
# (skipqueue_job_waiting_idx) and the one over a workflow's jobs
# (skipqueue_job_workflow_idx). Where the statistics counted few waiting jobs (ANALYZE
# ran before a large workflow was enqueued), the planner chose a walk through the whole
# waiting index for each of them: measured on PostgreSQL 15, a group of 3,000 chains of
# two, each ack of a chain's first job read all 3,000 waiting entries (300,000 for 100
# acks; an ack took 3.1 ms instead of 1.4), so a workflow of n steps cost n * n reads.
#
# The same tests, written so that no index matches them (as the Python side's fenced
# writes do: django_skipqueue/queue/managers.py _NoIndex): `(state || '') = 'waiting'`
# and `workflow_id IS NOT DISTINCT FROM NEW.workflow_id` (the trigger runs only for a
# job whose workflow_id is set, so this is plain equality). The primary key is then the
# one index that finds the rows. Only the function changes: CREATE OR REPLACE takes no
# lock on the job table, and each session uses the new body from its next call.
#
# The body is 0012's with these lookups replaced (asserted below, so that a body that
# no longer holds them fails here rather than silently changing nothing).

import importlib

from django.db import migrations

_WORKFLOWS = importlib.import_module("django_skipqueue.migrations.0012_workflows")
_BODY = _WORKFLOWS.TRIGGER[: _WORKFLOWS.TRIGGER.index("CREATE TRIGGER")]

REPLACED = [
    (
        """WHERE id = ANY(children) AND state = 'waiting'
                  AND workflow_id = NEW.workflow_id  -- never another workflow's job""",
        """WHERE id = ANY(children) AND (state || '') = 'waiting'
                  -- never another workflow's job
                  AND workflow_id IS NOT DISTINCT FROM NEW.workflow_id""",
    ),
    (
        "WHERE id = on_error AND state = 'waiting';",
        "WHERE id = on_error AND (state || '') = 'waiting';",
    ),
]


def _function(body: str) -> str:
    return body.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def _by_primary_key(body: str) -> str:
    for old, new in REPLACED:
        if old not in body:
            raise RuntimeError(f"0012's workflow trigger no longer holds {old!r}")
        body = body.replace(old, new)
    return body


FORWARD = _function(_by_primary_key(_BODY))
BACKWARD = _function(_BODY)


class Migration(migrations.Migration):
    dependencies = [("skipqueue", "0018_notify_update_per_row")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
