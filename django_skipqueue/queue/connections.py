"""Each thread's database connections in a long-running process: health and backoff.

Django manages connections around requests; a worker has none, so its threads check,
recycle and discard their own connections here, and wait with jittered backoff before
they reconnect after a passing error.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_skipqueue.conf import get_settings
from django_skipqueue.db.hooks import (
    add_execute_wrapper,
    atomic_depth,
    check_health_before_next_use,
    drop_atomic_blocks,
    initialized_connections,
    mark_healthy,
    remove_execute_wrapper,
    thread_connection,
)
from django_skipqueue.faults import is_transient

__all__ = [
    "HEALTH_CHECK_SECONDS",
    "Backoff",
    "bounded",
    "discard",
    "discard_connection",
    "lock_wait_within",
    "refresh_connections",
    "retry_transient",
    # From the floor, for the runtime layer, which may not import `db/` itself: a
    # thread's connections, the atomic blocks a task left open on one, and the execute
    # wrapper that watches a task's statements.
    "add_execute_wrapper",
    "atomic_depth",
    "drop_atomic_blocks",
    "initialized_connections",
    "remove_execute_wrapper",
    "thread_connection",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: CONN_HEALTH_CHECKS: the least time between two pings of one thread's connection.
HEALTH_CHECK_SECONDS = 1.0


def refresh_connections() -> None:
    """Before and after each job: drop this thread's broken or expired connections.

    Django's close_old_connections() closes every connection when CONN_MAX_AGE is 0,
    which in a worker means a new connection for every job. Here CONN_MAX_AGE = 0 keeps
    a connection for the thread's life; a positive CONN_MAX_AGE still recycles it, and
    broken connections and ones left out of autocommit behave as in a request.
    CONN_HEALTH_CHECKS pings before a job's first query at most once a second per
    connection (measured: a ping per job cost a round trip per job at full speed); a
    connection that broke in a job is checked or closed after it in any case.
    """
    for connection in initialized_connections():
        if connection.connection is None:
            continue
        if connection.settings_dict["CONN_MAX_AGE"] != 0:
            connection.close_if_unusable_or_obsolete()
            continue
        now = time.monotonic()
        if now - getattr(connection, "skipqueue_checked_at", 0.0) >= HEALTH_CHECK_SECONDS:
            # Django's own flag (not in django-stubs): CONN_HEALTH_CHECKS pings before next use.
            check_health_before_next_use(connection)
            connection.skipqueue_checked_at = now  # type: ignore[attr-defined]
        # The connection is open: `autocommit` is what get_autocommit() would return
        # (its ensure_connection() would do nothing here but cost 1.5 us a job).
        if connection.autocommit != connection.settings_dict["AUTOCOMMIT"]:
            connection.close()
        elif connection.errors_occurred:
            if connection.is_usable():
                mark_healthy(connection)
            else:
                connection.close()


#: How long a side write of the worker's housekeeping (the heartbeat, the meter's flush,
#: the reap and its sample of the oldest due jobs, the prune of dead workers and old
#: minutes) waits for a lock. They share the housekeeper's thread with the lease renewals, which
#: a table locked for seconds (an operator's LOCK TABLE, a migration) must not hold up:
#: such a write is skipped and tried again later (tests/runtime/test_worker.py,
#: `test_a_side_table_locked_for_seconds_holds_up_no_lease_renewal`). Waiting, 1 s leases were lost
#: behind an EXCLUSIVE lock held 4-7 s on skipqueue_workerprocess or
#: skipqueue_queueminute, and with ACCESS EXCLUSIVE, the reap's NOTIFY trigger (a read
#: of the worker table) and its sample (a read of the minute table) (tests/runtime/test_worker.py).
SIDE_WRITE_LOCK_SECONDS = 0.2
LOCK_NOT_AVAILABLE = "55P03"

#: The server-side bounds of a transaction of ours that takes locks (`bounded`): both
#: settings last until its end only (is_local), so a transaction pooler's next client
#: never inherits them.
BOUND_TRANSACTION = (
    "SELECT set_config('idle_in_transaction_session_timeout', %s, true), "
    "set_config('lock_timeout', %s, true)"
)


@contextlib.contextmanager
def bounded(alias: str, lock_seconds: float | None = None) -> Iterator[None]:
    """`transaction.atomic(using=alias)` whose locks a frozen process cannot hold for long.

    The rule (docs/explanation/failure-model.md, "A frozen worker"): a worker can be
    stopped anywhere, even inside one of its transactions, and must not stop the others
    for more than a few seconds. So every transaction of ours that takes locks starts by
    setting, for itself only, `idle_in_transaction_session_timeout` (the server ends a
    session left idle inside it, which rolls it back and frees its locks) and
    `lock_timeout` (it gives up a lock it waits for; a passing error, tried again).
    Inside a caller's transaction (a test's, say) it is a savepoint and sets nothing:
    the bounds would last to the end of the caller's transaction. `lock_seconds`
    replaces SKIPQUEUE['LOCK_TIMEOUT_SECONDS'] for writes that must wait less
    (SIDE_WRITE_LOCK_SECONDS).
    """
    connection = connections[alias]
    outermost = not connection.in_atomic_block
    with transaction.atomic(using=alias):
        if outermost:
            settings = get_settings()
            idle = _milliseconds(settings.IDLE_IN_TRANSACTION_SECONDS)
            lock = _milliseconds(
                settings.LOCK_TIMEOUT_SECONDS if lock_seconds is None else lock_seconds
            )
            with connection.cursor() as cursor:
                cursor.execute(BOUND_TRANSACTION, [idle, lock])
        yield


def discard_connection(alias: str) -> None:
    """Drop this thread's connection to `alias` after an error; the next query reconnects."""
    discard(connections[alias])


class Backoff:
    """Exponential delays with jitter for reconnecting: 0.1 s doubling up to `cap`."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self.current = first, cap, first

    def next(self) -> float:
        delay = self.current * random.uniform(0.8, 1.2)
        self.current = min(self.current * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.current = self.first


def retry_transient(
    call: Callable[[], T], *, what: str, alias: str, stopping: threading.Event
) -> T | None:
    """`call()` until it goes through, backing off after each passing error (no server
    yet, a read-only or restarting one); None if `stopping` is set first. Any other
    error is raised."""
    backoff = Backoff()
    while True:
        try:
            return call()
        except DatabaseError as error:
            if not is_transient(error):
                raise
            if stopping.is_set():
                return None
            delay = backoff.next()
            logger.warning("%s failed, retrying in %.2fs: %s", what, delay, error)
            discard_connection(alias)
            stopping.wait(delay)


def discard(connection: BaseDatabaseWrapper) -> None:
    """Close a connection that may be broken, ignoring the error a broken one raises."""
    try:
        connection.close()
    except DatabaseError:
        pass


@contextlib.contextmanager
def lock_wait_within(alias: str, seconds: float) -> Iterator[None]:
    """A savepoint inside one of our transactions whose statements wait at most
    `seconds` for a lock; where one is not had, LOCK_NOT_AVAILABLE rolls back the
    savepoint alone. The setting lasts to the end of the enclosing transaction, so this
    goes last in it."""
    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, true)", [_milliseconds(seconds)])
        yield


def _milliseconds(seconds: float) -> str:
    """A duration setting's value for PostgreSQL, at least 1 ms (0 would mean none)."""
    return f"{max(int(seconds * 1000), 1)}ms"
