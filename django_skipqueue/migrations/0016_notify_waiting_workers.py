# Enqueue from many clients at once (issue 29): the NOTIFY trigger notifies a queue only
# while a worker of that queue waits for it (WorkerProcess.waiting_since).
#
# PostgreSQL takes one lock, for the whole cluster, at the commit of every transaction
# that sent a NOTIFY, and holds it until the commit is flushed: such commits go one at a
# time. Measured with pgbench on the job table (one INSERT a transaction, 16 clients):
# 0.47x the inserts/s with the old trigger. A busy worker needs no NOTIFY (it claims
# again as soon as a thread is free), so only a waiting one is told: see
# django_skipqueue/runtime/waiting.py for when a worker waits, and for the enqueues that
# the poll must find instead.
#
# Adding a nullable column with no default rewrites no table.

from django.db import migrations, models

FORWARD = """
CREATE OR REPLACE FUNCTION skipqueue_notify_pending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('skipqueue_' || pending.queue_name, '')
    FROM (SELECT DISTINCT queue_name FROM skipqueue_changed_jobs
          WHERE state = 'pending') AS pending
    WHERE EXISTS (SELECT 1 FROM skipqueue_workerprocess AS worker
                  WHERE worker.waiting_since IS NOT NULL
                    AND worker.queues ? pending.queue_name);
    RETURN NULL;
END;
$$;
"""

# The trigger of 0002: every change that leaves jobs pending notifies their queues.
BACKWARD = """
CREATE OR REPLACE FUNCTION skipqueue_notify_pending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('skipqueue_' || queue_name, '')
    FROM (SELECT DISTINCT queue_name FROM skipqueue_changed_jobs
          WHERE state = 'pending') AS pending;
    RETURN NULL;
END;
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("skipqueue", "0015_observability")]

    operations = [
        migrations.AddField(
            model_name="workerprocess",
            name="waiting_since",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name="workerprocess",
            index=models.Index(
                condition=models.Q(("waiting_since__isnull", False)),
                fields=["waiting_since"],
                name="skipqueue_worker_waiting_idx",
            ),
        ),
        # After the column: the new function reads it.
        migrations.RunSQL(FORWARD, BACKWARD),
    ]
