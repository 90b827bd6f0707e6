-- A workflow's rows (queue/workflows.py, queue/rows.py).
-- Loaded by queue/sql.py into STATEMENTS; each "-- name:" starts a statement, whose
-- leading comment lines say why it is raw SQL. Text in braces is filled by queue/sql.py.

-- name: RESERVE_JOB_IDS
-- Workflows (queue/workflows.py). Ids from the job table's own sequence, so that the
-- jobs of a workflow can name each other (dependents, inputs) in the INSERT that writes
-- them. Raw: the ORM cannot call nextval.
SELECT nextval(pg_get_serial_sequence('skipqueue_job', 'id')) FROM generate_series(1, %s)

-- name: WORKFLOW_INSERT
-- A workflow's jobs: one INSERT of a JSON array of records (one parameter, however many
-- jobs). A unique key held by an unfinished job inserts nothing for that row (ON
-- CONFLICT on the partial unique index): the caller compares the ids that come back and
-- refuses the whole workflow. The statement-level NOTIFY trigger wakes the workers of the
-- jobs that are due at once.
INSERT INTO skipqueue_job (id, task, args, kwargs, queue_name, priority, state, run_at,
    lease, attempts, max_attempts, expirations, releases, last_error, errors, created_at,
    unique_key, concurrency_key, concurrency_limit, workflow_id, waiting_on, dependents,
    inputs, ends_workflow, expires_at, rate_key, rate_limit, fair_key, fair_weight)
SELECT r.id, r.task, r.args, r.kwargs, r.queue_name, r.priority, r.state,
    COALESCE(r.run_at, statement_timestamp() + make_interval(secs => r.delay)),
    make_interval(secs => r.lease), {attempts}, r.max_attempts, {expirations}, {releases},
    {last_error}, {errors}::jsonb, statement_timestamp(), r.unique_key, r.concurrency_key,
    r.concurrency_limit, %(workflow)s, r.waiting_on, r.dependents, r.inputs, r.ends_workflow,
    COALESCE(r.expires_at, statement_timestamp() + make_interval(secs => r.expires_in)),
    r.rate_key, r.rate_limit, r.fair_key, COALESCE(r.fair_weight, 1)
FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(id bigint, task text, args jsonb,
    kwargs jsonb, queue_name text, priority smallint, state text, run_at timestamptz,
    delay double precision, lease double precision, max_attempts integer,
    unique_key text, concurrency_key text, concurrency_limit smallint, waiting_on integer,
    dependents jsonb, inputs jsonb, ends_workflow boolean, expires_at timestamptz,
    expires_in double precision, rate_key text, rate_limit text, fair_key text,
    fair_weight smallint)
ORDER BY r.id
ON CONFLICT (task, unique_key) WHERE unique_key IS NOT NULL AND state IN ({unfinished})
DO NOTHING
RETURNING id

-- name: WORKFLOW_COLUMNS
-- A workflow's members of one spec without keys (a group's fan-out): written as
-- ENQUEUE_MANY writes jobs, one JSON array per payload column and the shared columns
-- once, measured three times faster than the record-per-job WORKFLOW_INSERT. nextval
-- runs in ORDER BY n order, so the ids come back increasing with the members' order.
INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at, lease,
    attempts, max_attempts, expirations, releases, last_error, errors, created_at,
    workflow_id, dependents, ends_workflow, expires_at)
SELECT %(task)s, a, k, %(queue)s, %(priority)s, 'pending',
    COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    %(lease)s::interval, {attempts}, %(max_attempts)s, {expirations}, {releases},
    {last_error}, {errors}::jsonb, statement_timestamp(), %(workflow)s,
    %(dependents)s::jsonb, %(ends)s, {expires_at}
FROM ROWS FROM (jsonb_array_elements(%(args)s::jsonb), jsonb_array_elements(%(kwargs)s::jsonb))
    WITH ORDINALITY AS v(a, k, n)
ORDER BY n
RETURNING id
