-- The enqueue's statements (queue/enqueue.py, queue/rows.py).
-- Loaded by queue/sql.py into STATEMENTS; each "-- name:" starts a statement, whose
-- leading comment lines say why it is raw SQL. Text in braces is filled by queue/sql.py.

-- name: ENQUEUE_MANY
-- Bulk enqueue: one INSERT per batch with one JSON array parameter per column (measured: the
-- ORM's bulk_create compiled 20 fields x 20,000 rows into 400,000 parameters, about 40x
-- slower). The statement-level NOTIFY trigger fires once per statement. One row comes
-- back: the ids in insertion order (nextval is called row by row in ORDER BY n, so the
-- ids increase with n), the unique keys of the rows inserted (unique jobs only), and the
-- run_at and created_at that every row of it shares.
--
-- Unique jobs add the unique_key column and ON CONFLICT DO NOTHING on the partial unique
-- index of (task, unique_key) (Job's skipqueue_job_unique_key; the WHERE repeats its
-- condition so that PostgreSQL infers it): a call whose key an unfinished job holds, or
-- an earlier call of the same statement, inserts nothing and raises nothing, so the
-- caller's transaction goes on. Only the rows inserted come back, with their keys.
WITH inserted AS (
    INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
        lease, attempts, max_attempts, expirations, releases, last_error, errors,
        created_at{key_column}{ck_column}{exp_column}{rate_column}{trace_column}{fair_column}{order_column})
    SELECT %(task)s, a, k, %(queue)s, %(priority)s, {state},
        COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
        %(lease)s::interval, {attempts}, %(max_attempts)s, {expirations}, {releases},
        {last_error}, {errors}::jsonb,
        statement_timestamp(){key_value}{ck_value}{exp_value}{rate_value}{trace_value}{fair_value}{order_value}
    FROM ROWS FROM (jsonb_array_elements(%(args)s::jsonb),
        jsonb_array_elements(%(kwargs)s::jsonb){key_rows}{ck_rows}{rate_rows}{fair_rows})
        WITH ORDINALITY AS v(a, k, {key_name}{ck_name}{rate_name}{fair_name}n)
    ORDER BY n{on_conflict}
    RETURNING id{key_out}
)
SELECT COALESCE(array_agg(id ORDER BY id), '{{}}'), {keys_agg},
    COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    statement_timestamp(){ck_notify}
FROM inserted

-- name: ENQUEUE_ONE
-- One job, no unique or concurrency key and no rate limit (the common `enqueue()`): a
-- plain INSERT ... VALUES. Measured against ENQUEUE_MANY with one row, on PostgreSQL 15:
-- 120 us of client CPU and 330 us of round trip against 155 and 550 (no JSON arrays to
-- unnest, no ORDER BY, no aggregate). The same defaults and parts as ENQUEUE_MANY.
INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
    lease, attempts, max_attempts, expirations, releases, last_error, errors,
    created_at{exp_column}{trace_column})
VALUES (%(task)s, %(args)s::jsonb, %(kwargs)s::jsonb, %(queue)s, %(priority)s, {state},
    COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    %(lease)s::interval, {attempts}, %(max_attempts)s, {expirations}, {releases},
    {last_error}, {errors}::jsonb, statement_timestamp(){exp_value}{trace_value})
RETURNING id, run_at, created_at

-- name: UNFINISHED_WITH_KEYS
-- Unique jobs, on a conflict: the unfinished jobs that hold these keys (the ones the
-- INSERT above did not write). Raw, beside the INSERT it completes.
SELECT unique_key, id, state FROM skipqueue_job
WHERE task = %s AND unique_key = ANY(%s::text[]) AND unique_key IS NOT NULL
  AND state = ANY(%s::text[])

-- name: REPLACE_PENDING
-- Unique jobs, on_conflict="replace": the pending job holding each key takes the new
-- call's arguments and run time. Only pending rows are written (and so locked): a running
-- job is left alone, and the claim, which skips locked rows, never waits on this.
UPDATE skipqueue_job AS job
SET args = v.a, kwargs = v.k,
    run_at = COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    expires_at = {expires_at}
FROM ROWS FROM (jsonb_array_elements(%(args)s::jsonb), jsonb_array_elements(%(kwargs)s::jsonb),
    jsonb_array_elements_text(%(keys)s::jsonb)) AS v(a, k, u)
WHERE job.task = %(task)s AND job.unique_key = v.u AND job.state = 'pending'
RETURNING job.unique_key, job.id

-- name: COUNT_PENDING_UP_TO
-- The volume guard of MAX_PENDING_PER_QUEUE: an index scan of at most `cap` entries of
-- the claim index, never a count of the whole queue. Raw for the LIMIT inside count().
SELECT count(*) FROM (
    SELECT 1 FROM skipqueue_job WHERE state = 'pending' AND queue_name = %s LIMIT %s
) AS capped

-- name: COALESCE_INSERT
-- Debounce and throttle (queue/coalesce.py): one call's job, joined to the pending job of
-- its task and coalesce key if there is one. The conflict target is the partial unique
-- index skipqueue_job_coalesce_key (the WHERE repeats its condition so that PostgreSQL
-- infers it); under concurrent enqueues of one key, PostgreSQL makes the second wait for
-- the first's commit, then conflict with its row (or insert, if it rolled back). A
-- debounce moves the pending job's arguments and run time to this call's, never past
-- its `coalesce_until`; a throttle keeps the first call's (DO NOTHING). A job claimed
-- meanwhile is pending no longer: the call inserts a job of its own. Raw: the ORM's
-- upsert cannot name a partial index. The columns are the model's, filled by queue/sql.py.
INSERT INTO skipqueue_job ({columns}, run_at, created_at, coalesce_until, expires_at)
VALUES ({values},
    COALESCE(%s::timestamptz, statement_timestamp() + %s::interval), statement_timestamp(),
    statement_timestamp() + %s::interval,
    COALESCE(%s::timestamptz, statement_timestamp() + %s::interval))
ON CONFLICT (task, coalesce_key) WHERE coalesce_key IS NOT NULL AND state = 'pending'
{on_conflict}
RETURNING id

-- name: COALESCE_HOLDER
-- A throttled call whose key a pending job holds: that job (Raw, beside the INSERT).
SELECT id FROM skipqueue_job
WHERE task = %s AND coalesce_key = %s AND coalesce_key IS NOT NULL AND state = 'pending'

-- name: LOCK_ORDERED_KEYS
-- Strict order per key (queue/enqueue.py): before an ordered job's INSERT, its key's
-- transaction-level advisory lock, waited for, in key order (no deadlock between two
-- enqueues of several keys). Held to the caller's commit: a second enqueue of the key
-- takes its id only after the first committed, so ids follow the commits and the claim
-- can run a key's jobs in id order. The cost: concurrent enqueues of one key queue up
-- behind the open transaction of the first. The ORM has no advisory locks.
SELECT pg_advisory_xact_lock(hashtextextended('skipqueue-order:' || key, 0))
FROM unnest(%s::text[]) AS key ORDER BY key
