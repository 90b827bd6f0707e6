-- A held job's outcomes, renewals and releases, in batches (queue/outcomes.py).
-- Loaded by queue/sql.py into STATEMENTS; each "-- name:" starts a statement, whose
-- leading comment lines say why it is raw SQL. Text in braces is filled by queue/sql.py.

-- name: LOCK_WORKFLOWS_OF
-- The workflows of these jobs, locked in id order before any of the jobs' rows: every
-- statement that changes the state of a workflow's job takes its workflow first. The
-- trigger skipqueue_workflow_step locks in the order job, its children, its workflow;
-- an operator's cancel locks the workflow, then its jobs: without this, an ack and a
-- cancel of the same workflow deadlocked (14 times in 12 rounds of a 400-member group
-- on 3 workers). Only jobs of a workflow pay it. Parameter: the job ids.
SELECT id FROM skipqueue_workflow
WHERE id IN (SELECT workflow_id FROM skipqueue_job WHERE id = ANY(%s))
ORDER BY id
FOR NO KEY UPDATE

-- name: ACK_MANY
-- The fenced ack, raw for the same measured reason as the claim: one statement for one
-- job or many, one row per (id, attempt, result), each with its own fence. The worker
-- acknowledges every job that finished while its previous batch committed.
--
-- Its rows are found by the primary key alone, whatever the statistics say:
-- - the state test is `(job.state || '')`, which no partial index matches
--   (base._NoIndex says why: the walk through every running job's entry that the
--   planner otherwise chose);
-- - no join: each row's attempt and result are read by its id from two JSON objects
--   (a lookup by key in a jsonb object is a binary search). Joined to the unnested
--   arrays instead, the planner, which guesses one row for the hidden state (and for
--   the lease where ANALYZE saw no running job), read the whole batch once for each row
--   found: 2,000 jobs running, an ack of 136 took 10 ms (5 ms before the state was
--   hidden); with `array_position` into the arrays, 1,500 took 62 ms.
-- Parameters: the results as a JSON object by id (an id whose result is None left out:
-- the column stays NULL), the ids as an array's text, the attempts as a JSON object by
-- id (base._ack_parameters). Its generic plan (what a prepared statement of it would
-- keep, after five runs, where that costs no more) finds the rows by the primary key as
-- well (tests/queue/test_managers.py, EXPLAIN EXECUTE).
UPDATE skipqueue_job AS job
SET state = 'done', result = %(results)s::jsonb -> job.id::text,
    finished_at = statement_timestamp(), leased_until = NULL
WHERE job.id = ANY(%(ids)s::bigint[]) AND (job.state || '') = 'running'
  AND job.attempts = (%(attempts)s::jsonb ->> job.id::text)::integer
  AND job.leased_until > statement_timestamp()
RETURNING job.id

-- name: RENEW_MANY
-- The housekeeper's renewal of the leases due in one pass: one statement, each row fenced on its own
-- as `JobManager.renewal`'s UPDATE is (the attempt, running, an unexpired lease, no cancel
-- requested), the lease clamped to MIN_LEASE..MAX_LEASE and never shortened. Renewed one by one, 300
-- leases of 1 s fell behind their expiry (1,049 duplicate runs of 3,000 jobs;
-- tests/queue/test_managers.py, `test_renew_many_...`). Rows another session has locked are skipped, not
-- waited for: waiting, the statement kept the locks of the rows it had renewed, and the dispatcher's
-- acks of those waited behind it (one row locked for 3 s elsewhere, 421 leases lost;
-- tests/runtime/test_worker.py, `test_a_renewal_skips_a_row_...`); the housekeeper tries those again shortly
-- (`JobManager.holding_many` tells them from lost ones). Written as ACK_MANY is (the state hidden
-- from the planner, the attempts read by id from one JSON object).
WITH held AS (
    SELECT job.id FROM skipqueue_job AS job
    WHERE job.id = ANY(%(ids)s::bigint[]) AND (job.state || '') = 'running'
      AND job.attempts = (%(attempts)s::jsonb ->> job.id::text)::integer
      AND job.leased_until > statement_timestamp()
      AND job.cancel_requested_at IS NULL
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE skipqueue_job AS job
SET leased_until = GREATEST(job.leased_until, statement_timestamp()
    + LEAST(GREATEST(job.lease, %(min_lease)s::interval), %(max_lease)s::interval))
FROM held
WHERE job.id = held.id
RETURNING job.id

-- name: RELEASE_MANY
-- A worker's release of the jobs it gives back at a graceful stop (`JobManager.release`
-- for many): pending again, due now, without spending an attempt (`max_attempts` + 1,
-- `releases` + 1), each row fenced on its own, written as RENEW_MANY is. A job with a
-- cancel request is left to `release`, which ends it cancelled. One UPDATE a job made a
-- stop with a full prefetch buffer (256 jobs) take 0.1-1 s (tests/queue/test_managers.py,
-- `test_release_many_...`).
UPDATE skipqueue_job AS job
SET state = 'pending', run_at = statement_timestamp(), leased_until = NULL,
    max_attempts = job.max_attempts + 1, releases = job.releases + 1
WHERE job.id = ANY(%(ids)s::bigint[]) AND (job.state || '') = 'running'
  AND job.attempts = (%(attempts)s::jsonb ->> job.id::text)::integer
  AND job.leased_until > statement_timestamp()
  AND job.cancel_requested_at IS NULL
RETURNING job.id
