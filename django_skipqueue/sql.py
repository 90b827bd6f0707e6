"""The few raw statements the ORM cannot say, one function each, with the reason.

Parameters are always passed separately; identifiers go through psycopg.sql.Identifier.
Nothing here is session-scoped, so it all works behind PgBouncer in transaction mode,
except LISTEN, which the worker runs only on its own direct connection.
"""

from __future__ import annotations

from typing import Any

from psycopg import sql

from django_skipqueue.base import validate_queue_name

#: The advisory lock that lets one housekeeper at a time reap and prune. A constant
#: from the bytes "skipqueue" so it does not collide with the project's own locks.
REAPER_LOCK_KEY = int.from_bytes(b"skipqueu", "big") >> 1

CHANNEL_PREFIX = "skipqueue_"


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
