# Fewer index entries per job (issue 29): the two foreign keys of the job table lose the
# full indexes Django gives a ForeignKey by default.
#
# - `worker_id`: every lookup by worker is of running jobs (the admin's worker pages), so a
#   partial index over running jobs replaces the full one. The full one took an entry at
#   the insert (a NULL), at the claim and at the ack of every job; the partial one takes
#   one, at the claim.
# - `workflow_id`: the partial `skipqueue_job_workflow_idx` (0012) already holds every
#   job that has a workflow; the full one, beside it, held a NULL for every other job.
#
# A job's life (insert, claim, ack) wrote 12 index entries and writes 7 now. Measured
# with pgbench on the job table (claim 10 and ack them, 4 clients, 40,000 jobs): about
# 9 % more jobs a second (`python benchmarks/run.py --parts raw`).
#
# The new index is built and the old ones dropped CONCURRENTLY (not atomic), so that
# enqueues, claims and acks go on meanwhile; the new one is in place before the old go.
# An interrupted run can be run again: it rebuilds an index its first run left invalid.

from django.apps.registry import Apps
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

TABLE = "skipqueue_job"
NEW_INDEX = "skipqueue_job_worker_run_idx"
NEW_INDEX_SQL = f"CREATE INDEX CONCURRENTLY {NEW_INDEX} ON {TABLE} (worker_id) WHERE state = 'running'"
# The names Django gave the foreign keys' indexes (0001 and 0012: the table's name, the
# column's and a hash of both). Only these are dropped: a project's own index on either
# column, whatever its name, is left alone.
DJANGO_NAMES = {
    "worker_id": "skipqueue_job_worker_id_bc0c95a5",
    "workflow_id": "skipqueue_job_workflow_id_f391eb28",
}

# Whether an index of that name exists, and whether it is valid. A CREATE INDEX
# CONCURRENTLY that was interrupted (a deploy's Ctrl-C, a statement_timeout) leaves an
# INVALID index behind, which IF NOT EXISTS would take for a finished one.
INDEX_STATE = """
SELECT i.indisvalid FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = %s::regclass AND c.relname = %s
"""


def drop_index(schema_editor: BaseDatabaseSchemaEditor, name: str) -> None:
    schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(name)}")


def create_index(schema_editor: BaseDatabaseSchemaEditor, name: str, statement: str) -> None:
    """`statement` (a CREATE INDEX CONCURRENTLY of `name`) unless a valid index of that
    name exists; an invalid one, left by an interrupted run, is dropped and built again."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(INDEX_STATE, [TABLE, name])
        found = cursor.fetchone()
    if found is not None and found[0]:
        return
    if found is not None:
        drop_index(schema_editor, name)
    schema_editor.execute(statement)


def forward(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    # The new index first, so that no moment lacks one; then the old ones (an
    # interrupted DROP ... CONCURRENTLY leaves its index invalid, and this drops it).
    create_index(schema_editor, NEW_INDEX, NEW_INDEX_SQL)
    for name in DJANGO_NAMES.values():
        drop_index(schema_editor, name)


def backward(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    for column, name in DJANGO_NAMES.items():
        create_index(
            schema_editor, name, f"CREATE INDEX CONCURRENTLY {name} ON {TABLE} ({column})"
        )
    drop_index(schema_editor, NEW_INDEX)


def unindexed(to: str) -> models.ForeignKey:
    """The job's foreign key to `to` as the model has it now: no constraint, no index."""
    return models.ForeignKey(
        blank=True,
        db_constraint=False,
        db_index=False,
        null=True,
        on_delete=models.DO_NOTHING,
        related_name="jobs",
        to=to,
    )


class Migration(migrations.Migration):
    atomic = False  # CREATE and DROP INDEX CONCURRENTLY

    dependencies = [("skipqueue", "0016_notify_waiting_workers")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="job",
                    index=models.Index(
                        condition=models.Q(("state", "running")),
                        fields=["worker"],
                        name=NEW_INDEX,
                    ),
                ),
                migrations.AlterField(
                    model_name="job", name="worker", field=unindexed("skipqueue.workerprocess")
                ),
                migrations.AlterField(
                    model_name="job", name="workflow", field=unindexed("skipqueue.workflow")
                ),
            ],
            database_operations=[migrations.RunPython(forward, backward, elidable=False)],
        ),
    ]
