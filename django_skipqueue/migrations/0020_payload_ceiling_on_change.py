# The payload ceiling (0003) checked where a payload is written, not on every write of
# the row (issue 29).
#
# 0003's CHECK constraint measured the JSON text of `args`, `kwargs` and `result`.
# PostgreSQL checks every CHECK constraint on every new version of a row, whatever
# columns the UPDATE set, so each claim, lease renewal, ack, release and retry of a job
# turned its arguments back into text: measured on PostgreSQL 15 with 250 KiB arguments
# (benchmarks/large_payloads.py), 2.3 ms of the server's CPU for one renewal, 8 ms for
# an ack of 10, 2.4 ms of database CPU a job for a worker's drain; the row without the
# constraint takes 0.1 ms a write.
#
# The same ceiling as two row triggers that fire only on an INSERT, or an UPDATE whose
# SET names the payload's columns (`UPDATE OF`), with the test in their WHEN clause:
# their function is called only to refuse the row, with the error the constraint
# raised (check_violation, 23514, naming skipqueue_job_payload_size, which Django raises
# as IntegrityError). They are AFTER triggers, for three reasons found by an outside
# trial of a first version with BEFORE triggers:
# - an AFTER trigger sees the row as stored, after every BEFORE trigger of a project's
#   own has changed it (BEFORE triggers fire in the order of their names, so one named
#   after ours could have grown the payload past a test already made);
# - a BEFORE ROW UPDATE trigger makes PostgreSQL lock each row before updating it,
#   whether or not the trigger fires: one more WAL record a renewal and an ack;
# - a BEFORE ROW INSERT trigger turns off COPY's batched inserts.
# They are ENABLE ALWAYS, so that they hold, as the constraint did, for writers in
# `session_replication_role = replica` (logical replication's apply, a restore with
# --disable-trigger): a table owner can still disable them, as they could drop the
# constraint.
#
# What this does not check, and the constraint did: a payload changed by a BEFORE
# trigger of a project's own on an UPDATE whose SET does not name it (PostgreSQL's rule
# for `UPDATE OF`). Our writes set the payload columns by name. A later migration that
# changes one of these columns' type must drop the triggers first (PostgreSQL refuses
# to alter a column that a trigger's definition uses).
#
# Applying it takes the strongest lock on the job table first, waiting at most
# LOCK_TIMEOUT (0018): past that it fails changing nothing, and `migrate` can be run
# again. Taken first, and not by the DROP CONSTRAINT at the end, because CREATE TRIGGER's
# weaker lock, once held, would close a cycle with any transaction that had read the job
# table and then writes it (a deadlock, which PostgreSQL may settle by aborting that
# transaction rather than the migration).
#
# Going back first looks for a job over the ceiling (only a writer that disabled the
# triggers can have stored one) and stops there, naming it, before anything changes.
# Then it re-adds the constraint NOT VALID (it holds for every write from then on), and
# validates it in a transaction of its own, under a lock that writes pass (as 0003 did).
# Interrupted between those two transactions, the table holds the constraint and no
# triggers while Django still records 0020 as applied: run `migrate skipqueue 0019`
# again (each step can run again), or `migrate` forward after a `migrate skipqueue
# 0019` that went through. The forward SQL run by hand (`sqlmigrate`) must run as one
# transaction (`psql -1`): LOCK TABLE and SET LOCAL need one.

import importlib

from django.db import migrations

_PAYLOAD_CEILING = importlib.import_module(
    "django_skipqueue.migrations.0003_payload_ceiling_autovacuum"
)
CEILING = _PAYLOAD_CEILING.CEILING
LOCK_TIMEOUT = importlib.import_module(
    "django_skipqueue.migrations.0018_notify_update_per_row"
).LOCK_TIMEOUT
LOCK = LOCK_TIMEOUT + "\nLOCK TABLE skipqueue_job IN ACCESS EXCLUSIVE MODE;\n"
ARGUMENTS = "octet_length(NEW.args::text) + octet_length(NEW.kwargs::text)"
RESULT = "octet_length(NEW.result::text)"
# 0003's CHECK constraint, as going back re-adds it
WITHIN_THE_CEILING = (
    f"octet_length(args::text) + octet_length(kwargs::text) <= {CEILING}"
    f" AND (result IS NULL OR octet_length(result::text) <= {CEILING})"
)

FORWARD = (
    LOCK
    + f"""
CREATE OR REPLACE FUNCTION skipqueue_refuse_payload() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    size bigint;
    what text;
    who text := CASE TG_OP WHEN 'INSERT' THEN format('a new job of task %L', NEW.task)
                           ELSE format('job %s', NEW.id) END;
BEGIN
    IF TG_NAME = 'skipqueue_job_result_size' THEN
        size := {RESULT};
        what := 'result takes';
    ELSE
        size := {ARGUMENTS};
        what := 'args and kwargs take';
    END IF;
    RAISE EXCEPTION USING
        MESSAGE = format(
            'new row for relation "%s" violates check constraint "skipqueue_job_payload_size": '
            || '%s: its %s %s bytes of JSON text, over the ceiling of {CEILING}',
            TG_TABLE_NAME, who, what, size),
        ERRCODE = 'check_violation', CONSTRAINT = 'skipqueue_job_payload_size',
        TABLE = TG_TABLE_NAME, SCHEMA = TG_TABLE_SCHEMA;
END;
$$;

DROP TRIGGER IF EXISTS skipqueue_job_payload_size ON skipqueue_job;
CREATE TRIGGER skipqueue_job_payload_size
    AFTER INSERT OR UPDATE OF args, kwargs ON skipqueue_job
    FOR EACH ROW WHEN ({ARGUMENTS} > {CEILING})
    EXECUTE FUNCTION skipqueue_refuse_payload();
ALTER TABLE skipqueue_job ENABLE ALWAYS TRIGGER skipqueue_job_payload_size;
DROP TRIGGER IF EXISTS skipqueue_job_result_size ON skipqueue_job;
CREATE TRIGGER skipqueue_job_result_size
    AFTER INSERT OR UPDATE OF result ON skipqueue_job
    FOR EACH ROW WHEN ({RESULT} > {CEILING})
    EXECUTE FUNCTION skipqueue_refuse_payload();
ALTER TABLE skipqueue_job ENABLE ALWAYS TRIGGER skipqueue_job_result_size;

ALTER TABLE skipqueue_job DROP CONSTRAINT IF EXISTS skipqueue_job_payload_size;
"""
)

BACKWARD = (
    LOCK
    + f"""
ALTER TABLE skipqueue_job DROP CONSTRAINT IF EXISTS skipqueue_job_payload_size;
ALTER TABLE skipqueue_job ADD CONSTRAINT skipqueue_job_payload_size CHECK (
    {WITHIN_THE_CEILING}
) NOT VALID;
DROP TRIGGER IF EXISTS skipqueue_job_payload_size ON skipqueue_job;
DROP TRIGGER IF EXISTS skipqueue_job_result_size ON skipqueue_job;
DROP FUNCTION IF EXISTS skipqueue_refuse_payload();
"""
)

OVER_THE_CEILING = f"NOT ({WITHIN_THE_CEILING})"


def _refuse_the_first_job_over_the_ceiling(otherwise: str) -> str:
    """PL/pgSQL: raise a check violation naming the first job over 0003's ceiling, its
    sizes and what to do; `otherwise` where there is none."""
    return f"""
    SELECT id, octet_length(args::text) + octet_length(kwargs::text) AS arguments,
           octet_length(result::text) AS result
      INTO job FROM skipqueue_job WHERE {OVER_THE_CEILING} ORDER BY id LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING
            MESSAGE = format(
                'job %s: its args and kwargs take %s bytes of JSON text and its result %s, '
                || 'over the ceiling of {CEILING} to which migration 0003''s constraint '
                || 'skipqueue_job_payload_size holds every row; shrink or delete that job, '
                || 'then migrate again',
                job.id, job.arguments, coalesce(job.result::text, 'none')),
            ERRCODE = 'check_violation', CONSTRAINT = 'skipqueue_job_payload_size';
    END IF;
    {otherwise}
"""


# Going back, first (its own transaction, reading the table with no lock that writes
# wait on): a job over the ceiling, which only a writer that disabled the triggers can
# have stored, stops the migration here, named, before anything has changed.
FIND_FIRST = f"""
DO $$
DECLARE job record;
BEGIN
{_refuse_the_first_job_over_the_ceiling("")}
END;
$$;
"""

# Going back, last (its own transaction): SHARE UPDATE EXCLUSIVE, which enqueues, claims
# and acks pass, while it reads the whole table. A job stored over the ceiling since
# FIND_FIRST stops it, named.
VALIDATE = (
    LOCK_TIMEOUT
    + f"""
DO $$
DECLARE job record;
BEGIN
    ALTER TABLE skipqueue_job VALIDATE CONSTRAINT skipqueue_job_payload_size;
EXCEPTION WHEN check_violation THEN
{_refuse_the_first_job_over_the_ceiling("RAISE;")}
END;
$$;
"""
)


class Migration(migrations.Migration):
    atomic = False  # going back, VALIDATE runs in a transaction of its own

    dependencies = [("skipqueue", "0019_workflow_step_by_primary_key")]

    # Each RunSQL is one statement string: one transaction (PostgreSQL runs a string of
    # several statements as one). In reverse: FIND_FIRST, BACKWARD, VALIDATE.
    operations = [
        migrations.RunSQL(migrations.RunSQL.noop, VALIDATE),
        migrations.RunSQL(FORWARD, BACKWARD),
        migrations.RunSQL(migrations.RunSQL.noop, FIND_FIRST),
    ]
