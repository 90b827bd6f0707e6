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
# 9 % more jobs a second (benchmarks/RESULTS.md).
#
# The new index is built and the old ones dropped CONCURRENTLY (not atomic), so that
# enqueues, claims and acks go on meanwhile; the new one is in place before the old go.

from django.apps.registry import Apps
from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

TABLE = "skipqueue_job"
# The names Django gave them (0001 and 0012: the table's name, the column's and a hash of
# both), for the way back.
DJANGO_NAMES = {
    "worker_id": "skipqueue_job_worker_id_bc0c95a5",
    "workflow_id": "skipqueue_job_workflow_id_f391eb28",
}

# The full, plain, one-column indexes on a column of the table named as Django names a
# ForeignKey's index (found in the catalogue: a project's own index is left alone).
FULL_INDEXES = """
SELECT index_class.relname
FROM pg_index AS i
JOIN pg_class AS index_class ON index_class.oid = i.indexrelid
JOIN pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
WHERE i.indrelid = %s::regclass AND i.indnatts = 1 AND a.attname = %s
  AND i.indpred IS NULL AND i.indexprs IS NULL
  AND NOT i.indisunique AND NOT i.indisprimary
  AND index_class.relname LIKE %s
"""


def drop_full_indexes(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    for column in DJANGO_NAMES:
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(FULL_INDEXES, [TABLE, column, f"{TABLE}_{column}_%"])
            names = [row[0] for row in cursor.fetchall()]
        for name in names:
            schema_editor.execute(
                f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(name)}"
            )


def create_full_indexes(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    for column, name in DJANGO_NAMES.items():
        schema_editor.execute(
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {schema_editor.quote_name(name)} "
            f"ON {schema_editor.quote_name(TABLE)} ({schema_editor.quote_name(column)})"
        )


class Migration(migrations.Migration):
    atomic = False  # CREATE and DROP INDEX CONCURRENTLY

    dependencies = [("skipqueue", "0016_notify_waiting_workers")]

    operations = [
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(("state", "running")),
                fields=["worker"],
                name="skipqueue_job_worker_run_idx",
            ),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="job",
                    name="worker",
                    field=models.ForeignKey(
                        blank=True,
                        db_constraint=False,
                        db_index=False,
                        null=True,
                        on_delete=models.DO_NOTHING,
                        related_name="jobs",
                        to="skipqueue.workerprocess",
                    ),
                ),
                migrations.AlterField(
                    model_name="job",
                    name="workflow",
                    field=models.ForeignKey(
                        blank=True,
                        db_constraint=False,
                        db_index=False,
                        null=True,
                        on_delete=models.DO_NOTHING,
                        related_name="jobs",
                        to="skipqueue.workflow",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunPython(drop_full_indexes, create_full_indexes, elidable=False),
            ],
        ),
    ]
