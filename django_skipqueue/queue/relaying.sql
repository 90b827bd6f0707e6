-- The relay's write-back (queue/relaying.py).
-- Loaded by queue/sql.py into STATEMENTS; each "-- name:" starts a statement, whose
-- leading comment lines say why it is raw SQL. Text in braces is filled by queue/sql.py.

-- name: WRITE_BACK
-- Relayed queues with RESULTS: the consumer's outcomes, one statement per batch. Only
-- rows the relay marked `relayed` change (a row an operator touched meanwhile stays).
UPDATE skipqueue_job AS job
SET state = outcome.state,
    result = outcome.result,
    last_error = outcome.error,
    attempts = GREATEST(job.attempts, LEAST(job.max_attempts, outcome.attempt)),
    leased_until = NULL,
    finished_at = statement_timestamp()
FROM unnest(%s::bigint[], %s::text[], %s::jsonb[], %s::text[], %s::int[])
    AS outcome(id, state, result, error, attempt)
WHERE job.id = outcome.id AND job.state = 'relayed'
