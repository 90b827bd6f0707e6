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
-- parked on a durable sleep or wait (`parked`) is parked no longer once claimed. A
-- debounced or throttled job leaves its coalesce key at its claim (queue/coalesce.py):
-- the next call of the key makes the next job, and this one, set back to pending by a
-- retry, a release or the reaper, never meets that job in the key's unique index.
--
-- The rows are updated by their ids as an array (`= ANY(ARRAY(...))`: the primary key's
-- index), not by a join with the CTE: the planner joined by hashing the whole table, a
-- scan of every row per claim (EXPLAIN ANALYZE, a claim of 250 of 20,000 due jobs: 7.2
-- ms, 4.7 of them the scan; 2.3 ms by the array).
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
    parked = '',
    coalesce_key = NULL
WHERE job.id = ANY(ARRAY(SELECT id FROM claimable))
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
-- 1. `keys` (FAIR_WALK): the queue's keys with pending jobs a fair claim may take (no
--    concurrency key), one index probe each (a loose index scan of
--    skipqueue_job_fair_claim_idx): those after `start` (the worker's last claim's
--    largest key), then, wrapping round, the rest; at most `max_walk` of them, so that
--    a claim's cost is bounded however many keys there are.
-- 2. `heads`: each key's first due job (its weight is the key's), one probe each; a key
--    with none due drops out (its jobs are scheduled, or expired); the first `max_keys`
--    keys with one are kept. `running`: each key's running jobs with a live lease.
--    A claim that finds none in its walk while due jobs wait past it goes on from the
--    walk's end next time (FAIR_WALK_END): every key comes round.
-- 3. `slots`: the water-filling, in numbers only: a key's j-th job would have the share
--    (its running jobs + j) / its weight; the `limit` lowest shares say how many jobs
--    each key gets (`wanted`), so that each key's jobs are read up to that many only.
--    Each key's shares are counted up to `level` only (a bound of the `limit`-th), a
--    few per key, not `limit` per key.
-- 4. `picked`: those jobs, in claim order within their key (one index range each), each
--    with its share; locked SKIP LOCKED lowest share first. The state is checked again
--    on the locked row. A claim that gets fewer than `limit` (a key with fewer due jobs
--    than its share, rows a concurrent claim locked) claims once more for the rest
--    (queue/fair.py); reading twice `limit` jobs to spare that cost more (a drain of 51
--    keys: 15 ms a claim of 250, twice the plain claim's 7.7 ms).
-- Measured (EXPLAIN ANALYZE, a claim of 48 over 51 keys of 392 due jobs each): reading
-- each key's first `limit` jobs ran in 4.2 ms, this in 2.2 ms (and 1.5 ms to plan).
-- Tried and dropped: the same query in a PL/pgSQL function, for its cached plan (the
-- statement's planning costs about 1.5 ms): alone it ran in 1.6-2.0 ms against 2.5-3.0,
-- but drains were no faster with it (0.71-0.75x a plain queue's, against 0.72-0.77x).
{walk}, heads AS (
    SELECT keys.fair_key, GREATEST(h.fair_weight, 1)::float8 AS weight
    FROM keys CROSS JOIN LATERAL (
        SELECT j.fair_weight FROM skipqueue_job AS j
        WHERE j.state = 'pending' AND j.queue_name = %(queue)s AND j.fair_key = keys.fair_key
          AND j.run_at <= now() AND j.concurrency_key IS NULL
          AND (j.expires_at IS NULL OR j.expires_at > now())
        ORDER BY j.priority DESC, j.run_at, j.id
        LIMIT 1
    ) AS h
    LIMIT %(max_keys)s
), running AS (
    SELECT fair_key, count(*) AS n FROM skipqueue_job
    WHERE state = 'running' AND leased_until > now() AND queue_name = %(queue)s
      AND fair_key IS NOT NULL
    GROUP BY fair_key
), shares AS (
    SELECT heads.fair_key, heads.weight, COALESCE(running.n, 0) AS n
    FROM heads LEFT JOIN running ON running.fair_key = heads.fair_key
), level AS (
    -- A share no key needs to pass: give each key its part of `limit` by weight,
    -- rounded up (they make `limit` or more), and take the highest share that asks.
    SELECT max((shares.n + ceil(%(limit)s * shares.weight / total.weight)) / shares.weight)
        AS share
    FROM shares, (SELECT sum(weight) AS weight FROM shares) AS total
), wanted AS (
    SELECT fair_key, weight, n, max(rank) AS take FROM (
        SELECT shares.*, rank FROM shares CROSS JOIN level CROSS JOIN LATERAL
            generate_series(1, LEAST(%(limit)s,
                floor(level.share * shares.weight - shares.n + 1e-9)::integer)) AS rank
        ORDER BY (shares.n + rank) / shares.weight
        LIMIT %(limit)s
    ) AS slots
    GROUP BY fair_key, weight, n
), picked AS (
    SELECT p.id, p.priority, p.run_at,
        (wanted.n + row_number() OVER (
            PARTITION BY wanted.fair_key ORDER BY p.priority DESC, p.run_at, p.id
        )) / wanted.weight AS share
    FROM wanted CROSS JOIN LATERAL (
        SELECT j.id, j.priority, j.run_at FROM skipqueue_job AS j
        WHERE j.state = 'pending' AND j.queue_name = %(queue)s AND j.fair_key = wanted.fair_key
          AND j.run_at <= now() AND j.concurrency_key IS NULL
          AND (j.expires_at IS NULL OR j.expires_at > now())
        ORDER BY j.priority DESC, j.run_at, j.id
        LIMIT wanted.take
    ) AS p
    ORDER BY share, p.priority DESC, p.run_at, p.id
    LIMIT %(limit)s
)
-- Each row locked by its primary key (a lateral join: a hash join's scan of the whole
-- table cost 2.4 ms of 6 at 20,000 rows), the state checked again on the locked row.
SELECT locked.id FROM picked CROSS JOIN LATERAL (
    SELECT job.id FROM skipqueue_job AS job
    WHERE job.id = picked.id AND job.state = 'pending'
    FOR NO KEY UPDATE SKIP LOCKED
) AS locked
ORDER BY picked.share, picked.priority DESC, picked.run_at, picked.id

-- name: FAIR_WALK
-- FAIR_LOCKING's and FAIR_WALK_END's walk over a fair queue's keys (see FAIR_LOCKING).
WITH RECURSIVE after_start(fair_key) AS (
    (SELECT fair_key FROM skipqueue_job
     WHERE state = 'pending' AND fair_key IS NOT NULL AND concurrency_key IS NULL
       AND queue_name = %(queue)s
       AND fair_key > %(start)s
     ORDER BY fair_key LIMIT 1)
    UNION ALL
    SELECT (SELECT j.fair_key FROM skipqueue_job AS j
            WHERE j.state = 'pending' AND j.fair_key IS NOT NULL AND j.concurrency_key IS NULL
              AND j.queue_name = %(queue)s
              AND j.fair_key > k.fair_key
            ORDER BY j.fair_key LIMIT 1)
    FROM after_start AS k WHERE k.fair_key IS NOT NULL
), up_to_start(fair_key) AS (
    (SELECT fair_key FROM skipqueue_job
     WHERE state = 'pending' AND fair_key IS NOT NULL AND concurrency_key IS NULL
       AND queue_name = %(queue)s
       AND fair_key <= %(start)s
     ORDER BY fair_key LIMIT 1)
    UNION ALL
    SELECT (SELECT j.fair_key FROM skipqueue_job AS j
            WHERE j.state = 'pending' AND j.fair_key IS NOT NULL AND j.concurrency_key IS NULL
              AND j.queue_name = %(queue)s
              AND j.fair_key > k.fair_key AND j.fair_key <= %(start)s
            ORDER BY j.fair_key LIMIT 1)
    FROM up_to_start AS k WHERE k.fair_key IS NOT NULL
), keys AS (
    SELECT fair_key FROM (
        SELECT fair_key FROM after_start UNION ALL SELECT fair_key FROM up_to_start
    ) AS found
    WHERE fair_key IS NOT NULL
    LIMIT %(max_walk)s
)

-- name: FAIR_WALK_END
-- The last key of a fair claim's walk from `start`, or NULL if the walk saw every key:
-- where the worker's next fair claim starts when this one found no due job in its walk
-- but the plain claim found some past it (queue/fair.py). Run only then.
{walk}
SELECT fair_key FROM keys OFFSET %(max_walk)s - 1 LIMIT 1
