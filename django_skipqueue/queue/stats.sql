-- The queues' gauges and per-minute counts (queue/outcomes.py, queue/managers.py).
-- Loaded by queue/sql.py into STATEMENTS; each "-- name:" starts a statement, whose
-- leading comment lines say why it is raw SQL. Text in braces is filled by queue/sql.py.

-- name: QUEUE_GAUGES
-- The metrics' queue gauges (JobManager.queue_gauges): unfinished jobs only, one
-- SELECT per state, so that each matches the predicate of its partial index (the claim
-- index, the lease index) whatever the finished rows number. One `state IN (...)` read
-- matched neither: 0.78 s, a sequential scan, with 10 million done rows
-- (benchmarks/observability.py). The age is clamped as the models' timestamps are
-- ('-infinity' written by another client would fail the subtraction); 0 when no job is
-- due (GREATEST ignores a NULL: the clamp alone would give 2,000 years). The statement's
-- time, as the ORM's Now(): inside a transaction, now() is its start.
SELECT queue_name, sum(due)::int, sum(later)::int, sum(running)::int, sum(stuck)::int,
    CASE WHEN min(oldest) IS NULL THEN 0 ELSE EXTRACT(EPOCH FROM statement_timestamp()
        - GREATEST(min(oldest), '0001-01-02 00:00:00+00'::timestamptz)) END
FROM (
    SELECT queue_name, count(*) FILTER (WHERE run_at <= statement_timestamp()) AS due,
        count(*) FILTER (WHERE run_at > statement_timestamp()) AS later,
        0 AS running, 0 AS stuck,
        min(run_at) FILTER (WHERE run_at <= statement_timestamp()) AS oldest
    FROM skipqueue_job WHERE state = 'pending' GROUP BY queue_name
    UNION ALL
    SELECT queue_name, 0, 0, count(*),
        count(*) FILTER (WHERE leased_until < statement_timestamp()), NULL
    FROM skipqueue_job WHERE state = 'running' GROUP BY queue_name
) AS unfinished
GROUP BY queue_name

-- name: WAITING_BY_QUEUE
SELECT queue_name, count(*) FROM skipqueue_job WHERE state = 'waiting' GROUP BY queue_name

-- name: ADD_MINUTE
-- QueueMinuteManager.add: each queue's counts added to its row of the current minute
-- (database clock). pickup_buckets add up element by element (a row written with fewer
-- buckets, by an older worker, counts 0 for the others); oldest_due_seconds keeps the
-- largest (GREATEST ignores NULL).
INSERT INTO skipqueue_queueminute AS q (
    queue_name, minute, succeeded, retried, released, failed, cancelled, lost, unknown,
    pickups, pickup_seconds, pickup_buckets, runs, run_seconds, oldest_due_seconds)
SELECT v.queue_name, date_trunc('minute', now()), v.succeeded, v.retried, v.released,
    v.failed,
    v.cancelled, v.lost, v.unknown, v.pickups, v.pickup_seconds, v.pickup_buckets,
    v.runs, v.run_seconds, v.oldest_due_seconds
FROM jsonb_to_recordset(%s::jsonb) AS v(
    queue_name text, succeeded int, retried int, released int, failed int, cancelled int,
    lost int,
    unknown int, pickups int, pickup_seconds float8, pickup_buckets jsonb, runs int,
    run_seconds float8, oldest_due_seconds float8)
ON CONFLICT (queue_name, minute) DO UPDATE SET
    succeeded = q.succeeded + EXCLUDED.succeeded,
    retried = q.retried + EXCLUDED.retried,
    released = q.released + EXCLUDED.released,
    failed = q.failed + EXCLUDED.failed,
    cancelled = q.cancelled + EXCLUDED.cancelled,
    lost = q.lost + EXCLUDED.lost,
    unknown = q.unknown + EXCLUDED.unknown,
    pickups = q.pickups + EXCLUDED.pickups,
    pickup_seconds = q.pickup_seconds + EXCLUDED.pickup_seconds,
    pickup_buckets = (
        SELECT COALESCE(jsonb_agg(
            COALESCE(a.n::bigint, 0) + COALESCE(b.n::bigint, 0)
            ORDER BY COALESCE(a.i, b.i)), '[]'::jsonb)
        FROM jsonb_array_elements_text(
            CASE WHEN jsonb_typeof(q.pickup_buckets) = 'array' THEN q.pickup_buckets
            ELSE '[]'::jsonb END) WITH ORDINALITY AS a(n, i)
        FULL JOIN jsonb_array_elements_text(EXCLUDED.pickup_buckets)
            WITH ORDINALITY AS b(n, i) ON a.i = b.i),
    runs = q.runs + EXCLUDED.runs,
    run_seconds = q.run_seconds + EXCLUDED.run_seconds,
    oldest_due_seconds = GREATEST(q.oldest_due_seconds, EXCLUDED.oldest_due_seconds)

-- name: MINUTE_SAMPLED
-- Whether this minute's oldest-due ages are in (QueueMinuteManager.sampled_this_minute).
SELECT EXISTS (SELECT 1 FROM skipqueue_queueminute
    WHERE minute = date_trunc('minute', now()) AND oldest_due_seconds IS NOT NULL)
