"""NOTIFY the queue's channel when jobs become pending, in the writing transaction.

A statement-level trigger with a transition table: enqueue pays no extra round trip, a
bulk INSERT sends one NOTIFY per queue (PostgreSQL also folds identical notifications
within a transaction), and the notification is delivered only at commit. The payload
is empty: channels are visible to every database user, so no job data goes there.
Jobs scheduled for later notify too, so that idle workers wake and shorten their sleep
to the new next due time.
"""

from django.db import migrations

FORWARD = """
CREATE FUNCTION skipqueue_notify_pending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('skipqueue_' || queue_name, '')
    FROM (SELECT DISTINCT queue_name FROM skipqueue_changed_jobs
          WHERE state = 'pending') AS pending;
    RETURN NULL;
END;
$$;

CREATE TRIGGER skipqueue_job_notify_insert
    AFTER INSERT ON skipqueue_job
    REFERENCING NEW TABLE AS skipqueue_changed_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION skipqueue_notify_pending();

CREATE TRIGGER skipqueue_job_notify_update
    AFTER UPDATE ON skipqueue_job
    REFERENCING NEW TABLE AS skipqueue_changed_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION skipqueue_notify_pending();
"""

BACKWARD = """
DROP TRIGGER IF EXISTS skipqueue_job_notify_update ON skipqueue_job;
DROP TRIGGER IF EXISTS skipqueue_job_notify_insert ON skipqueue_job;
DROP FUNCTION IF EXISTS skipqueue_notify_pending();
"""


class Migration(migrations.Migration):
    dependencies = [("skipqueue", "0001_initial")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
