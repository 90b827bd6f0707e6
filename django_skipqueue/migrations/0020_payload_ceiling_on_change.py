# The payload ceiling (0003) checked where a payload is written, not on every write of
# the row (issue 29).
#
# 0003's CHECK constraint measured the JSON text of `args`, `kwargs` and `result`.
# PostgreSQL checks every CHECK constraint on every new version of a row, whatever
# columns the UPDATE set, so each claim, lease renewal, ack, release and retry of a job
# turned its arguments back into text: measured on PostgreSQL 15 with 250 KiB arguments
# (benchmarks/large_payloads.py), 2.3 ms of the server's CPU for one renewal, 21 ms for
# a claim of 10, 2.4 ms of database CPU a job for a worker's drain; the row without
# the constraint takes 0.1 ms a write.
#
# The same ceiling as two BEFORE triggers that fire only on an INSERT, or an UPDATE
# whose SET names the payload's columns (`UPDATE OF`), with the test in their WHEN
# clause: the function is called only to refuse the row, with the error the constraint
# raised (check_violation, 23514, naming skipqueue_job_payload_size, which Django raises
# as IntegrityError). A trigger of a project's own that rewrites `args` on another
# column's UPDATE is not re-checked (PostgreSQL's rule for `UPDATE OF`); our writes set
# the payload columns by name, and the rows already stored met the constraint.
#
# Like 0018, replacing the constraint takes a lock on the job table that conflicts with
# every write: it waits at most LOCK_TIMEOUT, then fails changing nothing, and
# `migrate` can be run again. Going back re-adds the constraint NOT VALID and validates
# it, as 0003 did (the validation reads the table under a lock that writes pass).

import importlib

from django.db import migrations

CEILING = importlib.import_module(
    "django_skipqueue.migrations.0003_payload_ceiling_autovacuum"
).CEILING
LOCK_TIMEOUT = importlib.import_module(
    "django_skipqueue.migrations.0018_notify_update_per_row"
).LOCK_TIMEOUT

FORWARD = (
    LOCK_TIMEOUT
    + f"""
CREATE OR REPLACE FUNCTION skipqueue_refuse_payload() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    size bigint;
    what text;
BEGIN
    IF TG_NAME = 'skipqueue_job_result_size' THEN
        size := octet_length(NEW.result::text);
        what := 'result';
    ELSE
        size := octet_length(NEW.args::text) + octet_length(NEW.kwargs::text);
        what := 'args and kwargs';
    END IF;
    RAISE EXCEPTION USING
        MESSAGE = format(
            'new row for relation "%s" violates check constraint "skipqueue_job_payload_size": '
            || 'its %s take %s bytes of JSON text, over the ceiling of {CEILING}',
            TG_TABLE_NAME, what, size),
        ERRCODE = 'check_violation', CONSTRAINT = 'skipqueue_job_payload_size',
        TABLE = TG_TABLE_NAME, SCHEMA = TG_TABLE_SCHEMA;
END;
$$;

DROP TRIGGER IF EXISTS skipqueue_job_payload_size ON skipqueue_job;
CREATE TRIGGER skipqueue_job_payload_size
    BEFORE INSERT OR UPDATE OF args, kwargs ON skipqueue_job
    FOR EACH ROW WHEN (octet_length(NEW.args::text) + octet_length(NEW.kwargs::text) > {CEILING})
    EXECUTE FUNCTION skipqueue_refuse_payload();
DROP TRIGGER IF EXISTS skipqueue_job_result_size ON skipqueue_job;
CREATE TRIGGER skipqueue_job_result_size
    BEFORE INSERT OR UPDATE OF result ON skipqueue_job
    FOR EACH ROW WHEN (octet_length(NEW.result::text) > {CEILING})
    EXECUTE FUNCTION skipqueue_refuse_payload();

ALTER TABLE skipqueue_job DROP CONSTRAINT IF EXISTS skipqueue_job_payload_size;
"""
)

BACKWARD = (
    LOCK_TIMEOUT
    + f"""
ALTER TABLE skipqueue_job DROP CONSTRAINT IF EXISTS skipqueue_job_payload_size;
ALTER TABLE skipqueue_job ADD CONSTRAINT skipqueue_job_payload_size CHECK (
    octet_length(args::text) + octet_length(kwargs::text) <= {CEILING}
    AND (result IS NULL OR octet_length(result::text) <= {CEILING})
) NOT VALID;
DROP TRIGGER IF EXISTS skipqueue_job_payload_size ON skipqueue_job;
DROP TRIGGER IF EXISTS skipqueue_job_result_size ON skipqueue_job;
DROP FUNCTION IF EXISTS skipqueue_refuse_payload();
ALTER TABLE skipqueue_job VALIDATE CONSTRAINT skipqueue_job_payload_size;
"""
)


class Migration(migrations.Migration):
    dependencies = [("skipqueue", "0019_workflow_step_by_primary_key")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
