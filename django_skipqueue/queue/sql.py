"""The few raw statements the ORM cannot say, one function each, with the reason.

Parameters are always passed separately; identifiers go through psycopg.sql.Identifier.
Nothing here is session-scoped, so it all works behind PgBouncer in transaction mode,
except LISTEN, which the worker runs only on its own direct connection.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from psycopg import sql

from django_skipqueue.core.states import UNFINISHED_STATES, validate_queue_name

if TYPE_CHECKING:
    import psycopg
    from django.db.backends.utils import CursorWrapper

#: The advisory lock that lets one housekeeper at a time reap and prune. A constant
#: from the bytes "skipqueue" so it does not collide with the project's own locks.
REAPER_LOCK_KEY = int.from_bytes(b"skipqueu", "big") >> 1

#: The states in which a job holds its unique key, as an SQL list: the predicate of the
#: partial unique index skipqueue_job_unique_key, which ON CONFLICT must repeat.
UNFINISHED = ", ".join(f"'{state}'" for state in UNFINISHED_STATES)

CHANNEL_PREFIX = "skipqueue_"
#: The channel of flow-control changes (a queue paused or resumed): every listening
#: worker reads the queue table again. Not a queue's: queue channels are
#: "skipqueue_<queue>" and a queue name cannot contain "!".
CONTROL_CHANNEL = "skipqueue!control"
#: The channel an enqueue of jobs with a concurrency key notifies (at commit), so that
#: workers look for them at once: the claim's fast path leaves them out, and probing
#: for them on every claim was measured to add 0.3 to 1.5 ms to the pickup latency.
KEYED_CHANNEL = "skipqueue!keyed"
#: The payload of the NOTIFY a worker sends itself to check that LISTEN works, followed
#: by a token of that check's own: workers that start together test on the same
#: channel, and one must not take another's notification for its own.
SELF_TEST_PAYLOAD = "skipqueue:listen-self-test"


def channel_name(queue_name: str) -> str:
    """The LISTEN/NOTIFY channel of a queue (at most 58 bytes, under PostgreSQL's 63)."""
    return CHANNEL_PREFIX + validate_queue_name(queue_name)


def try_advisory_xact_lock(cursor: CursorWrapper, key: int = REAPER_LOCK_KEY) -> bool:
    """Take a transaction-level advisory lock if free; released at commit or rollback.

    The ORM has no advisory locks. Transaction-level (never session-level) so that a
    transaction pooler cannot leave it held on a server connection.
    """
    cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [key])
    return bool(cursor.fetchone()[0])


def listen(connection: psycopg.Connection[tuple[object, ...]], queue_names: list[str]) -> None:
    """LISTEN on each queue's channel, on a raw psycopg connection in autocommit.

    The ORM cannot LISTEN, and a channel is an identifier, not a parameter: it is
    validated, then quoted by psycopg.
    """
    for queue_name in queue_names:
        connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(queue_name))))


def listen_channel(connection: psycopg.Connection[tuple[object, ...]], channel: str) -> None:
    """LISTEN on one of our fixed channels (a constant of this package, quoted)."""
    connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


def listen_control(connection: psycopg.Connection[tuple[object, ...]]) -> None:
    """LISTEN on the flow-control channels (CONTROL_CHANNEL, KEYED_CHANNEL)."""
    for channel in (CONTROL_CHANNEL, KEYED_CHANNEL):
        connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


def seconds_until_next_due(cursor: CursorWrapper, queue_names: list[str]) -> float | None:
    """Seconds from the database's now until the earliest pending job of these queues
    without a concurrency key (keyed ones may wait for a slot; the worker looks for them
    on its own schedule).

    Computed on the database clock (the ORM would hand back a datetime to compare
    with the process clock). None when nothing is pending.
    """
    cursor.execute(
        "SELECT EXTRACT(EPOCH FROM min(run_at) - now()) FROM skipqueue_job "
        "WHERE state = 'pending' AND queue_name = ANY(%s) AND concurrency_key IS NULL",
        [queue_names],
    )
    value = cursor.fetchone()[0]
    return None if value is None else float(value)


# The claim. Which rows, and in which order, is JobQuerySet.claimable(), an ORM
# QuerySet; its compiled locking query (SELECT id ... ORDER BY ... LIMIT n FOR NO KEY
# UPDATE SKIP LOCKED) becomes the CTE of one claiming statement, so the rows are locked
# and marked running in one round trip. The MATERIALIZED CTE keeps the planner from
# running the locking subquery more than once, which could claim more rows than LIMIT
# (Oban commit 3990921; finding 0.9 of docs/explanation/failure-model.md).
#
# Measured, side by side: the ORM's own statements (BEGIN, locking SELECT, UPDATE,
# SELECT, COMMIT) cost 3.3 ms a claim of one job and 5.9 ms of 16 (0.37 ms a job), where
# one raw statement cost 0.9 and 2.3 ms (0.14 ms a job), on PostgreSQL 15. This form
# (the QuerySet compiled once, then one statement in autocommit) costs what the raw
# statement does: 1.00x to 1.01x per job at 16 a claim and at 1, over three runs of
# benchmarks/run.py --parts claimpath (embedded PostgreSQL 18, 2 cores; about 0.2 ms a
# job at 16). Compiling on every claim, or wrapping the statement in atomic()'s BEGIN
# and COMMIT, cost 10 to 40 % more a job.
#
# Whatever state a row was put in by hand or by another writer, this write keeps the
# table's constraints: a job set back to pending with no attempt left gets one more
# (`attempts <= max_attempts`), and its lease is clamped to the bounds a task may ask
# for (a lease of `timedelta.max` would overflow the timestamp). It names the columns it
# returns: a column added by a later migration must not reach an older worker.
_CLAIM = """
WITH claimable AS MATERIALIZED ({locking})
UPDATE skipqueue_job AS job
SET state = 'running',
    attempts = job.attempts + 1,
    max_attempts = GREATEST(job.max_attempts, job.attempts + 1),
    worker_id = %s,
    worker_ids = COALESCE(job.worker_ids, '[]'::jsonb) || to_jsonb(%s::text),
    first_started_at = COALESCE(job.first_started_at, statement_timestamp()),
    started_at = statement_timestamp(),
    leased_until = statement_timestamp() + LEAST(GREATEST(COALESCE(%s, job.lease), %s), %s)
FROM claimable
WHERE job.id = claimable.id
RETURNING {columns}
"""


def _returned(columns: tuple[str, ...], prefix: str = "job.") -> str:
    return ", ".join(
        f'{prefix}"{column}"'
        if column != "lease"
        else f"LEAST(GREATEST({prefix}lease, %s), %s) AS lease"
        for column in columns
    )


# The limited claim's rows, read after its transaction committed (claim_limited): the
# transaction that holds the queue's row lock returns ids only, so that a worker frozen
# while the server sends it the claimed payloads (megabytes, say) holds no lock; the
# server cannot end a session that is blocked writing to its client. Parameters: the
# lease bounds (MIN_LEASE, MAX_LEASE), then the ids.
_LOAD_CLAIMED = "SELECT {columns} FROM skipqueue_job WHERE id = ANY(%s) ORDER BY id"


@functools.lru_cache(maxsize=4)
def load_claimed_statement(columns: tuple[str, ...]) -> str:
    return _LOAD_CLAIMED.format(columns=_returned(columns, ""))


@functools.lru_cache(maxsize=256)
def claim_statement(locking: str, columns: tuple[str, ...]) -> str:
    """The claim around a compiled locking query, returning `columns` of each row.

    Parameters, after the locking query's own: the worker's id, the name this attempt
    records in `worker_ids`, the lease (None: each row's own), then the lease bounds
    twice (MIN_LEASE, MAX_LEASE: for the new lease and for the lease returned, by which
    the worker schedules its renewals).
    """
    return _CLAIM.format(locking=locking, columns=_returned(columns))


# claim_limited: the claim of rows its transaction already locked and chose, in place of
# the compiled locking query (the same claiming statement around it).
CLAIM_THESE = "SELECT id FROM skipqueue_job WHERE id = ANY(%s)"

# claim_limited: a transaction-level advisory lock per concurrency key, tried, not
# waited for (a key another worker is deciding is left for its next claim). Keys are
# hashed into the lock space; two keys that collide only share a lock. The ORM has no
# advisory locks.
TRY_KEY_LOCKS = """
SELECT key, pg_try_advisory_xact_lock(hashtextextended('skipqueue-key:' || key, 0))
FROM unnest(%s::text[]) AS key
"""


# The workflows of these jobs, locked in id order before any of the jobs' rows: every
# statement that changes the state of a workflow's job takes its workflow first. The
# trigger skipqueue_workflow_step locks in the order job, its children, its workflow;
# an operator's cancel locks the workflow, then its jobs: without this, an ack and a
# cancel of the same workflow deadlocked (14 times in 12 rounds of a 400-member group
# on 3 workers). Only jobs of a workflow pay it. Parameter: the job ids.
LOCK_WORKFLOWS_OF = """
SELECT id FROM skipqueue_workflow
WHERE id IN (SELECT workflow_id FROM skipqueue_job WHERE id = ANY(%s))
ORDER BY id
FOR NO KEY UPDATE
"""

# The fenced ack, raw for the same measured reason as the claim: one statement for one
# job or many, one row per (id, attempt, result), each with its own fence. The worker
# acknowledges every job that finished while its previous batch committed.
#
# Its rows are found by the primary key alone, whatever the statistics say:
# - the state test is `(job.state || '')`, which no partial index matches
#   (base._NoIndex says why: the walk through every running job's entry that the
#   planner otherwise chose);
# - no join: each row's attempt and result are read by its id from two JSON objects
#   (a lookup by key in a jsonb object is a binary search). Joined to the unnested
#   arrays instead, the planner, which guesses one row for the hidden state (and for
#   the lease where ANALYZE saw no running job), read the whole batch once for each row
#   found: 2,000 jobs running, an ack of 136 took 10 ms (5 ms before the state was
#   hidden); with `array_position` into the arrays, 1,500 took 62 ms.
# Parameters: the results as a JSON object by id (an id whose result is None left out:
# the column stays NULL), the ids as an array's text, the attempts as a JSON object by
# id (base._ack_parameters). Its generic plan (what a prepared statement of it would
# keep, after five runs, where that costs no more) finds the rows by the primary key as
# well (tests/test_managers.py, EXPLAIN EXECUTE).
ACK_MANY = """
UPDATE skipqueue_job AS job
SET state = 'done', result = %(results)s::jsonb -> job.id::text,
    finished_at = statement_timestamp(), leased_until = NULL
WHERE job.id = ANY(%(ids)s::bigint[]) AND (job.state || '') = 'running'
  AND job.attempts = (%(attempts)s::jsonb ->> job.id::text)::integer
  AND job.leased_until > statement_timestamp()
RETURNING job.id
"""

# The housekeeper's renewal of the leases due in one pass: one statement, each row fenced on its own
# as `JobManager.renewal`'s UPDATE is (the attempt, running, an unexpired lease, no cancel
# requested), the lease clamped to MIN_LEASE..MAX_LEASE and never shortened. Renewed one by one, 300
# leases of 1 s fell behind their expiry (1,049 duplicate runs of 3,000 jobs;
# tests/test_managers.py, `test_renew_many_...`). Rows another session has locked are skipped, not
# waited for: waiting, the statement kept the locks of the rows it had renewed, and the dispatcher's
# acks of those waited behind it (one row locked for 3 s elsewhere, 421 leases lost;
# tests/test_worker.py, `test_a_renewal_skips_a_row_...`); the housekeeper tries those again shortly
# (`JobManager.holding_many` tells them from lost ones). Written as ACK_MANY is (the state hidden
# from the planner, the attempts read by id from one JSON object).
RENEW_MANY = """
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
"""

# A worker's release of the jobs it gives back at a graceful stop (`JobManager.release`
# for many): pending again, due now, without spending an attempt (`max_attempts` + 1,
# `releases` + 1), each row fenced on its own, written as RENEW_MANY is. A job with a
# cancel request is left to `release`, which ends it cancelled. One UPDATE a job made a
# stop with a full prefetch buffer (256 jobs) take 0.1-1 s (tests/test_managers.py,
# `test_release_many_...`).
RELEASE_MANY = """
UPDATE skipqueue_job AS job
SET state = 'pending', run_at = statement_timestamp(), leased_until = NULL,
    max_attempts = job.max_attempts + 1, releases = job.releases + 1
WHERE job.id = ANY(%(ids)s::bigint[]) AND (job.state || '') = 'running'
  AND job.attempts = (%(attempts)s::jsonb ->> job.id::text)::integer
  AND job.leased_until > statement_timestamp()
  AND job.cancel_requested_at IS NULL
RETURNING job.id
"""

#: The columns ENQUEUE_MANY fills with the model fields' defaults: written into the
#: statement as literals, once (`enqueue_many_statement`), not sent with every call.
ENQUEUE_DEFAULTS = ("state", "attempts", "expirations", "releases", "last_error", "errors")

# Bulk enqueue: one INSERT per batch with one JSON array parameter per column (measured: the
# ORM's bulk_create compiled 20 fields x 20,000 rows into 400,000 parameters, about 40x
# slower). The statement-level NOTIFY trigger fires once per statement. One row comes
# back: the ids in insertion order (nextval is called row by row in ORDER BY n, so the
# ids increase with n), the unique keys of the rows inserted (unique jobs only), and the
# run_at and created_at that every row of it shares.
#
# Unique jobs add the unique_key column and ON CONFLICT DO NOTHING on the partial unique
# index of (task, unique_key) (Job's skipqueue_job_unique_key; the WHERE repeats its
# condition so that PostgreSQL infers it): a call whose key an unfinished job holds, or
# an earlier call of the same statement, inserts nothing and raises nothing, so the
# caller's transaction goes on. Only the rows inserted come back, with their keys.
ENQUEUE_MANY = """
WITH inserted AS (
    INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
        lease, attempts, max_attempts, expirations, releases, last_error, errors,
        created_at{key_column}{ck_column}{exp_column}{rate_column}{trace_column})
    SELECT %(task)s, a, k, %(queue)s, %(priority)s, {state},
        COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
        %(lease)s::interval, {attempts}, %(max_attempts)s, {expirations}, {releases},
        {last_error}, {errors}::jsonb,
        statement_timestamp(){key_value}{ck_value}{exp_value}{rate_value}{trace_value}
    FROM ROWS FROM (jsonb_array_elements(%(args)s::jsonb),
        jsonb_array_elements(%(kwargs)s::jsonb){key_rows}{ck_rows})
        WITH ORDINALITY AS v(a, k, {key_name}{ck_name}n)
    ORDER BY n{on_conflict}
    RETURNING id{key_out}
)
SELECT COALESCE(array_agg(id ORDER BY id), '{{}}'), {keys_agg},
    COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    statement_timestamp(){ck_notify}
FROM inserted
"""

_UNIQUE_PARTS = {
    "key_column": ", unique_key",
    "key_value": ", u",
    "key_rows": ", jsonb_array_elements_text(%(keys)s::jsonb)",
    "key_name": "u, ",
    "on_conflict": (
        "\n    ON CONFLICT (task, unique_key) WHERE unique_key IS NOT NULL"
        f" AND state IN ({UNFINISHED}) DO NOTHING"
    ),
    "key_out": ", unique_key",
    "keys_agg": "COALESCE(array_agg(unique_key ORDER BY id), '{}')",
}
_PLAIN_PARTS = dict.fromkeys(_UNIQUE_PARTS, "") | {"keys_agg": "NULL::text[]"}
# Flow control: each row's concurrency key (a `concurrency_keys` parameter, a JSON
# array of texts) and the task's limit.
_KEYED_PARTS = {
    "ck_column": ", concurrency_key, concurrency_limit",
    "ck_value": ", c, %(concurrency_limit)s",
    "ck_rows": ", jsonb_array_elements_text(%(concurrency_keys)s::jsonb)",
    "ck_name": "c, ",
    "ck_notify": ",\n    pg_notify('skipqueue!keyed', '')",
}
_UNKEYED_PARTS = dict.fromkeys(_KEYED_PARTS, "")
# Expiring jobs (`expires`): a given instant, or a delay after the statement's time.
EXPIRES_AT = (
    "COALESCE(%(expires_at)s::timestamptz, statement_timestamp() + %(expires_in)s::interval)"
)
_EXPIRING_PARTS = {"exp_column": ", expires_at", "exp_value": f",\n        {EXPIRES_AT}"}
_LASTING_PARTS = dict.fromkeys(_EXPIRING_PARTS, "")
# Rate limits per task: each row's rate key and limit (the task's). Such a job is keyed
# too (the keyed parts: its own concurrency key, or its task's rate key of no limit).
_RATED_PARTS = {
    "rate_column": ", rate_key, rate_limit",
    "rate_value": ", %(rate_key)s, %(rate_limit)s",
}
_UNRATED_PARTS = dict.fromkeys(_RATED_PARTS, "")
# Traced enqueues (OpenTelemetry): the W3C trace context of the enqueuing span.
_TRACED_PARTS = {"trace_column": ", trace_context", "trace_value": ", %(trace)s::jsonb"}
_UNTRACED_PARTS = dict.fromkeys(_TRACED_PARTS, "")


def _literals(defaults: tuple[tuple[str, object], ...]) -> dict[str, str]:
    """The defaults (column, value) as SQL literals quoted by psycopg, "%" doubled: the
    statements go through %-style parameter binding."""
    return {
        column: sql.Literal(value).as_string(None).replace("%", "%%") for column, value in defaults
    }


@functools.lru_cache(maxsize=16)
def enqueue_many_statement(
    defaults: tuple[tuple[str, object], ...],
    unique: bool = False,
    keyed: bool = False,
    expiring: bool = False,
    rated: bool = False,
    traced: bool = False,
) -> str:
    """ENQUEUE_MANY with the defaults (column, value) quoted in as literals by psycopg;
    with `unique`, the form for unique jobs (a `keys` parameter: a JSON array of texts);
    with `keyed`, the concurrency key and limit columns; with `expiring`, `expires_at`;
    with `rated`, the rate key and limit; with `traced`, the trace context."""
    return ENQUEUE_MANY.format(
        **_literals(defaults),
        **(_UNIQUE_PARTS if unique else _PLAIN_PARTS),
        **(_KEYED_PARTS if keyed else _UNKEYED_PARTS),
        **(_EXPIRING_PARTS if expiring else _LASTING_PARTS),
        **(_RATED_PARTS if rated else _UNRATED_PARTS),
        **(_TRACED_PARTS if traced else _UNTRACED_PARTS),
    )


# One job, no unique or concurrency key and no rate limit (the common `enqueue()`): a
# plain INSERT ... VALUES. Measured against ENQUEUE_MANY with one row, on PostgreSQL 15:
# 120 us of client CPU and 330 us of round trip against 155 and 550 (no JSON arrays to
# unnest, no ORDER BY, no aggregate). The same defaults and parts as ENQUEUE_MANY.
ENQUEUE_ONE = """
INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
    lease, attempts, max_attempts, expirations, releases, last_error, errors,
    created_at{exp_column}{trace_column})
VALUES (%(task)s, %(args)s::jsonb, %(kwargs)s::jsonb, %(queue)s, %(priority)s, {state},
    COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    %(lease)s::interval, {attempts}, %(max_attempts)s, {expirations}, {releases},
    {last_error}, {errors}::jsonb, statement_timestamp(){exp_value}{trace_value})
RETURNING id, run_at, created_at
"""


@functools.lru_cache(maxsize=8)
def enqueue_one_statement(
    defaults: tuple[tuple[str, object], ...], expiring: bool = False, traced: bool = False
) -> str:
    """ENQUEUE_ONE with the defaults quoted in (as `enqueue_many_statement`); with
    `expiring`, `expires_at`; with `traced`, the trace context."""
    return ENQUEUE_ONE.format(
        **_literals(defaults),
        **(_EXPIRING_PARTS if expiring else _LASTING_PARTS),
        **(_TRACED_PARTS if traced else _UNTRACED_PARTS),
    )


# Unique jobs, on a conflict: the unfinished jobs that hold these keys (the ones the
# INSERT above did not write). Raw, beside the INSERT it completes.
UNFINISHED_WITH_KEYS = """
SELECT unique_key, id, state FROM skipqueue_job
WHERE task = %s AND unique_key = ANY(%s::text[]) AND unique_key IS NOT NULL
  AND state = ANY(%s::text[])
"""

# Unique jobs, on_conflict="replace": the pending job holding each key takes the new
# call's arguments and run time. Only pending rows are written (and so locked): a running
# job is left alone, and the claim, which skips locked rows, never waits on this.
REPLACE_PENDING = """
UPDATE skipqueue_job AS job
SET args = v.a, kwargs = v.k,
    run_at = COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    expires_at = {expires_at}
FROM ROWS FROM (jsonb_array_elements(%(args)s::jsonb), jsonb_array_elements(%(kwargs)s::jsonb),
    jsonb_array_elements_text(%(keys)s::jsonb)) AS v(a, k, u)
WHERE job.task = %(task)s AND job.unique_key = v.u AND job.state = 'pending'
RETURNING job.unique_key, job.id
""".format(expires_at=EXPIRES_AT)  # noqa: UP032  (an f-string would hide the SQL's layout)


# The volume guard of MAX_PENDING_PER_QUEUE: an index scan of at most `cap` entries of
# the claim index, never a count of the whole queue. Raw for the LIMIT inside count().
COUNT_PENDING_UP_TO = """
SELECT count(*) FROM (
    SELECT 1 FROM skipqueue_job WHERE state = 'pending' AND queue_name = %s LIMIT %s
) AS capped
"""


#: Relayed queues with RESULTS: the consumer's outcomes, one statement per batch. Only
#: rows the relay marked `relayed` change (a row an operator touched meanwhile stays).
WRITE_BACK = """
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
"""


# Workflows (queue/workflows.py). Ids from the job table's own sequence, so that the
# jobs of a workflow can name each other (dependents, inputs) in the INSERT that writes
# them. Raw: the ORM cannot call nextval.
RESERVE_JOB_IDS = """
SELECT nextval(pg_get_serial_sequence('skipqueue_job', 'id')) FROM generate_series(1, %s)
"""

# A workflow's jobs: one INSERT of a JSON array of records (one parameter, however many
# jobs). A unique key held by an unfinished job inserts nothing for that row (ON
# CONFLICT on the partial unique index): the caller compares the ids that come back and
# refuses the whole workflow. The statement-level NOTIFY trigger wakes the workers of the
# jobs that are due at once.
WORKFLOW_INSERT = """
INSERT INTO skipqueue_job (id, task, args, kwargs, queue_name, priority, state, run_at,
    lease, attempts, max_attempts, expirations, releases, last_error, errors, created_at,
    unique_key, concurrency_key, concurrency_limit, workflow_id, waiting_on, dependents,
    inputs, ends_workflow, expires_at, rate_key, rate_limit)
SELECT r.id, r.task, r.args, r.kwargs, r.queue_name, r.priority, r.state,
    COALESCE(r.run_at, statement_timestamp() + make_interval(secs => r.delay)),
    make_interval(secs => r.lease), {attempts}, r.max_attempts, {expirations}, {releases},
    {last_error}, {errors}::jsonb, statement_timestamp(), r.unique_key, r.concurrency_key,
    r.concurrency_limit, %(workflow)s, r.waiting_on, r.dependents, r.inputs, r.ends_workflow,
    COALESCE(r.expires_at, statement_timestamp() + make_interval(secs => r.expires_in)),
    r.rate_key, r.rate_limit
FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(id bigint, task text, args jsonb,
    kwargs jsonb, queue_name text, priority smallint, state text, run_at timestamptz,
    delay double precision, lease double precision, max_attempts integer,
    unique_key text, concurrency_key text, concurrency_limit smallint, waiting_on integer,
    dependents jsonb, inputs jsonb, ends_workflow boolean, expires_at timestamptz,
    expires_in double precision, rate_key text, rate_limit text)
ORDER BY r.id
ON CONFLICT (task, unique_key) WHERE unique_key IS NOT NULL AND state IN ({unfinished})
DO NOTHING
RETURNING id
"""


@functools.lru_cache(maxsize=4)
def workflow_insert_statement(defaults: tuple[tuple[str, object], ...]) -> str:
    """WORKFLOW_INSERT with ENQUEUE_DEFAULTS (column, value) quoted in as literals."""
    return WORKFLOW_INSERT.format(**_literals(defaults), unfinished=UNFINISHED)


# A workflow's members of one spec without keys (a group's fan-out): written as
# ENQUEUE_MANY writes jobs, one JSON array per payload column and the shared columns
# once, measured three times faster than the record-per-job WORKFLOW_INSERT. nextval
# runs in ORDER BY n order, so the ids come back increasing with the members' order.
WORKFLOW_COLUMNS = """
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
"""


@functools.lru_cache(maxsize=4)
def workflow_columns_statement(defaults: tuple[tuple[str, object], ...]) -> str:
    """WORKFLOW_COLUMNS with ENQUEUE_DEFAULTS (column, value) quoted in as literals."""
    return WORKFLOW_COLUMNS.format(**_literals(defaults), expires_at=EXPIRES_AT)


# The metrics' queue gauges (JobManager.queue_gauges): unfinished jobs only, one
# SELECT per state, so that each matches the predicate of its partial index (the claim
# index, the lease index) whatever the finished rows number. One `state IN (...)` read
# matched neither: 0.78 s, a sequential scan, with 10 million done rows
# (benchmarks/observability.py). The age is clamped as the models' timestamps are
# ('-infinity' written by another client would fail the subtraction); 0 when no job is
# due (GREATEST ignores a NULL: the clamp alone would give 2,000 years). The statement's
# time, as the ORM's Now(): inside a transaction, now() is its start.
QUEUE_GAUGES = """
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
"""

WAITING_BY_QUEUE = """
SELECT queue_name, count(*) FROM skipqueue_job WHERE state = 'waiting' GROUP BY queue_name
"""

# QueueMinuteManager.add: each queue's counts added to its row of the current minute
# (database clock). pickup_buckets add up element by element (a row written with fewer
# buckets, by an older worker, counts 0 for the others); oldest_due_seconds keeps the
# largest (GREATEST ignores NULL).
ADD_MINUTE = """
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
"""

# Whether this minute's oldest-due ages are in (QueueMinuteManager.sampled_this_minute).
MINUTE_SAMPLED = """
SELECT EXISTS (SELECT 1 FROM skipqueue_queueminute
    WHERE minute = date_trunc('minute', now()) AND oldest_due_seconds IS NOT NULL)
"""
