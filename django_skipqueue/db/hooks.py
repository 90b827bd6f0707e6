"""The floor's hooks into Django's connections and cursors (not public API), each naming
what it relies on, so that a Django or psycopg upgrade that changes it fails
`tests/db/test_compat.py` first, not a worker in production.

The `db` package is the floor under `queue/`, and only `queue/` imports it (an
import-linter contract in pyproject.toml): what reaches a Django or psycopg private
name to talk to the database lives here. `direct.py` is the one statement sent straight
on libpq (the enqueue's INSERT); this module is the rest: a thread's connections, the
health check and atomic blocks a task may leave, the kept cursor of a worker's job
reads and its timestamp loader, rows built without Django's per-row signals.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import operator
import os
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import django
from django.db import connections, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.postgresql.base import DatabaseWrapper as PostgresWrapper
from django.db.models.base import ModelState
from django.dispatch import Signal
from psycopg.types.datetime import TimestamptzLoader

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=models.Model)
T = TypeVar("T")


def instance_from_row(model: type[M], alias: str, row: dict[str, Any]) -> M:
    """A model instance loaded from the database, as `Model.from_db` makes it, without
    `Model.__init__`: its attributes set from `row` (every concrete attname) and a
    `ModelState` saying it was loaded from `alias`. Only for models without
    pre_init/post_init receivers (they would be skipped)."""
    instance = model.__new__(model)
    state = ModelState()
    state.adding, state.db = False, alias
    instance.__dict__.update(row, _state=state)
    return instance


def quote_parameters(connection: BaseDatabaseWrapper, statement: str, params: Any) -> str:
    """`statement` with `params` quoted in: the text psycopg's client-side binding sends
    for them (Django's PostgreSQL `DatabaseOperations.compose_sql`; PostgreSQL only)."""
    return str(connection.ops.compose_sql(statement, params))  # type: ignore[attr-defined]


def _thread_storage() -> Any:
    """This thread's own store of Django's connections (a threading.local), or None where
    it cannot be read directly: inside a running event loop (asgiref then keeps them in
    a context variable), with an asgiref or Django laid out otherwise, or where the
    handler's lookups are not Django's own (a subclass or a patch of `__getitem__` or
    `all` that routes or counts them: it must see every lookup)."""
    cls = type(connections)
    if (
        not _HANDLER_OWN
        or cls.__getitem__ is not _HANDLER_GETITEM
        or cls.all is not _HANDLER_ALL
        or "all" in vars(connections)
    ):
        return None
    local = getattr(connections, "_connections", None)  # asgiref's Local (not in the stubs)
    storage = getattr(local, "_storage", None)
    if type(storage) is not threading.local or asyncio._get_running_loop() is not None:
        return None
    return storage


def initialized_connections() -> Sequence[BaseDatabaseWrapper]:
    """`connections.all(initialized_only=True)`: the connections this thread has made.

    A worker asks for them two or three times a job (refresh_connections,
    end_open_transactions). Through Django's handler each lookup goes through asgiref's
    Local, which asks asyncio for a running loop and catches the RuntimeError: 6.4 us a
    call with one alias, against 0.5 us reading the thread's store (measured, Python
    3.11), about 8 % of a worker's CPU at concurrency 4 (py-spy). Outside a running
    event loop asgiref keeps them in a plain threading.local, read here; anywhere else,
    Django's own call.
    """
    storage = _thread_storage()
    if storage is None:
        return connections.all(initialized_only=True)
    return [c for c in vars(storage).values() if isinstance(c, BaseDatabaseWrapper)]


def thread_connection(alias: str) -> BaseDatabaseWrapper:
    """`connections[alias]`, read from the thread's store where it is there (2.6 us
    through the handler; see `initialized_connections`)."""
    storage = _thread_storage()
    found = None if storage is None else vars(storage).get(alias)
    return found if isinstance(found, BaseDatabaseWrapper) else connections[alias]


def check_health_before_next_use(connection: BaseDatabaseWrapper) -> None:
    """Make CONN_HEALTH_CHECKS ping this connection before its next query (Django's
    `health_check_done` flag, set once per request in a web process)."""
    connection.health_check_done = False  # type: ignore[attr-defined]  # not in django-stubs


def mark_healthy(connection: BaseDatabaseWrapper) -> None:
    """A connection that had errors answered a ping: clear Django's error flag and its
    pending health check, as `close_if_unusable_or_obsolete` would."""
    connection.errors_occurred = False
    connection.health_check_done = True  # type: ignore[attr-defined]


def drop_atomic_blocks(connection: BaseDatabaseWrapper, depth: int) -> None:
    """Forget the atomic() blocks above `depth` that a task entered and never exited.

    The connection must be closed first (the server rolls the transaction back); this
    resets Django's bookkeeping (`atomic_blocks`, `savepoint_ids`, `in_atomic_block`,
    `needs_rollback`, `closed_in_transaction`) to what it was at `depth`, so that the
    next query runs in autocommit, or in the caller's own block.
    """
    del connection.atomic_blocks[depth:]
    connection.savepoint_ids = connection.savepoint_ids[: max(depth - 1, 0)]
    connection.in_atomic_block = depth > 0
    connection.needs_rollback = False
    connection.closed_in_transaction = False
    if depth == 0:  # out of every block now: let Django forget the closed connection
        connection.close()


def atomic_depth(connection: BaseDatabaseWrapper) -> int:
    """How many atomic() blocks `connection` is in (Django's `atomic_blocks` list)."""
    return len(connection.atomic_blocks)


def add_execute_wrapper(connection: BaseDatabaseWrapper, wrapper: Callable[..., Any]) -> None:
    """Put `wrapper` around every statement of `connection` until `remove_execute_wrapper`:
    the list Django's public `connection.execute_wrapper()` context manager fills, used
    directly because that manager pops the last wrapper, which a task that installed one
    of its own and never removed it would make someone else's."""
    connection.execute_wrappers.append(wrapper)


def remove_execute_wrapper(connection: BaseDatabaseWrapper, wrapper: Callable[..., Any]) -> None:
    """Take `wrapper` off `connection` (nothing if the task replaced the list)."""
    try:
        connection.execute_wrappers.remove(wrapper)
    except ValueError:
        pass


def compiled_sql(queryset: Any, alias: str) -> tuple[str, tuple[Any, ...]]:
    """The SQL and parameters of `queryset` on `alias`, as its compiler writes them
    (`Query.get_compiler(...).as_sql()`), for a statement that runs the queryset's SQL
    inside a larger one (a claim's locking subquery)."""
    text, params = queryset.query.get_compiler(alias).as_sql()
    return text, tuple(params)


def raw_delete(queryset: Any, alias: str) -> int:
    """DELETE the rows of `queryset` in one statement, without the ORM's collection of
    related rows and its signals (`QuerySet._raw_delete`): rows no other model points
    to, as the relay's published jobs."""
    return int(queryset._raw_delete(alias))


def raw_result(cursor: Any) -> Any:
    """The psycopg result behind a Django cursor (`pgresult`: the values as the server
    sent them, before any loading), for a row that Python cannot load."""
    return getattr(cursor, "cursor", cursor).pgresult


def result_column_names(cursor: Any) -> list[str]:
    """The column names of a Django cursor's result, read from psycopg's result: its
    `description` builds a Python object per column on every call (39 us for a job
    row's 40 columns, against 4 us here)."""
    result = raw_result(cursor)
    return [result.fname(i).decode() for i in range(result.nfields)]


# The DatabaseWrapper methods a cursor of Django's goes through: where a backend's class
# or the connection object itself replaces one (django-tenants' `_cursor` setting the
# search_path, django-debug-toolbar's `cursor`, a metrics backend's `create_cursor`, a
# test's or an APM's patch of the class), every statement keeps going through it, and
# no cursor is kept. Django's own functions, as this module found them at import.
_CURSOR_PATH = {
    name: getattr(PostgresWrapper, name)
    for name in (
        "cursor",
        "_cursor",
        "create_cursor",
        "_prepare_cursor",
        "make_cursor",
        "make_debug_cursor",
        "close_if_health_check_failed",
    )
}
_cursor_path_of = operator.attrgetter(*_CURSOR_PATH)
_CURSOR_PATH_FUNCTIONS = tuple(_CURSOR_PATH.values())


def written_in(function: object, package: types.ModuleType) -> bool:
    """Whether `function` is a plain function whose code is in `package`'s own files.
    A patch made with functools.wraps keeps the name and `__module__` of what it wraps,
    not its code; wrapt's wrapper is no function at all (and compares equal to what it
    wraps: compare functions with `is`, never `==`)."""
    if type(function) is not types.FunctionType:
        return False
    root = os.path.dirname(package.__file__ or "") + os.sep
    return function.__code__.co_filename.startswith(root)


# The connection handler's own lookups, as Django defines them (a patch made before this
# import is found by `_written_in`).
_HANDLER_GETITEM = type(connections).__getitem__
_HANDLER_ALL = type(connections).all
_HANDLER_OWN = written_in(_HANDLER_GETITEM, django) and written_in(_HANDLER_ALL, django)


_DJANGOS_OWN = all(  # not already patched before this import
    written_in(function, django) for function in _CURSOR_PATH_FUNCTIONS
)


def same_functions(found: tuple[object, ...], kept: tuple[object, ...]) -> bool:
    return len(found) == len(kept) and all(map(operator.is_, found, kept))


def plain_cursor_path(connection: BaseDatabaseWrapper) -> bool:
    """Whether `connection` makes its cursors exactly as Django's PostgreSQL backend does:
    no step of `_CURSOR_PATH` replaced, on its class (now) or on the object."""
    return (
        _DJANGOS_OWN
        and connection.__dict__.keys().isdisjoint(_CURSOR_PATH)
        and same_functions(_cursor_path_of_or_none(type(connection)), _CURSOR_PATH_FUNCTIONS)
    )


def _cursor_path_of_or_none(cls: type) -> tuple[object, ...]:
    """The class's `_CURSOR_PATH` functions; () for a class without one of them (a proxy
    of a DatabaseWrapper that defines only some)."""
    try:
        return _cursor_path_of(cls)
    except AttributeError:
        return ()


class _Kept:
    __slots__ = ("busy", "connection", "cursor", "session_zone", "timezone")

    def __init__(self, connection: Any, cursor: Any, timezone: Any, session_zone: Any) -> None:
        self.connection, self.cursor = connection, cursor
        self.timezone, self.session_zone = timezone, session_zone
        # Held from execute to fetch. A lock, not a flag: a connection shared between
        # threads (inc_thread_sharing) must not hand the cursor to two at once.
        self.busy = threading.Lock()


class kept_cursor:  # noqa: N801  (used as a function: `with kept_cursor(...) as cursor`)
    """A Django cursor of `connection` around one psycopg cursor kept for this connection,
    not a new one per statement: for the statements of enqueue, claim and ack, whose
    results are read inside the `with` block.

    Measured: `connection.cursor()` and its close cost 13-15 us, and a new psycopg
    cursor starts with empty adapter caches; an enqueue took 390,000 instructions of
    client CPU with a new cursor and 294,000 with the kept one and the checks below
    (`python benchmarks/run.py --parts enqueue` under callgrind).

    What Django does per cursor is kept. The wrapper is made per block
    (`make_debug_cursor` while queries are logged, so `assertNumQueries` and DEBUG see
    every statement; execute wrappers and a class-level patch of CursorWrapper.execute
    run). The psycopg cursor is made again, through `connection.cursor()` (connect,
    CONN_HEALTH_CHECKS ping, time-zone loader, Django's errors), whenever the connection
    is new or closed, a health check is due, or the connection's time zone or the
    session's TimeZone changed; `prepare(psycopg_cursor, connection)` runs once on each.
    A fresh cursor of Django's, closed at the block's end, is used instead when the
    connection makes its cursors its own way (`plain_cursor_path`) and when the kept one
    is in use: a statement of ours run from inside another's execute and fetch (an
    execute wrapper that enqueues) would otherwise take the outer statement's result.

    Relied on: the DatabaseWrapper's `ensure_connection` and `validate_thread_sharing`
    (called each time, as Django's cursor path does), `connection` (the psycopg
    connection, a new object after a reconnect), `health_check_enabled` and
    `health_check_done`, `timezone`, `queries_logged`, `make_cursor` and
    `make_debug_cursor`, the Django cursor's `cursor` attribute, psycopg's `closed` and
    `pgconn`. The async check is the caller's.
    """

    __slots__ = ("_connection", "_fresh", "_kept", "_prepare")

    def __init__(
        self, connection: BaseDatabaseWrapper, prepare: Callable[[Any, BaseDatabaseWrapper], None]
    ) -> None:
        self._connection, self._prepare = connection, prepare
        self._fresh: Any = None
        self._kept: _Kept | None = None

    def __enter__(self) -> Any:
        connection: Any = self._connection
        if not plain_cursor_path(connection):
            return self._fresh_cursor()
        kept: _Kept | None = connection.__dict__.get("_skipqueue_kept_cursor")
        connection.ensure_connection()  # as connection.cursor() does (pytest-django's
        connection.validate_thread_sharing()  # database blocker replaces the first)
        raw_connection = connection.connection
        if (
            kept is None
            or kept.connection is not raw_connection
            or raw_connection.closed
            or kept.cursor.closed
            or kept.timezone is not connection.timezone
            or (connection.health_check_enabled and not connection.health_check_done)
            or kept.session_zone != raw_connection.pgconn.parameter_status(b"TimeZone")
        ):
            raw = connection.cursor().cursor  # Django's path, its checks, loaders and errors
            raw_connection = connection.connection
            self._prepare(raw, connection)
            kept = _Kept(
                raw_connection,
                raw,
                connection.timezone,
                raw_connection.pgconn.parameter_status(b"TimeZone"),
            )
            connection.__dict__["_skipqueue_kept_cursor"] = kept
        if not kept.busy.acquire(blocking=False):  # in use: ours from inside ours, or a thread's
            return self._fresh_cursor()
        self._kept = kept
        if connection.queries_logged:
            return connection.make_debug_cursor(kept.cursor)
        return connection.make_cursor(kept.cursor)

    def _fresh_cursor(self) -> Any:
        """A cursor of Django's for this block alone, closed at its end."""
        self._fresh = self._connection.cursor()
        self._prepare(self._fresh, self._connection)
        return self._fresh

    def __exit__(self, *exc: object) -> None:
        if self._kept is not None:
            self._kept.busy.release()
        elif self._fresh is not None:
            self._fresh.__exit__(*exc)  # Django's close


def has_receivers(signal: Signal, sender: object) -> bool:
    """`signal.has_listeners(sender)`, answered at once when the signal has no receiver
    at all, the common case for pre_init and post_init: has_listeners looks the sender
    up in a weak cache on each call (about 1.5 us; an enqueue asked four of them).
    Relied on: `Signal.receivers`, the list `connect()` appends to."""
    return bool(signal.receivers) and signal.has_listeners(sender)


def fetch_one(cursor: Any) -> Any:
    """`cursor.fetchone()` of a Django cursor, its errors turned into Django's as there,
    without the wrapper's `__getattr__`, which builds a `functools.wraps` function on
    every call (measured: a fifth of an enqueue's fetch). Relied on: the Django cursor's
    `cursor` and `db`, and the DatabaseWrapper's `wrap_database_errors` context; a
    cursor without them (another library's wrapper) is asked as usual."""
    db = getattr(cursor, "db", None)
    if db is None or not hasattr(cursor, "cursor"):
        return cursor.fetchone()
    with db.wrap_database_errors:
        return cursor.cursor.fetchone()


def fetch_all(cursor: Any) -> list[Any]:
    """`cursor.fetchall()` of a Django cursor, as `fetch_one`."""
    db = getattr(cursor, "db", None)
    if db is None or not hasattr(cursor, "cursor"):
        return cursor.fetchall()
    with db.wrap_database_errors:
        return cursor.cursor.fetchall()


def load_timestamps_natively(cursor: Any, connection: BaseDatabaseWrapper) -> None:
    """Let this Django cursor load `timestamptz` columns with psycopg's own loader, before
    its statement runs, where that gives the very values Django's loader gives.

    Django's psycopg 3 backend registers a subclass of psycopg's Python loader on every
    connection (`psycopg_any.register_tzloader`), which replaces the tzinfo of psycopg's
    result with the connection's time zone. A subclass in Python is never swapped for
    psycopg's C implementation (psycopg[binary] or psycopg[c]): measured, a row of five
    timestamps took 27 us to fetch through Django's loader and 6 us through the C one,
    and the five of a claimed job row were a fifth of a worker's CPU per job. With
    USE_TZ and a connection in UTC (Django's default), psycopg's own result already
    carries `datetime.timezone.utc`, exactly Django's: only then is the native loader
    used, on this cursor alone. Relied on: the Django cursor's `cursor` attribute (the
    psycopg cursor), its `adapters` (a per-cursor copy of the connection's), and
    `connection.timezone`.
    """
    if connection.timezone is not datetime.timezone.utc:
        return
    raw: Any = getattr(cursor, "cursor", cursor)  # a Django cursor or a psycopg one
    adapters = getattr(raw, "adapters", None)
    if adapters is None or raw.connection.info.parameter_status("TimeZone") != "UTC":
        return  # psycopg2, or a server session in another zone: Django's loader
    adapters.register_loader("timestamptz", TimestamptzLoader)  # the C one, if built
