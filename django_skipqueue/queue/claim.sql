-- The claim's statements (queue/claim.py, queue/limited.py).
-- Loaded by queue/sql.py into STATEMENTS; each "-- name:" starts a statement, whose
-- leading comment lines say why it is raw SQL. Text in braces is filled by queue/sql.py.

-- name: CLAIM
-- The claim. Which rows, and in which order, is JobQuerySet.claimable(), an ORM
-- QuerySet; its compiled locking query (SELECT id ... ORDER BY ... LIMIT n FOR NO KEY
-- UPDATE SKIP LOCKED) becomes the CTE of one claiming statement, so the rows are locked
-- and marked running in one round trip. The MATERIALIZED CTE keeps the planner from
-- running the locking subquery more than once, which could claim more rows than LIMIT
-- (Oban commit 3990921; finding 0.9 of docs/explanation/failure-model.md).
--
-- Measured, side by side: the ORM's own statements (BEGIN, locking SELECT, UPDATE,
-- SELECT, COMMIT) cost 3.3 ms a claim of one job and 5.9 ms of 16 (0.37 ms a job), where
-- one raw statement cost 0.9 and 2.3 ms (0.14 ms a job), on PostgreSQL 15. This form
-- (the QuerySet compiled once, then one statement in autocommit) costs what the raw
-- statement does: 1.00x to 1.01x per job at 16 a claim and at 1, over three runs of
-- benchmarks/run.py --parts claimpath (embedded PostgreSQL 18, 2 cores; about 0.2 ms a
-- job at 16). Compiling on every claim, or wrapping the statement in atomic()'s BEGIN
-- and COMMIT, cost 10 to 40 % more a job.
--
-- Whatever state a row was put in by hand or by another writer, this write keeps the
-- table's constraints: a job set back to pending with no attempt left gets one more
-- (`attempts <= max_attempts`), and its lease is clamped to the bounds a task may ask
-- for (a lease of `timedelta.max` would overflow the timestamp). It names the columns it
-- returns: a column added by a later migration must not reach an older worker. A job
-- parked on a durable sleep or wait (`parked`) is parked no longer once claimed.
WITH claimable AS MATERIALIZED ({locking})
UPDATE skipqueue_job AS job
SET state = 'running',
    attempts = job.attempts + 1,
    max_attempts = GREATEST(job.max_attempts, job.attempts + 1),
    worker_id = %s,
    worker_ids = COALESCE(job.worker_ids, '[]'::jsonb) || to_jsonb(%s::text),
    first_started_at = COALESCE(job.first_started_at, statement_timestamp()),
    started_at = statement_timestamp(),
    leased_until = statement_timestamp() + LEAST(GREATEST(COALESCE(%s, job.lease), %s), %s),
    parked = ''
FROM claimable
WHERE job.id = claimable.id
RETURNING {columns}

-- name: TRY_KEY_LOCKS
-- claim_limited: a transaction-level advisory lock per concurrency key, tried, not
-- waited for (a key another worker is deciding is left for its next claim). Keys are
-- hashed into the lock space; two keys that collide only share a lock. The ORM has no
-- advisory locks.
SELECT key, pg_try_advisory_xact_lock(hashtextextended('skipqueue-key:' || key, 0))
FROM unnest(%s::text[]) AS key
