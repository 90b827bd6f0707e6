"""The few raw statements the ORM cannot say, one function each, with the reason.

Parameters are always passed separately; identifiers go through psycopg.sql.Identifier.
Nothing here is session-scoped, so it all works behind PgBouncer in transaction mode,
except LISTEN, which the worker runs only on its own direct connection.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

from psycopg import sql

from django_skipqueue.conf import MAX_LEASE, MIN_LEASE
from django_skipqueue.states import validate_queue_name

#: The advisory lock that lets one housekeeper at a time reap and prune. A constant
#: from the bytes "skipqueue" so it does not collide with the project's own locks.
REAPER_LOCK_KEY = int.from_bytes(b"skipqueu", "big") >> 1

CHANNEL_PREFIX = "skipqueue_"
#: The payload of the NOTIFY a worker sends itself to check that LISTEN works.
SELF_TEST_PAYLOAD = "skipqueue:listen-self-test"


def channel_name(queue_name: str) -> str:
    """The LISTEN/NOTIFY channel of a queue (at most 58 bytes, under PostgreSQL's 63)."""
    return CHANNEL_PREFIX + validate_queue_name(queue_name)


def try_advisory_xact_lock(cursor: Any, key: int = REAPER_LOCK_KEY) -> bool:
    """Take a transaction-level advisory lock if free; released at commit or rollback.

    The ORM has no advisory locks. Transaction-level (never session-level) so that a
    transaction pooler cannot leave it held on a server connection.
    """
    cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [key])
    return bool(cursor.fetchone()[0])


def listen(connection: Any, queue_names: list[str]) -> None:
    """LISTEN on each queue's channel, on a raw psycopg connection in autocommit.

    The ORM cannot LISTEN, and a channel is an identifier, not a parameter: it is
    validated, then quoted by psycopg.
    """
    for queue_name in queue_names:
        connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(queue_name))))


def seconds_until_next_due(cursor: Any, queue_names: list[str]) -> float | None:
    """Seconds from the database's now until the earliest pending job of these queues.

    Computed on the database clock (the ORM would hand back a datetime to compare
    with the process clock). None when nothing is pending.
    """
    cursor.execute(
        "SELECT EXTRACT(EPOCH FROM min(run_at) - now()) FROM skipqueue_job "
        "WHERE state = 'pending' AND queue_name = ANY(%s)",
        [queue_names],
    )
    value = cursor.fetchone()[0]
    return None if value is None else float(value)


# The claim: one statement, one round trip, no ORM compilation (measured: the ORM form
# took about 10 ms per claim, mostly compiling three queries; see benchmarks/). The
# MATERIALIZED CTE keeps the planner from running the locking subquery more than once,
# which could claim more rows than LIMIT (Oban commit 3990921; docs/explanation/protocol.md).
#
# Whatever state a row was put in by hand or by another writer, this write keeps the
# table's constraints: a job set back to pending with no attempt left gets one more
# (`attempts <= max_attempts`), and its lease is clamped to the bounds a task may ask
# for (a lease of `timedelta.max` would overflow the timestamp). It names the columns it
# returns: a column added by a later migration must not reach an older worker.
_CLAIM = """
WITH claimable AS MATERIALIZED (
    SELECT id FROM skipqueue_job
    WHERE state = 'pending' AND run_at <= statement_timestamp() AND {queue_filter}
    ORDER BY priority DESC, run_at, id
    LIMIT %(limit)s
    FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE skipqueue_job AS job
SET state = 'running',
    attempts = job.attempts + 1,
    max_attempts = GREATEST(job.max_attempts, job.attempts + 1),
    worker_id = %(worker)s,
    started_at = statement_timestamp(),
    leased_until = statement_timestamp() + {lease}
FROM claimable
WHERE job.id = claimable.id
RETURNING {columns}
"""

#: A lease within the bounds (conf.MIN_LEASE, conf.MAX_LEASE), from `%(lease)s` or the row.
_CLAMPED_LEASE = "LEAST(GREATEST(COALESCE(%(lease)s, job.lease), %(min_lease)s), %(max_lease)s)"
#: The row's own lease, clamped: the worker schedules its renewals by it.
_CLAMPED_ROW_LEASE = "LEAST(GREATEST(job.lease, %(min_lease)s), %(max_lease)s)"


#: The claim's filters: one queue (plain equality, so the claim index yields rows already
#: in claim order), several, or one given row (`%(only)s`, the row-by-row fallback).
ONE_QUEUE = "queue_name = %(queues)s"
QUEUES = "queue_name = ANY(%(queues)s)"
ONE_ROW = "queue_name = ANY(%(queues)s) AND id = %(only)s"


@functools.cache
def claim_statement(queue_filter: str, columns: tuple[str, ...]) -> str:
    """The claim with `queue_filter` (above), returning `columns` of each claimed row."""
    returning = ", ".join(
        f'job."{column}"' if column != "lease" else f"{_CLAMPED_ROW_LEASE} AS lease"
        for column in columns
    )
    return _CLAIM.format(queue_filter=queue_filter, lease=_CLAMPED_LEASE, columns=returning)


def lease_bounds() -> dict[str, timedelta]:
    """The parameters `min_lease` and `max_lease` of the claim."""
    return {"min_lease": MIN_LEASE, "max_lease": MAX_LEASE}


# The fenced ack, raw for the same measured reason as the claim: one statement for one
# job or many, one row per (id, attempt, result), each with its own fence. The worker
# acknowledges every job that finished while its previous batch committed.
ACK_MANY = """
UPDATE skipqueue_job AS job
SET state = 'done', result = v.result::jsonb, finished_at = statement_timestamp(),
    leased_until = NULL
FROM unnest(%s::bigint[], %s::integer[], %s::text[]) AS v(id, attempt, result)
WHERE job.id = v.id AND job.state = 'running' AND job.attempts = v.attempt
  AND job.leased_until > statement_timestamp()
RETURNING job.id
"""

# Bulk enqueue: one INSERT per batch with one array parameter per column (measured: the
# ORM's bulk_create compiled 20 fields x 20,000 rows into 400,000 parameters, about 40x
# slower). The statement-level NOTIFY trigger fires once per statement. One row comes
# back: the ids in insertion order (nextval is called row by row in ORDER BY n, so the
# ids increase with n) and the run_at and created_at that every row of it shares.
ENQUEUE_MANY = """
WITH inserted AS (
    INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
        lease, attempts, max_attempts, expirations, releases, last_error, errors, created_at)
    SELECT %(task)s, a::jsonb, k::jsonb, %(queue)s, %(priority)s, 'pending',
        COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
        %(lease)s::interval, 0, %(max_attempts)s, 0, 0, '', '[]', statement_timestamp()
    FROM unnest(%(args)s::text[], %(kwargs)s::text[]) WITH ORDINALITY AS v(a, k, n)
    ORDER BY n
    RETURNING id
)
SELECT array_agg(id ORDER BY id),
    COALESCE(%(run_at)s::timestamptz, statement_timestamp() + %(delay)s::interval),
    statement_timestamp()
FROM inserted
"""

# The volume guard of MAX_PENDING_PER_QUEUE: an index scan of at most `cap` entries of
# the claim index, never a count of the whole queue. Raw for the LIMIT inside count().
COUNT_PENDING_UP_TO = """
SELECT count(*) FROM (
    SELECT 1 FROM skipqueue_job WHERE state = 'pending' AND queue_name = %s LIMIT %s
) AS capped
"""
