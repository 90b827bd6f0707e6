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

-- name: TAKE_SIGNAL
-- A wait for a signal (`context.wait_for`), once its step is recorded "waiting": take
-- the oldest signal of that name sent to the job and record it as the wait's outcome,
-- or record that the wait timed out, or neither (the job then parks until the signal
-- or its timeout: queue/outcomes.py, `give_back`). One statement, fenced as an atomic
-- step's record: the job's row is locked to the end of it, so a reaper that would take
-- the job back waits, and the next attempt finds the outcome; a stale attempt finds no
-- owner, and takes nothing. The outcome, once written, is what every later attempt
-- replays: a signal that comes after a timeout was recorded is left for a later wait
-- of that name. Returns the outcome if this statement wrote one, and the seconds left
-- to the timeout (NULL: none), on the database's clock. Raw: the take, the outcome and
-- the fence must be one statement.
WITH owner AS (
    SELECT job.id FROM skipqueue_job AS job
    WHERE job.id = %(job)s AND (job.state || '') = 'running'
      AND job.attempts = %(attempt)s AND job.leased_until > statement_timestamp()
    FOR NO KEY UPDATE
), wait AS (
    SELECT step.id, step.recorded_at
        + make_interval(secs => (step.result ->> 'timeout')::float8) AS deadline
    FROM skipqueue_step AS step JOIN owner ON step.job_id = owner.id
    WHERE step.position = %(position)s AND step.kind = 'signal'
      AND step.result ->> 'outcome' = 'waiting'
), first AS (
    SELECT signal.id FROM skipqueue_signal AS signal
    WHERE signal.job_id = %(job)s AND signal.name = %(name)s AND EXISTS (SELECT FROM wait)
    ORDER BY signal.id LIMIT 1
    FOR UPDATE
), taken AS (
    DELETE FROM skipqueue_signal AS signal USING first WHERE signal.id = first.id
    RETURNING signal.payload, signal.sent_at
), outcome AS (
    UPDATE skipqueue_step AS step
    SET result = CASE WHEN taken.sent_at IS NOT NULL
        THEN step.result || jsonb_build_object(
            'outcome', 'received', 'payload', taken.payload, 'sent_at', taken.sent_at)
        ELSE step.result || '{"outcome": "timed out"}'::jsonb END
    FROM wait LEFT JOIN taken ON true
    WHERE step.id = wait.id
      AND (taken.sent_at IS NOT NULL OR wait.deadline <= statement_timestamp())
    RETURNING step.result
)
SELECT (SELECT result FROM outcome),
    (SELECT EXTRACT(EPOCH FROM deadline - statement_timestamp())::float8 FROM wait)
FROM owner

-- name: SEND_SIGNAL
-- `send_signal`: the signal kept for the job's wait, in the sender's transaction (rolled
-- back, never sent), where the job can still take it (not finished, not relayed). No
-- row: nothing is written. It reads the job's row and writes none of it: the sender's
-- transaction may last, and a running job's lease renewals and ack must not wait for
-- it (the foreign key's check takes a KEY SHARE lock, which no write of ours but a
-- delete conflicts with). The wake-up of a job parked on the wait is WAKE_SIGNALLED,
-- after the commit. Raw: the check and the insert must be one statement.
INSERT INTO skipqueue_signal (job_id, name, payload, sent_at)
SELECT job.id, %(name)s, %(payload)s::jsonb, statement_timestamp()
FROM skipqueue_job AS job
WHERE job.id = %(job)s AND job.state IN ('pending', 'running', 'waiting')
RETURNING id

-- name: WAKE_SIGNALLED
-- A job parked on a wait for a signal that is there to take: due now. Run by the
-- sender once its transaction committed (`send_signal`, for its job and name), and by
-- the reaper for every kept signal (`SignalVerbs.wake_signalled`: a sender that died
-- between its commit and its wake-up). A wait that parks the job after the commit sees
-- the signal itself (`give_back`). Driven by the kept signals (the taken ones are
-- deleted: usually none), each job found by its primary key. Parameters: a job id and
-- a name, or NULL and NULL for all.
UPDATE skipqueue_job AS job SET run_at = statement_timestamp()
FROM (SELECT DISTINCT job_id, name FROM skipqueue_signal
      WHERE (%(job)s::bigint IS NULL OR job_id = %(job)s::bigint)
        AND (%(name)s::text IS NULL OR name = %(name)s::text)) AS kept
WHERE job.id = kept.job_id AND job.parked_step = kept.name
  AND job.state = 'pending' AND job.parked = 'signal' AND job.run_at > statement_timestamp()
RETURNING job.id
