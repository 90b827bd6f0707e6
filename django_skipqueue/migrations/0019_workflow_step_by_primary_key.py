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
# The body is 0012's with these lookups replaced, frozen below as it was first applied
# (it was once made from 0012's text by replacing them; tests/queue/test_workflow_step_sql.py
# checks that django_skipqueue/queue/workflow_step.sql, the body the database runs
# today, is the newest migration's).

import importlib

from django.db import migrations

_WORKFLOWS = importlib.import_module("django_skipqueue.migrations.0012_workflows")

FORWARD = """
CREATE OR REPLACE FUNCTION skipqueue_workflow_step() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    -- Ids only, whatever another client wrote there (a non-array, text, huge numbers):
    -- such a row must still be claimed, failed or cancelled, never stuck.
    children bigint[] := ARRAY(
        SELECT value::bigint FROM jsonb_array_elements_text(
            CASE WHEN jsonb_typeof(NEW.dependents) = 'array' THEN NEW.dependents
                 ELSE '[]' END) AS value
        WHERE value ~ '^[0-9]{1,18}$');
    other record;
    left_now integer;
    on_error bigint;
    keyed boolean;
BEGIN
    IF NEW.state = 'done' THEN
        -- One parent fewer to wait on: the last one makes the dependent due, now. Rows
        -- are locked in id order (the index scan of = ANY sorts the ids); siblings that
        -- finish together wait for each other's row lock and count from the latest value.
        IF cardinality(children) > 0 THEN
            WITH moved AS (
                UPDATE skipqueue_job
                SET waiting_on = GREATEST(COALESCE(waiting_on, 1) - 1, 0),
                    state = CASE WHEN COALESCE(waiting_on, 1) <= 1 THEN 'pending'
                                 ELSE 'waiting' END,
                    run_at = CASE WHEN COALESCE(waiting_on, 1) <= 1
                                  THEN GREATEST(run_at, statement_timestamp()) ELSE run_at END
                WHERE id = ANY(children) AND (state || '') = 'waiting'
                  -- never another workflow's job
                  AND workflow_id IS NOT DISTINCT FROM NEW.workflow_id
                RETURNING state, concurrency_key
            )
            SELECT bool_or(state = 'pending' AND concurrency_key IS NOT NULL) INTO keyed
            FROM moved;
            IF keyed THEN  -- keyed jobs have a channel of their own (the claim's fast
                PERFORM pg_notify('skipqueue!keyed', '');  -- path leaves them out)
            END IF;
        END IF;
        IF NEW.ends_workflow THEN
            UPDATE skipqueue_workflow
            SET outputs_left = GREATEST(outputs_left - 1, 0),
                state = CASE WHEN outputs_left <= 1 THEN 'done' ELSE state END,
                finished_at = CASE WHEN outputs_left <= 1 THEN statement_timestamp() END
            WHERE id = NEW.workflow_id AND state = 'running'
            RETURNING outputs_left, on_error_job_id INTO left_now, on_error;
            IF FOUND AND left_now = 0 THEN
                UPDATE skipqueue_job
                SET state = 'cancelled', finished_at = statement_timestamp(),
                    cancelled_by = 'skipqueue:unneeded',
                    last_error = 'the workflow succeeded: no error to handle'
                WHERE id = on_error AND (state || '') = 'waiting';
                PERFORM pg_notify('skipqueue!workflow', '');
            END IF;
        END IF;
    ELSIF NEW.state IN ('failed', 'cancelled')
          AND NEW.cancelled_by NOT IN ('skipqueue:upstream', 'skipqueue:unneeded') THEN
        -- Nothing downstream will run: one statement over every transitive dependent
        -- (their own firing of this trigger sees cancelled_by and stops there).
        WITH RECURSIVE downstream(id) AS (
            SELECT unnest(children)
            UNION
            SELECT element::bigint FROM downstream
            JOIN skipqueue_job AS job ON job.id = downstream.id
            CROSS JOIN LATERAL jsonb_array_elements_text(
                CASE WHEN jsonb_typeof(job.dependents) = 'array' THEN job.dependents
                     ELSE '[]' END) AS element
            WHERE element ~ '^[0-9]{1,18}$'
        )
        UPDATE skipqueue_job
        SET state = 'cancelled', finished_at = statement_timestamp(),
            cancelled_by = 'skipqueue:upstream',
            last_error = 'upstream job ' || NEW.id || ' ' || NEW.state
        WHERE id IN (SELECT id FROM downstream) AND state = 'waiting'
          AND workflow_id = NEW.workflow_id;
        -- The workflow fails once, whichever job fails first; its on_error job is due.
        UPDATE skipqueue_workflow
        SET state = 'failed', finished_at = statement_timestamp(), failed_job_id = NEW.id,
            error = CASE WHEN NEW.state = 'failed' THEN NEW.last_error
                         WHEN NEW.cancelled_by <> '' THEN 'cancelled by ' || NEW.cancelled_by
                         ELSE 'cancelled' END
        WHERE id = NEW.workflow_id AND state = 'running'
        RETURNING on_error_job_id INTO on_error;
        IF FOUND THEN
            UPDATE skipqueue_job SET state = 'pending', run_at = statement_timestamp()
            WHERE id = on_error AND (state || '') = 'waiting';
            PERFORM pg_notify('skipqueue!workflow', '');
        END IF;
    ELSIF OLD.state IN ('failed', 'cancelled') AND NEW.state = 'pending'
          AND EXISTS (SELECT 1 FROM skipqueue_workflow WHERE id = NEW.workflow_id
                      AND state IN ('running', 'failed')) THEN
        -- An operator's retry: what this job's end cancelled waits again, each on its
        -- parents that are not done (this one among them), and the workflow runs again.
        WITH RECURSIVE downstream(id) AS (
            SELECT unnest(children)
            UNION
            SELECT element::bigint FROM downstream
            JOIN skipqueue_job AS job ON job.id = downstream.id
            CROSS JOIN LATERAL jsonb_array_elements_text(
                CASE WHEN jsonb_typeof(job.dependents) = 'array' THEN job.dependents
                     ELSE '[]' END) AS element
            WHERE element ~ '^[0-9]{1,18}$'
        )
        UPDATE skipqueue_job AS child
        SET state = 'waiting', finished_at = NULL, cancelled_by = '', last_error = '',
            waiting_on = (SELECT count(*) FROM skipqueue_job AS parent
                          WHERE parent.workflow_id = child.workflow_id
                            AND parent.state <> 'done'
                            AND parent.dependents @> to_jsonb(child.id))
        WHERE child.id IN (SELECT id FROM downstream) AND child.state = 'cancelled'
          AND child.cancelled_by = 'skipqueue:upstream' AND child.workflow_id = NEW.workflow_id;
        -- The workflow runs again once no job of it is left failed or cancelled by an
        -- operator (those its failures cancelled wait again above; its on_error job
        -- does not count); until then it stays failed, naming the next such job.
        SELECT job.id, job.state, job.last_error, job.cancelled_by INTO other
        FROM skipqueue_job AS job
        WHERE job.workflow_id = NEW.workflow_id AND job.state IN ('failed', 'cancelled')
          AND job.cancelled_by NOT IN ('skipqueue:upstream', 'skipqueue:unneeded')
          AND job.id IS DISTINCT FROM (SELECT on_error_job_id FROM skipqueue_workflow
                                       WHERE id = NEW.workflow_id)
        ORDER BY job.id LIMIT 1;
        IF NOT FOUND THEN
            UPDATE skipqueue_workflow
            SET state = 'running', finished_at = NULL, failed_job_id = NULL, error = ''
            WHERE id = NEW.workflow_id AND state = 'failed';
        ELSE
            UPDATE skipqueue_workflow
            SET failed_job_id = other.id,
                error = CASE WHEN other.state = 'failed' THEN other.last_error
                             WHEN other.cancelled_by <> '' THEN 'cancelled by ' || other.cancelled_by
                             ELSE 'cancelled' END
            WHERE id = NEW.workflow_id AND state = 'failed';
        END IF;
    END IF;
    RETURN NULL;
END;
$$;

"""

BACKWARD = _WORKFLOWS.TRIGGER[: _WORKFLOWS.TRIGGER.index("CREATE TRIGGER")].replace(
    "CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1
)


class Migration(migrations.Migration):
    dependencies = [("skipqueue", "0018_notify_update_per_row")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
