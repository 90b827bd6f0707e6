-- Waiting on one job (queue/awaiting.py). Loaded by queue/sql.py into STATEMENTS; each
-- "-- name:" starts a statement, whose leading comment lines say why it is raw SQL.

-- name: MARK_AWAITED
-- A waiter's mark: an unfinished row notifies 'skipqueue!job' when a statement
-- finishes it (the trigger of migration 0022); a finished row is never
-- written (it never changes but by an operator's retry). Raw: it runs on the waiters'
-- shared listener's own connection, in autocommit (queue/finished.py), never on the
-- caller's, which may be inside a transaction. Returns whether another session sees
-- the row at all (not when its enqueue has not committed, or it is gone).
-- Parameters: the job id, twice.
WITH marked AS (
    UPDATE skipqueue_job SET awaited = true
    WHERE id = %s AND NOT awaited AND state NOT IN ({finished})
    RETURNING id
)
SELECT EXISTS (SELECT 1 FROM skipqueue_job WHERE id = %s)

-- name: FINISHED_AMONG
-- Which of the jobs this process's waiters wait on are finished: one read for all of
-- them, by whichever waiter read a 'skipqueue!job' notification (queue/finished.py),
-- so that only the waiters whose job finished read their row again. Raw: it runs on
-- the listener's side connection, as MARK_AWAITED. Parameter: the job ids.
SELECT id FROM skipqueue_job WHERE id = ANY(%s) AND state IN ({finished})
