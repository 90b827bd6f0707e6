# The NOTIFY trigger on UPDATE (issue 29): a row-level trigger whose WHEN clause lets
# through only the rows left pending, instead of a statement-level one with a transition
# table.
#
# The statement-level trigger (0002, 0016) ran for every UPDATE of the job table, the
# claim's and the ack's included, after copying each updated row into its transition
# table, only to find no pending row in it. The claim and the ack, the two statements
# every job goes through, now leave no row that WHEN lets through: no copy, no function
# call. What notifies is unchanged: an update that leaves a job pending (a retry, a
# release, the reaper, a requeue, a replaced unique job, a workflow step let go) tells
# its queue, while a worker of that queue waits (0016), once per queue and transaction
# (PostgreSQL folds identical notifications of one transaction into one).
#
# The INSERT trigger stays statement-level: a bulk enqueue of many rows calls its
# function once, not once a row.
#
# Replacing a trigger takes a lock on the job table that conflicts with every write, and
# waits for the transactions that hold one: meanwhile every enqueue, claim and ack would
# queue behind it. So it waits at most LOCK_TIMEOUT; past that the migration fails with
# "canceling statement due to lock timeout", changing nothing, and `migrate` can simply
# be run again (the long transaction in the way is the thing to look for).

from django.db import migrations

LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s';"

FORWARD = LOCK_TIMEOUT + """
CREATE OR REPLACE FUNCTION skipqueue_notify_pending_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM skipqueue_workerprocess AS worker
               WHERE worker.waiting_since IS NOT NULL
                 AND worker.queues ? NEW.queue_name) THEN
        PERFORM pg_notify('skipqueue_' || NEW.queue_name, '');
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS skipqueue_job_notify_update ON skipqueue_job;
CREATE TRIGGER skipqueue_job_notify_update
    AFTER UPDATE ON skipqueue_job
    FOR EACH ROW WHEN (NEW.state = 'pending')
    EXECUTE FUNCTION skipqueue_notify_pending_row();
"""

BACKWARD = LOCK_TIMEOUT + """
DROP TRIGGER IF EXISTS skipqueue_job_notify_update ON skipqueue_job;
CREATE TRIGGER skipqueue_job_notify_update
    AFTER UPDATE ON skipqueue_job
    REFERENCING NEW TABLE AS skipqueue_changed_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION skipqueue_notify_pending();
DROP FUNCTION IF EXISTS skipqueue_notify_pending_row();
"""


class Migration(migrations.Migration):
    dependencies = [("skipqueue", "0017_partial_worker_workflow_indexes")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
