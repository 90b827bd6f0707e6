"""The enqueue's INSERT, sent straight on libpq where nothing could tell, and named on
the session from its second run (not public API).

Kept because it buys single enqueues beyond the run-to-run spread (run_peers.sh, the
peer benchmark, its "single" row; benchmarks/RESULTS.md says how to run it): 1.06x
PgQueuer's single enqueue with it, 0.85x through Django's cursor, 0.84x with psycopg's
own server-side preparation. The claim and the
ack no longer take it: through Django's cursor they drained faster. `direct_row` says
when it is taken (otherwise Django's cursor runs the statement) and what it relies on;
`tests/db/test_compat.py` holds a test for each.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import hashlib
import logging
import operator
import re
import struct
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import django
import psycopg
from django.apps import apps
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.postgresql.base import Cursor as DjangoPsycopgCursor
from django.db.backends.postgresql.base import DatabaseWrapper as PostgresWrapper
from django.db.backends.postgresql.base import ServerBindingCursor
from django.db.backends.utils import CursorWrapper
from psycopg import pq
from psycopg.errors import error_from_result
from psycopg.generators import execute as libpq_execute

from django_skipqueue.conf import get_settings
from django_skipqueue.db.hooks import plain_cursor_path, same_functions, written_in

logger = logging.getLogger(__name__)

# -- one statement straight on libpq (the enqueue's INSERT) ---------------------------

# What Django's cursor runs between `CursorWrapper.execute` and the network, as this
# module found it at import: where any of it is replaced (an APM's patch of Django's
# CursorWrapper or psycopg's Cursor, a traced cursor factory), statements take the cursor.
_WRAPPER_STEPS = {
    name: getattr(CursorWrapper, name) for name in ("execute", "_execute", "_execute_with_wrappers")
}
_wrapper_steps_of = operator.attrgetter(*_WRAPPER_STEPS)
_WRAPPER_STEP_FUNCTIONS = tuple(_WRAPPER_STEPS.values())
_DJANGO_CURSORS = (DjangoPsycopgCursor, ServerBindingCursor)
_PSYCOPG_EXECUTE = psycopg.Cursor.execute
_PSYCOPG_CURSOR = psycopg.Connection.cursor  # what Django's create_cursor calls
# Django's own, as found at import: `direct_row` calls them only where they can do
# something (see `_ready_for_this_thread`), and always where either was replaced before
# this import (an app's `ready()` wrapping it: the code found is not Django's).
_ENSURE_CONNECTION = PostgresWrapper.ensure_connection
_VALIDATE_THREAD_SHARING = PostgresWrapper.validate_thread_sharing
_CONNECTION_CHECKS_OWN = written_in(_ENSURE_CONNECTION, django) and written_in(
    _VALIDATE_THREAD_SHARING, django
)
_STEPS_OWN = all(written_in(step, django) for step in _WRAPPER_STEP_FUNCTIONS) and all(
    written_in(step, psycopg) for step in (_PSYCOPG_EXECUTE, _PSYCOPG_CURSOR)
)
_INTRANS, _IDLE = pq.TransactionStatus.INTRANS, pq.TransactionStatus.IDLE
_ACTIVE = pq.TransactionStatus.ACTIVE
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")


@functools.lru_cache(maxsize=32)
def _positional(statement: str) -> tuple[bytes, tuple[str, ...]]:
    """`statement`'s `%(name)s` placeholders as libpq's `$n` (one number per name), and
    the names in their numbers' order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "%"  # psycopg's escaped percent sign
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PLACEHOLDER.sub(number, statement).encode(), tuple(names)


def text_parameters(params: Mapping[str, Any]) -> dict[str, bytes | None] | None:
    """`params` in the text form `direct_row` sends, encoded ahead (a spec's parameters
    shared by all its enqueues); None if one of them has no such form."""
    try:
        return {name: _text_parameter(value) for name, value in params.items()}
    except TypeError:
        return None


def _text_parameter(value: object) -> bytes | None:
    """`value` as the text a parameter of unknown type carries to PostgreSQL, which reads
    it by the column or cast it meets. Only the types of a job row's own columns, and
    bytes taken as that text already (`text_parameters`); any other value (or a string
    holding NUL, which libpq would cut) raises TypeError."""
    if value is None or type(value) is bytes:
        return value
    if type(value) is str:
        if "\x00" in value:
            raise TypeError("NUL in a text parameter")
        return value.encode()
    if type(value) is int:
        return b"%d" % value
    if type(value) is datetime.timedelta:  # explicit signs: read alike in every IntervalStyle
        return b"%+d day %+d second %+d microsecond" % (
            value.days,
            value.seconds,
            value.microseconds,
        )
    if type(value) is datetime.datetime:
        return value.isoformat().encode()
    raise TypeError(f"no text form for {type(value).__name__}")


_PG_EPOCH = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)


_int8 = struct.Struct(">q").unpack


def binary_bigint(value: bytes) -> int:
    """A `bigint` column of `direct_row`'s binary result (an `integer` or `smallint` one
    too, by its length: a migration may have changed the column's type under a running
    process, and the row is committed by the time it is read)."""
    if len(value) == 8:
        return int(_int8(value)[0])
    return int.from_bytes(value, "big", signed=True)


def binary_timestamptz(value: bytes) -> datetime.datetime:
    """A `timestamptz` column of `direct_row`'s binary result, as Django loads it on a
    connection in UTC: microseconds since 2000-01-01 UTC (finite values only)."""
    return _PG_EPOCH + datetime.timedelta(0, 0, _int8(value)[0])


def direct_row(
    connection: BaseDatabaseWrapper, statement: str, params: Mapping[str, Any]
) -> tuple[Any, ...] | None:
    """The first row of `statement` (named placeholders, `params` of a job row's column
    types) run straight on the connection's libpq, its values in PostgreSQL's binary
    form (`binary_bigint`, `binary_timestamptz`); None, having sent nothing, where this
    connection or statement must go through Django's cursor instead.

    Measured: psycopg's cursor spends about 140,000 instructions of client CPU quoting
    an enqueue's 13 parameters and reading its row (client-side binding, Django's
    default), libpq's round trip 40,000 (`python benchmarks/run.py --parts enqueue`
    under `valgrind --tool=callgrind`).

    Taken only where nothing could tell the difference: no query logging (DEBUG,
    assertNumQueries, the debug toolbar) and no execute wrapper, which must see the
    statement (but the worker's own, marked `skipqueue_passive`, which looks for SET
    only), asked once connected (a connection_created receiver may install either);
    Django's cursor path (`plain_cursor_path`), Django's CursorWrapper and psycopg's
    `Cursor.execute` and `Connection.cursor` as this module found them (the same
    objects, whose code is in Django's and psycopg's own files: a patch made before this
    import counts, and one made with wrapt, which compares equal to what it wraps, too),
    a DatabaseWrapper class that has them all (not a proxy), and a cursor factory of
    Django's own; the app registry ready (Django warns before it is); no health check due (the
    cursor's path runs it); a psycopg 3 connection open, in UTF8, in UTC with USE_TZ,
    not in pipeline mode, and either in autocommit or inside a transaction already begun
    (otherwise psycopg sends the BEGIN first). What Django's `_execute` does is done:
    `validate_no_broken_transaction`, Django's errors from psycopg's (`error_from_result`
    as psycopg raises them); the connection's lock is held as psycopg's cursor holds it,
    and `Connection.wait` cancels the statement on Ctrl-C as it does there. Outside a
    transaction, a statement run again on its session is named and prepared there
    (`_run_named`; not where the settings say a transaction pooler stands between).

    Relied on (tests/db/test_compat.py): psycopg's `pq` (`send_query_params`,
    `send_prepare`, `send_query_prepared`, `send_query`, `finish`, the result's
    `error_field`, `Connection.cancel_safe`, `ConnectionInfo.backend_pid`,
    `transaction_status`, `pipeline_status`, `parameter_status`, the result's
    `get_value`), `psycopg.generators.execute`, `Connection.wait`, `Connection.lock`,
    `errors.error_from_result`; Django's `queries_logged`, `execute_wrappers`,
    `health_check_enabled` and `health_check_done`, `validate_no_broken_transaction`,
    `wrap_database_errors`, `timezone`, and the backend's two cursor classes.
    """
    direct = _direct(connection, statement, params, 1)
    return None if direct is None else _first_row(direct)


def _direct(
    connection: BaseDatabaseWrapper,
    statement: str,
    params: Mapping[str, Any] | None,
    result_format: int,
) -> Any:
    """The last result of `statement` run straight on libpq in `result_format`, its errors
    raised as Django's cursor raises them; None where it must take Django's cursor
    (`direct_row` says when)."""
    if not apps.ready:
        return None
    conn: Any = connection
    if not get_settings().DIRECT_ENQUEUE:
        return _declined(connection, "SKIPQUEUE['DIRECT_ENQUEUE'] is False")
    _ready_for_this_thread(connection)  # first: a connection_created receiver may install
    if connection.queries_logged:
        return _declined(connection, "Django logs its queries (DEBUG, assertNumQueries)")
    if any(not getattr(w, "skipqueue_passive", False) for w in connection.execute_wrappers):
        return _declined(connection, "an execute wrapper is installed")
    if not _direct_steps() or not plain_cursor_path(connection):
        return _declined(connection, "Django's cursor path is replaced or patched")
    if conn.timezone is not datetime.timezone.utc:
        return _declined(connection, "the connection's time zone is not UTC")
    raw = conn.connection
    if (
        type(raw) is not psycopg.Connection
        or raw.closed
        or raw.cursor_factory not in _DJANGO_CURSORS
        or raw.cursor_factory.execute is not _PSYCOPG_EXECUTE
        or psycopg.Connection.cursor is not _PSYCOPG_CURSOR
    ):
        return _declined(connection, "the psycopg connection or its cursor is not the plain one")
    if conn.health_check_enabled and not conn.health_check_done:
        return None  # for this statement only: Django's cursor runs the health check
    pgconn = raw.pgconn
    status = pgconn.transaction_status
    if not (status == _INTRANS or (status == _IDLE and raw.autocommit)):
        return None  # for this statement only: psycopg would send BEGIN first
    if pgconn.pipeline_status or pgconn.parameter_status(b"client_encoding") != b"UTF8":
        return _declined(connection, "pipeline mode, or a client encoding other than UTF8")
    if params is None:
        query, values = statement.encode(), []
    else:
        query, names = _positional(statement)
        try:  # a spec's shared parameters come encoded already (`text_parameters`)
            values = [
                value if type(value) is bytes else _text_parameter(value)
                for value in map(params.__getitem__, names)
            ]
        except TypeError:
            return None
    connection.validate_no_broken_transaction()
    with conn.wrap_database_errors, raw.lock:  # no loop in this block (`_last_result`)
        results = None
        if status == _IDLE and may_prepare(connection):
            results = _run_named(connection.alias, raw, pgconn, query, values, result_format)
        if results is None:
            results = _exchange(
                raw, pgconn.send_query_params, query, values, None, None, result_format
            )
        return _last_result(results, raw)


#: (alias, reason) pairs already logged by `_declined`: each is said once per process.
_DECLINED: set[tuple[str, str]] = set()


def _declined(connection: BaseDatabaseWrapper, reason: str) -> None:
    """Say, once per alias and reason, at DEBUG, why the enqueue goes through Django's
    cursor here (`direct_row` lists the conditions); None, for `_direct` to return."""
    key = (connection.alias, reason)
    if key not in _DECLINED:
        _DECLINED.add(key)
        logger.debug("direct enqueue off for database %r: %s", connection.alias, reason)


def _last_result(results: list[Any], raw: Any) -> Any:
    """The last of `_direct`'s results, their error raised as psycopg raises it.

    A function of its own, called while `_direct` holds the connection's lock: no
    loop may stand in that `with` block's own frame. On CPython 3.13 an interrupt that
    lands at a loop's backward jump (Ctrl-C's KeyboardInterrupt, raised where the
    interpreter checks for signals, and a backward jump is such a place) finds
    no handler in the frame when the loop's `if` ended the iteration, so the `with`
    block's exits never run: the lock stayed held, and every later statement on the
    connection waited for it forever (found by CI, 3 hangs in its last 4 runs on 3.13;
    CPython issue 130279). From a call, the interrupt reaches the caller at the call,
    which its `with` block covers (tests/db/test_compat.py, the interrupt at each check)."""
    for result in results:
        if result.status != _TUPLES_OK:
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise error_from_result(result, encoding=raw.info.encoding)
            raise psycopg.InternalError(f"unexpected result: {result.status!r}")
    return results[-1] if results else None


def _first_row(result: Any) -> tuple[Any, ...]:
    """The first row of `direct_row`'s result, () if none."""
    if result is None or not result.ntuples:
        return ()
    return tuple([result.get_value(0, column) for column in range(result.nfields)])


def _ready_for_this_thread(connection: BaseDatabaseWrapper) -> None:
    """`ensure_connection()` and `validate_thread_sharing()`, as Django's cursor calls
    them, each skipped only where Django's own would do nothing: a connection already
    open, outside a running event loop (where `ensure_connection` refuses), in the
    thread that opened it, neither method replaced on the class (pytest-django's
    database blocker replaces `ensure_connection`), on the object, which is no proxy,
    or before this module's import. Their wrappers (the event-loop check, the
    thread-sharing lock) were about 5 % of an enqueue's instructions (`python
    benchmarks/run.py --parts enqueue` under callgrind)."""
    conn: Any = connection
    if (
        conn.connection is None
        or asyncio._get_running_loop() is not None
        or _replaced(connection, "ensure_connection", _ENSURE_CONNECTION)
    ):
        connection.ensure_connection()
    if conn._thread_ident != threading.get_ident() or _replaced(
        connection, "validate_thread_sharing", _VALIDATE_THREAD_SHARING
    ):
        connection.validate_thread_sharing()


def _replaced(connection: BaseDatabaseWrapper, name: str, django_own: object) -> bool:
    """Whether `connection`'s method `name` may not be Django's `django_own`: replaced on
    its class or on the object, or before this module's import."""
    return (
        not _CONNECTION_CHECKS_OWN
        or getattr(type(connection), name, None) is not django_own
        or name in vars(connection)
    )


# Named statements of `direct_row` outside transactions. A statement planned once and
# kept on the server session skips PostgreSQL's parse, analysis, rewrite and planning at
# every later run: measured on PostgreSQL 15 (libpq, autocommit, the enqueue's INSERT),
# 379 -> 266 us a statement, about a quarter of the backend's time (`python
# benchmarks/run.py --parts enqueue`, with DIRECT_ENQUEUE on and off).
_PREPARE_AT = 2  # its second run on one session prepares a statement (a one-off never is)
#: Named statements kept on one session at most: beyond it a statement is sent unnamed.
#: The enqueue's INSERT has four forms (with or without an expiry and a trace context)
#: per job model; the bound guards the server's memory should more ever come this way.
#: (A named statement is no longer planned again every few seconds, nor the least run
#: dropped for a new one: both were for the claim, whose plan depended on the table's
#: size and whose batch sizes were many; it no longer takes this path.)
_MAX_NAMED = 16
#: Losses of a statement not yet run once since it was prepared, one after another, on
#: one session, after which it names no more statements: a pooler that drops them
#: after every transaction on the same server session (PgBouncer's
#: `server_reset_query_always`), where each run paid a PREPARE and a failed run.
_QUICK_LOSSES = 3
_UNNAMED_ONLY: set[str] = set()  # aliases seen behind a transaction pooler (`_lost`)
_QUICK_WARNED: set[str] = set()  # aliases whose sessions dropped statements quickly
_UNNAMED_LOCK = threading.Lock()
_DUPLICATE = b"42P05"  # duplicate_prepared_statement: "already exists"
_UNDEFINED = b"26000"  # invalid_sql_statement_name: "does not exist"
#: feature_not_supported, as "cached plan must not change result type": a column the
#: statement returns changed its type (a migration's ALTER COLUMN ... TYPE) after the
#: PREPARE. Raised by the plan cache's check before the statement runs (the error's
#: source function, which is never translated, says so; a trigger's own 0A000 is left
#: as the caller's error, and the statement is not run again).
_PLAN_CHANGED = b"0A000"
_PLAN_CHECK = b"RevalidateCachedQuery"


class _Named:
    """A statement named on a session: its text and its runs since it was prepared."""

    __slots__ = ("query", "runs")

    def __init__(self, query: bytes) -> None:
        self.query, self.runs = query, 0


class _Session:
    """What `_run_named` knows of one psycopg connection's server session: the runs so
    far of each statement not named, the statements named there, losses of statements
    never run, whether it names no more, and the server's backend pid where it is not
    the one the connection reported (behind a pooler), once asked."""

    __slots__ = ("named", "quick_losses", "runs", "server_pid", "unnamed")

    def __init__(self) -> None:
        self.runs: dict[bytes, int] = {}
        self.named: dict[bytes, _Named] = {}
        self.server_pid: bytes | None = None
        self.quick_losses = 0
        self.unnamed = False


_SESSIONS: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()


def may_prepare(connection: BaseDatabaseWrapper) -> bool:
    """Whether `direct_row` may keep named statements on `connection`'s sessions: not
    where its settings say that a transaction pooler stands between (Django's
    `DISABLE_SERVER_SIDE_CURSORS`, which Django's docs ask for behind one), nor where
    `OPTIONS['prepare_threshold']` is set to None explicitly (psycopg's own switch for
    prepared statements), nor where `_lost` found a transaction pooler in this process."""
    settings = connection.settings_dict
    if settings.get("DISABLE_SERVER_SIDE_CURSORS") or connection.alias in _UNNAMED_ONLY:
        return False
    options = settings.get("OPTIONS") or {}
    return not ("prepare_threshold" in options and options["prepare_threshold"] is None)


@functools.lru_cache(maxsize=32)
def _statement_name(query: bytes) -> bytes:
    """The name of `query`'s statement: its text's hash, so that a statement of that name
    found on a session is this one (prepared by an earlier client of a session pooler,
    or by this connection before an interrupt cut the reply off)."""
    return b"skipqueue_" + hashlib.blake2b(query, digest_size=8).hexdigest().encode()


def _run_named(
    alias: str,
    raw: Any,
    pgconn: Any,
    query: bytes,
    values: list[bytes | None],
    result_format: int,
) -> list[Any] | None:
    """`query`'s results run as a named statement of this session, prepared at its second
    run (`_PREPARE_AT`; a statement run once, as by a connection per request, costs no
    extra round trip); None, having run nothing, where it must be sent unnamed. Outside
    a transaction only, where a statement that fails for want of its name changed
    nothing and can be sent again: the session may lack it (a transaction pooler such as
    PgBouncer before 1.21 moved the connection to another server session; DEALLOCATE or
    DISCARD ALL ran, psycopg's own on a rollback among them) or hold it already (`_prepare`)."""
    session = _SESSIONS.get(raw)
    if session is None:
        session = _SESSIONS[raw] = _Session()
    if session.unnamed:
        return None
    name = _statement_name(query)
    named = session.named.get(name)
    if named is None:
        runs = session.runs.get(query, 0) + 1
        if len(session.runs) >= 1024:  # one-off texts: bounded
            session.runs.clear()
        session.runs[query] = runs
        if runs < _PREPARE_AT:
            return None
        if len(session.named) >= _MAX_NAMED:
            return None
        if not _prepare(raw, pgconn, name, query):
            _lost(alias, raw, session)
            return None
        named = session.named[name] = _Named(query)
        del session.runs[query]
    results = _exchange(raw, pgconn.send_query_prepared, name, values, None, result_format)
    state = _sqlstate(results)
    if state == _UNDEFINED:
        _lost(alias, raw, session, quick=named.runs == 0)
        return None
    if state == _PLAN_CHANGED and _failed_in(results, _PLAN_CHECK):
        del session.named[name]  # first: prepared again at its next runs, with the new types
        _deallocate(raw, pgconn, name)
        return None
    named.runs += 1
    session.quick_losses = 0
    return results


def _prepare(raw: Any, pgconn: Any, name: bytes, query: bytes) -> bool:
    """PREPARE `query` as `name` on the session; False where a statement of that name
    is there again right after this connection dropped it (another server session
    answered, `_lost` asks). A statement of that name there already is dropped and
    prepared again, once."""
    for attempt in (1, 2):
        results = _exchange(raw, pgconn.send_prepare, name, query, None)
        state = _sqlstate(results)
        if state is None:
            return True
        if state == _DUPLICATE and attempt == 1:
            _deallocate(raw, pgconn, name)  # an error: a pooler
            continue
        if state not in (_DUPLICATE, _UNDEFINED):
            for result in results:
                if result.status == pq.ExecStatus.FATAL_ERROR:
                    raise error_from_result(result, encoding=raw.info.encoding)
        return False
    return False


def _deallocate(raw: Any, pgconn: Any, name: bytes) -> None:
    """DEALLOCATE `name` on the session; an error (gone already) changes nothing."""
    _exchange(raw, pgconn.send_query, b"DEALLOCATE " + name)


def _first_failure(results: list[Any]) -> Any:
    """The first failed result, None if none failed."""
    for result in results:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            return result
    return None


def _failed_in(results: list[Any], function: bytes) -> bool:
    """Whether the first failed result's error was raised in the server's `function`."""
    failed = _first_failure(results)
    return failed is not None and failed.error_field(pq.DiagnosticField.SOURCE_FUNCTION) == function


def _sqlstate(results: list[Any]) -> bytes | None:
    """The SQLSTATE of the first failed result, None if none failed."""
    failed = _first_failure(results)
    return None if failed is None else (failed.error_field(pq.DiagnosticField.SQLSTATE) or b"")


def _lost(alias: str, raw: Any, session: _Session, quick: bool = False) -> None:
    """A named statement went missing from this session: start its record afresh, to be
    prepared again, and ask the server's backend pid (only then). Where it is the one
    the connection reported when it opened, or the one a pooler's server session gave
    at the last loss (PgBouncer reports a pid of its own, in session mode too),
    something dropped the statement on the same session: DEALLOCATE or DISCARD ALL, a
    user's, a connection pool's reset, psycopg's own after a rollback where it prepares
    statements. Where it differs from the last one asked, a transaction pooler
    (PgBouncer before 1.21, or without max_prepared_statements) moves the connection
    between server sessions: `alias` sends unnamed statements from then on in this
    process, logged once. A pid that cannot be read (a timeout) decides nothing."""
    session.runs.clear()
    session.named.clear()
    session.quick_losses = session.quick_losses + 1 if quick else 0
    if session.quick_losses >= _QUICK_LOSSES:
        session.unnamed = True
        with _UNNAMED_LOCK:
            first = alias not in _QUICK_WARNED
            _QUICK_WARNED.add(alias)
        if not first:  # once per alias and process: a new connection finds it again
            return
        logger.warning(
            "Prepared statements of django-skipqueue were dropped %d times in a row on "
            "database %r before their first run, on the same server session: something "
            "drops them after every transaction (a pooler's server_reset_query_always, "
            "say). Such connections send unnamed statements from now on; set "
            "DISABLE_SERVER_SIDE_CURSORS = True on the database entry behind a pooler.",
            session.quick_losses,
            alias,
        )
        return
    asked = _exchange(raw, raw.pgconn.send_query, b"SELECT pg_backend_pid()")
    if len(asked) != 1 or asked[0].status != _TUPLES_OK or asked[0].ntuples != 1:
        return
    pid = asked[0].get_value(0, 0)
    if pid == str(raw.info.backend_pid).encode():
        return
    if session.server_pid is None or session.server_pid == pid:
        session.server_pid = pid
        return
    with _UNNAMED_LOCK:
        first = alias not in _UNNAMED_ONLY
        _UNNAMED_ONLY.add(alias)
    if first:
        logger.warning(
            "A prepared statement of django-skipqueue (its enqueue) went "
            "missing on database "
            "%r, whose connection reached another server session than before: a "
            "transaction pooler (PgBouncer before 1.21, or without "
            "max_prepared_statements). They are sent as unnamed statements from now on "
            "in this process; set DISABLE_SERVER_SIDE_CURSORS = True on the database "
            "entry behind a transaction pooler, as Django's documentation asks.",
            alias,
        )


def _exchange(raw: Any, send: Callable[..., None], *args: Any) -> list[Any]:
    """`send(*args)` on libpq and the results, read as psycopg's cursor reads them. An
    interrupt (Ctrl-C, a timeout's exception) between the send and the reading, outside
    psycopg's `Connection.wait`, which cancels and drains only what it was waiting on,
    leaves the statement in progress: it is cancelled and its results read here before
    the interrupt goes on, so that the connection's next statement is not refused with
    "another command is already in progress"."""
    pgconn = raw.pgconn
    try:
        send(*args)
        return raw.wait(libpq_execute(pgconn))
    except BaseException:
        if pgconn.transaction_status == _ACTIVE:
            try:
                with contextlib.suppress(Exception):
                    raw.cancel_safe(timeout=5.0)
                with contextlib.suppress(Exception):
                    raw.wait(libpq_execute(pgconn), timeout=5.0)
            finally:  # not cleaned up (a second interrupt, a timeout): closed, as
                if pgconn.transaction_status == _ACTIVE:  # psycopg's wait does then
                    pgconn.finish()
        raise


def _direct_steps() -> bool:
    """Whether Django's CursorWrapper steps are still the ones found at import."""
    return _STEPS_OWN and same_functions(_wrapper_steps_of(CursorWrapper), _WRAPPER_STEP_FUNCTIONS)
