# Queue names up to 200 bytes (issue 54): Django's Tasks API takes any queue name, and a
# name over 48 bytes was refused, since a queue's NOTIFY channel, "skipqueue_<name>",
# must fit PostgreSQL's 63-byte identifiers. A longer name's channel is now
# "skipqueue_#<md5 of the name>" (44 bytes), in SQL (skipqueue_channel()) and in Python
# (queue/sql.py, channel_name) alike: tests/queue/test_notify.py checks that
# they agree. 200 leaves room for RabbitMQ's 255-byte names ("skipqueue.<name>.retry.N").
#
# The two NOTIFY functions (0016's, on INSERT, and 0018's, on UPDATE) take the channel
# from skipqueue_channel(); nothing else changes in them. Widening a varchar rewrites no
# table and no index, but takes a lock on each table that conflicts with every write:
# it waits at most LOCK_TIMEOUT, and past that the migration fails, changing nothing,
# and can be run again.

from django.db import migrations, models

LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s';"

FORWARD = """
CREATE OR REPLACE FUNCTION skipqueue_channel(queue_name text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT 'skipqueue_' || CASE WHEN octet_length(queue_name) <= 48 THEN queue_name
                                ELSE '#' || md5(queue_name) END
$$;

CREATE OR REPLACE FUNCTION skipqueue_notify_pending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(skipqueue_channel(pending.queue_name), '')
    FROM (SELECT DISTINCT queue_name FROM skipqueue_changed_jobs
          WHERE state = 'pending') AS pending
    WHERE EXISTS (SELECT 1 FROM skipqueue_workerprocess AS worker
                  WHERE worker.waiting_since IS NOT NULL
                    AND worker.queues ? pending.queue_name);
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION skipqueue_notify_pending_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM skipqueue_workerprocess AS worker
               WHERE worker.waiting_since IS NOT NULL
                 AND worker.queues ? NEW.queue_name) THEN
        PERFORM pg_notify(skipqueue_channel(NEW.queue_name), '');
    END IF;
    RETURN NULL;
END;
$$;
"""

# 0016's and 0018's bodies.
BACKWARD = """
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

DROP FUNCTION IF EXISTS skipqueue_channel(text);
"""


def name_field(**options: object) -> models.CharField:
    return models.CharField(max_length=200, **options)  # type: ignore[arg-type]


class Migration(migrations.Migration):
    dependencies = [("skipqueue", "0022_job_awaited")]

    operations = [
        migrations.RunSQL(LOCK_TIMEOUT, migrations.RunSQL.noop),
        migrations.AlterField("job", "queue_name", name_field(default="default")),
        migrations.AlterField("queue", "name", name_field(primary_key=True, serialize=False)),
        migrations.AlterField("schedule", "queue_name", name_field()),
        migrations.AlterField("queueminute", "queue_name", name_field()),
        migrations.RunSQL(FORWARD, BACKWARD),
        # Unapplied first, when migrating back: the same bound for the way back.
        migrations.RunSQL(migrations.RunSQL.noop, LOCK_TIMEOUT),
    ]
