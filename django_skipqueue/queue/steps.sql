-- A durable job's steps (queue/steps.py, tasks/durable.py). Loaded by queue/sql.py into
-- STATEMENTS; each "-- name:" starts a statement, whose leading comment lines say why it
-- is raw SQL.

-- name: STEPS_OF
-- Every recorded step of a job, in order: read once, at the attempt's first step, so a
-- job that resumes after 1,000 steps reads them in one query. A sleep's last column is
-- the seconds from now to its wake time, on the database's clock. Raw: that column.
-- Parameter: the job id.
SELECT position, name, occurrence, kind, result,
    CASE WHEN kind = 'sleep' THEN EXTRACT(EPOCH FROM recorded_at
        + make_interval(secs => (result ->> 'seconds')::float8) - statement_timestamp())::float8
    END
FROM skipqueue_step WHERE job_id = %s ORDER BY position

-- name: RECORD_STEP
-- A step's checkpoint, written only if this attempt still owns the job: the ack's
-- fence (the job running, this attempt's number, an unexpired lease), proved in the
-- same statement. {locking} is FOR NO KEY UPDATE for an atomic step (sql.RECORD_ATOMIC_STEP):
-- the job's row stays locked to the end of the step's own transaction, whose writes
-- then commit with the checkpoint or not at all; a reaper that would take the job back
-- waits for the commit (and then the next attempt finds the checkpoint), and a stale
-- attempt finds no row and rolls back. A plain step (sql.RECORD_STEP, in autocommit or
-- the task's own transaction) takes no lock: it is at least once anyway, and a lock
-- held to the end of a task's long transaction would keep the worker's lease
-- renewals off the row. A position another attempt recorded is not written again (ON
-- CONFLICT): that attempt owned the job after this one. Raw: the fence and the insert
-- must be one statement. Returns the step's id and its result as stored (what a replay
-- reads), or no row.
WITH owner AS (
    SELECT job.id, job.attempts FROM skipqueue_job AS job
    WHERE job.id = %(job)s AND (job.state || '') = 'running'
      AND job.attempts = %(attempt)s AND job.leased_until > statement_timestamp()
    {locking}
)
INSERT INTO skipqueue_step (
    job_id, position, name, occurrence, kind, attempt, started_at, recorded_at, result)
SELECT owner.id, %(position)s, %(name)s, %(occurrence)s, %(kind)s, owner.attempts,
    clock_timestamp() - make_interval(secs => %(seconds)s), clock_timestamp(),
    %(result)s::jsonb
FROM owner
ON CONFLICT (job_id, position) DO NOTHING
RETURNING id, result
