"""connections.py: the retry of a passing error, and the discard of a broken connection."""

from __future__ import annotations

import threading

import pytest
from django.db import IntegrityError, OperationalError, connection

from django_skipqueue.queue.connections import Backoff, discard, retry_transient


def failing(times: int, error: Exception):
    calls = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "done"

    return call, calls


@pytest.mark.django_db
def test_a_passing_error_is_retried_with_backoff_until_the_call_goes_through(caplog):
    call, calls = failing(2, OperationalError("the server closed the connection"))
    result = retry_transient(call, what="registration", alias="default", stopping=threading.Event())
    assert (result, len(calls)) == ("done", 3)
    assert caplog.text.count("registration failed, retrying in") == 2


def test_any_other_database_error_is_raised_at_once():
    call, calls = failing(1, IntegrityError("duplicate key"))
    with pytest.raises(IntegrityError):
        retry_transient(call, what="registration", alias="default", stopping=threading.Event())
    assert len(calls) == 1


def test_a_stop_ends_the_retries_with_none():
    stopping = threading.Event()
    stopping.set()
    call, calls = failing(5, OperationalError("no server yet"))
    assert retry_transient(call, what="x", alias="default", stopping=stopping) is None
    assert len(calls) == 1


def test_backoff_doubles_with_jitter_up_to_its_cap_and_resets():
    backoff = Backoff(first=0.1, cap=0.4)
    delays = [backoff.next() for _ in range(4)]
    assert 0.08 <= delays[0] <= 0.12 and 0.16 <= delays[1] <= 0.24
    assert 0.32 <= delays[2] <= 0.48 and 0.32 <= delays[3] <= 0.48
    backoff.reset()
    assert backoff.next() <= 0.12


@pytest.mark.django_db(transaction=True)
def test_discarding_a_connection_closes_it_and_the_next_query_reconnects():
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        first = cursor.fetchone()[0]
    discard(connection)
    assert connection.connection is None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone()[0] != first


@pytest.mark.django_db(transaction=True)
def test_a_threads_connections_read_from_its_store_are_the_ones_django_gives():
    """hooks.initialized_connections() and thread_connection() read the thread's store
    directly (the worker's per-job lookups); they must give what Django gives: nothing
    of another thread's, the thread's own once made, and Django's answer inside a
    running event loop (where asgiref keeps connections elsewhere)."""
    import asyncio

    from django.db import connections

    from django_skipqueue.db.hooks import initialized_connections, thread_connection

    connection.ensure_connection()  # the main thread's: never another thread's
    seen: dict[str, object] = {}

    def both() -> tuple[list[object], list[object]]:
        return list(initialized_connections()), list(connections.all(initialized_only=True))

    async def in_a_loop() -> tuple[object, ...]:
        return (*both(), thread_connection("default") is connections["default"])

    def in_a_thread() -> None:
        seen["before"] = both()
        made = thread_connection("default")
        seen["made"] = (made is connections["default"], made is not connection)
        made.ensure_connection()
        seen["after"] = both()
        seen["loop"] = asyncio.run(in_a_loop())
        made.close()

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen["before"] == ([], [])
    assert seen["made"] == (True, True)
    mine, djangos = seen["after"]  # type: ignore[misc]
    assert mine == djangos and len(mine) == 1 and mine[0] is not connection
    assert seen["loop"] == ([], [], True)
