# Waiting on one job (`Job.wait()`, issue 54): a finished job that somebody waits on
# notifies the channel 'skipqueue!job' (no payload: channels are visible to every
# database user), and the waiters of the process, which share one LISTEN connection
# (queue/finished.py), read their rows again.
#
# Only a row a waiter marked does (`awaited`, set by queue/awaiting.py before it looks
# at the row): the claim, the ack and the reaper, which every job goes through, leave no
# row the trigger's WHEN lets through, so they pay no function call and no NOTIFY (the
# choice 0018 made for the pending trigger). The mark is an UPDATE of its own; on a
# pending row it also passes 0018's WHEN, which wakes a waiting worker of its queue once:
# harmless, and the worker may well take that very job.
#
# Adding a column with a constant default rewrites nothing, but takes a lock on the job
# table that conflicts with every write, as a trigger does: both wait at most
# LOCK_TIMEOUT, and past that the migration fails, changing nothing, and can be run again.

from django.db import migrations, models

LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s';"

FORWARD = """
CREATE OR REPLACE FUNCTION skipqueue_notify_awaited() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('skipqueue!job', '');
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS skipqueue_job_awaited ON skipqueue_job;
CREATE TRIGGER skipqueue_job_awaited
    AFTER UPDATE OF state ON skipqueue_job
    FOR EACH ROW WHEN (NEW.awaited AND NEW.state IN ('done', 'failed', 'cancelled')
                       AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION skipqueue_notify_awaited();
"""

BACKWARD = """
DROP TRIGGER IF EXISTS skipqueue_job_awaited ON skipqueue_job;
DROP FUNCTION IF EXISTS skipqueue_notify_awaited();
"""


class Migration(migrations.Migration):
    dependencies = [("skipqueue", "0021_job_payload_permission")]

    operations = [
        migrations.RunSQL(LOCK_TIMEOUT, migrations.RunSQL.noop),
        migrations.AddField(
            model_name="job",
            name="awaited",
            field=models.BooleanField(
                default=False,
                db_default=False,
                help_text="Somebody waits on it (Job.wait()): it notifies when it finishes.",
            ),
        ),
        migrations.RunSQL(FORWARD, BACKWARD),
        # Unapplied first, when migrating back: the same bound for the way back.
        migrations.RunSQL(migrations.RunSQL.noop, LOCK_TIMEOUT),
    ]
