"""Which database errors are passing (retry with backoff) and which are a row's fault.

The worker's rules (docs/explanation/protocol.md, "Faults"): a lost connection, a
server that is read-only (a standby during a failover), starting, stopping or in
recovery, a serialization failure or a deadlock are passing: back off, reconnect and
try again. Any other database error is a fault of the statement or of a row in it: it
is logged, isolated to the rows that cause it, and never ends the process.
"""

from __future__ import annotations

from django.db import DatabaseError, DataError, IntegrityError, InterfaceError, OperationalError

#: SQLSTATEs that pass, besides class 08 (connection exceptions):
#: read_only_sql_transaction, serialization_failure, deadlock_detected, admin_shutdown,
#: crash_shutdown, cannot_connect_now, idle_session_timeout.
TRANSIENT_SQLSTATES = frozenset({"25006", "40001", "40P01", "57P01", "57P02", "57P03", "57P05"})


def sqlstate(error: BaseException) -> str:
    """The SQLSTATE of a database error (psycopg's, under Django's wrapper), or ''."""
    for candidate in (error, error.__cause__):
        code = getattr(candidate, "sqlstate", None)
        if isinstance(code, str):
            return code
    return ""


def is_transient(error: BaseException) -> bool:
    """True for a database error that says "not now": back off and try again."""
    if isinstance(error, (OperationalError, InterfaceError)):
        return True
    if not isinstance(error, DatabaseError):
        return False
    code = sqlstate(error)
    return code in TRANSIENT_SQLSTATES or code.startswith("08")


def is_row_fault(error: BaseException) -> bool:
    """True for an error that the same row would raise again (bad data, a constraint)."""
    return isinstance(error, (DataError, IntegrityError)) and not is_transient(error)
