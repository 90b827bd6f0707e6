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
-- time, as the ORM's Now(): inside a transaction, now() is its start. A job parked on a
-- durable sleep or a wait for a signal (`parked`) is counted apart from the scheduled
-- ones until its time comes; then it is due as any other.
SELECT queue_name, sum(due)::int, sum(later)::int, sum(running)::int, sum(stuck)::int,
    CASE WHEN min(oldest) IS NULL THEN 0 ELSE EXTRACT(EPOCH FROM statement_timestamp()
        - GREATEST(min(oldest), '0001-01-02 00:00:00+00'::timestamptz)) END,
    sum(sleeping)::int, sum(awaiting)::int
FROM (
    SELECT queue_name, count(*) FILTER (WHERE run_at <= statement_timestamp()) AS due,
        count(*) FILTER (WHERE run_at > statement_timestamp() AND parked = '') AS later,
        0 AS running, 0 AS stuck,
        min(run_at) FILTER (WHERE run_at <= statement_timestamp()) AS oldest,
        count(*) FILTER (WHERE run_at > statement_timestamp() AND parked = 'sleep')
            AS sleeping,
        count(*) FILTER (WHERE run_at > statement_timestamp() AND parked = 'signal')
            AS awaiting
    FROM skipqueue_job WHERE state = 'pending' GROUP BY queue_name
    UNION ALL
    SELECT queue_name, 0, 0, count(*),
        count(*) FILTER (WHERE leased_until < statement_timestamp()), NULL, 0, 0
    FROM skipqueue_job WHERE state = 'running' GROUP BY queue_name
) AS unfinished
GROUP BY queue_name

-- name: WAITING_BY_QUEUE
SELECT queue_name, count(*) FROM skipqueue_job WHERE state = 'waiting' GROUP BY queue_name

-- name: ADD_MINUTE
-- QueueMinuteManager.add: each queue's counts added to its row of the current minute
-- (database clock). pickup_buckets add up element by element (skipqueue_add_buckets,
-- migration 0024: a row written with fewer buckets, by an older worker, counts 0 for the
-- others); oldest_due_seconds keeps the largest (GREATEST ignores NULL).
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
    pickup_buckets = skipqueue_add_buckets(q.pickup_buckets, EXCLUDED.pickup_buckets),
    runs = q.runs + EXCLUDED.runs,
    run_seconds = q.run_seconds + EXCLUDED.run_seconds,
    oldest_due_seconds = GREATEST(q.oldest_due_seconds, EXCLUDED.oldest_due_seconds)

-- name: ADD_TASK_MINUTE
-- TaskMinuteManager.add: each task's counts added to its row of the current minute, as
-- ADD_MINUTE does per queue. A row that brings an error (its job id not null) replaces
-- the minute's last error, stamped with the database clock.
INSERT INTO skipqueue_taskminute AS t (
    task, minute, succeeded, retried, released, failed, cancelled, lost, unknown,
    runs, run_seconds, run_buckets, last_error, last_error_job, last_error_at)
SELECT v.task, date_trunc('minute', now()), v.succeeded, v.retried, v.released, v.failed,
    v.cancelled, v.lost, v.unknown, v.runs, v.run_seconds, v.run_buckets,
    COALESCE(v.last_error, ''), v.last_error_job,
    CASE WHEN v.last_error_job IS NOT NULL THEN now() END
FROM jsonb_to_recordset(%s::jsonb) AS v(
    task text, succeeded int, retried int, released int, failed int, cancelled int,
    lost int, unknown int, runs int, run_seconds float8, run_buckets jsonb,
    last_error text, last_error_job bigint)
ON CONFLICT (task, minute) DO UPDATE SET
    succeeded = t.succeeded + EXCLUDED.succeeded,
    retried = t.retried + EXCLUDED.retried,
    released = t.released + EXCLUDED.released,
    failed = t.failed + EXCLUDED.failed,
    cancelled = t.cancelled + EXCLUDED.cancelled,
    lost = t.lost + EXCLUDED.lost,
    unknown = t.unknown + EXCLUDED.unknown,
    runs = t.runs + EXCLUDED.runs,
    run_seconds = t.run_seconds + EXCLUDED.run_seconds,
    run_buckets = skipqueue_add_buckets(t.run_buckets, EXCLUDED.run_buckets),
    last_error = CASE WHEN EXCLUDED.last_error_job IS NULL THEN t.last_error
                      ELSE EXCLUDED.last_error END,
    last_error_job = COALESCE(EXCLUDED.last_error_job, t.last_error_job),
    last_error_at = COALESCE(EXCLUDED.last_error_at, t.last_error_at)

-- name: MINUTE_SAMPLED
-- Whether this minute's oldest-due ages are in (QueueMinuteManager.sampled_this_minute).
SELECT EXISTS (SELECT 1 FROM skipqueue_queueminute
    WHERE minute = date_trunc('minute', now()) AND oldest_due_seconds IS NOT NULL)

-- name: TASK_WINDOWS
-- stats.task_stats: each task's counts over the last day, in two parts: the last hour
-- (recent) and the 23 before. Reads the minute index, never the job table. The last
-- columns are one sum((run_buckets->>i)::bigint) per bucket (sql.task_windows_statement): 130 ms
-- for 50 tasks busy every minute of the day, where unnesting the arrays took 900 ms.
SELECT task, minute > date_trunc('minute', now()) - make_interval(mins => %(hour)s) AS recent,
    sum(runs), sum(succeeded), sum(retried), sum(failed), sum(cancelled), sum(run_seconds),
    {buckets}
FROM skipqueue_taskminute
WHERE minute > date_trunc('minute', now()) - make_interval(mins => %(day)s) AND minute <= now()
GROUP BY task, recent

-- name: TASK_LAST_ERRORS
-- stats.task_stats: each task's newest error of the last day, and how long ago.
SELECT DISTINCT ON (task) task, last_error, last_error_job, now() - last_error_at
FROM skipqueue_taskminute
WHERE minute > date_trunc('minute', now()) - make_interval(mins => %(day)s) AND minute <= now()
    AND last_error_job IS NOT NULL
ORDER BY task, last_error_at DESC
