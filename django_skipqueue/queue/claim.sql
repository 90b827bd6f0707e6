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

-- name: FAIR_LOCKING
-- The locking query of a fair queue's claim (queue/fair.py), which becomes CLAIM's CTE
-- in place of the QuerySet's: the rest of the claim is CLAIM's own. Raw SQL because
-- the ORM has no recursive CTE, and the key-by-key walk below needs one. In steps:
-- 1. `keys`: the queue's pending fair keys, one index probe each (a loose index scan of
--    skipqueue_job_fair_claim_idx): those after `start` (the worker's last claim's
--    largest key), then, wrapping round, the rest; at most `max_keys` of them, so that
--    a claim's cost is bounded however many keys there are, and every key comes round.
-- 2. `heads`: each key's first `limit` due jobs in claim order (one index range each),
--    ranked 1, 2, ... in their key.
-- 3. `running`: each key's running jobs with a live lease (the lease index: as many
--    rows as the workers run).
-- 4. `ranked`: a job's share is (its key's running jobs + its rank) / its weight, the
--    key's place once it would run; the 2 x `limit` lowest, then locked SKIP LOCKED in
--    that order and the first `limit` kept, so that a concurrent claim that locked some
--    of them leaves this one the next. The state is checked again on the locked row.
WITH RECURSIVE after_start(fair_key) AS (
    (SELECT fair_key FROM skipqueue_job
     WHERE state = 'pending' AND fair_key IS NOT NULL AND queue_name = %(queue)s
       AND fair_key > %(start)s
     ORDER BY fair_key LIMIT 1)
    UNION ALL
    SELECT (SELECT j.fair_key FROM skipqueue_job AS j
            WHERE j.state = 'pending' AND j.fair_key IS NOT NULL AND j.queue_name = %(queue)s
              AND j.fair_key > k.fair_key
            ORDER BY j.fair_key LIMIT 1)
    FROM after_start AS k WHERE k.fair_key IS NOT NULL
), up_to_start(fair_key) AS (
    (SELECT fair_key FROM skipqueue_job
     WHERE state = 'pending' AND fair_key IS NOT NULL AND queue_name = %(queue)s
       AND fair_key <= %(start)s
     ORDER BY fair_key LIMIT 1)
    UNION ALL
    SELECT (SELECT j.fair_key FROM skipqueue_job AS j
            WHERE j.state = 'pending' AND j.fair_key IS NOT NULL AND j.queue_name = %(queue)s
              AND j.fair_key > k.fair_key AND j.fair_key <= %(start)s
            ORDER BY j.fair_key LIMIT 1)
    FROM up_to_start AS k WHERE k.fair_key IS NOT NULL
), keys AS (
    SELECT fair_key FROM (
        SELECT fair_key FROM after_start UNION ALL SELECT fair_key FROM up_to_start
    ) AS found
    WHERE fair_key IS NOT NULL
    LIMIT %(max_keys)s
), heads AS (
    SELECT h.id, h.fair_key, h.fair_weight, h.priority, h.run_at,
        row_number() OVER (
            PARTITION BY h.fair_key ORDER BY h.priority DESC, h.run_at, h.id
        ) AS rank
    FROM keys CROSS JOIN LATERAL (
        SELECT j.id, j.fair_key, j.fair_weight, j.priority, j.run_at FROM skipqueue_job AS j
        WHERE j.state = 'pending' AND j.queue_name = %(queue)s AND j.fair_key = keys.fair_key
          AND j.run_at <= now() AND j.concurrency_key IS NULL
          AND (j.expires_at IS NULL OR j.expires_at > now())
        ORDER BY j.priority DESC, j.run_at, j.id
        LIMIT %(limit)s
    ) AS h
), running AS (
    SELECT fair_key, count(*) AS n FROM skipqueue_job
    WHERE state = 'running' AND leased_until > now() AND queue_name = %(queue)s
      AND fair_key IS NOT NULL
    GROUP BY fair_key
), ranked AS (
    SELECT heads.id, heads.priority, heads.run_at,
        (COALESCE(running.n, 0) + heads.rank)::float8 / GREATEST(heads.fair_weight, 1) AS share
    FROM heads LEFT JOIN running ON running.fair_key = heads.fair_key
    ORDER BY share, heads.priority DESC, heads.run_at, heads.id
    LIMIT 2 * %(limit)s
)
SELECT job.id FROM skipqueue_job AS job JOIN ranked ON ranked.id = job.id
WHERE job.state = 'pending'
ORDER BY ranked.share, ranked.priority DESC, ranked.run_at, job.id
LIMIT %(limit)s
FOR NO KEY UPDATE OF job SKIP LOCKED
