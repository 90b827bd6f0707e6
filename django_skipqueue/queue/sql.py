"""The few raw statements the ORM cannot say. Their text is in the .sql files beside the
verbs that run them (SQL_FILES: `claim.sql`, `outcomes.sql`, ...), each with the reason
it is raw, read once into STATEMENTS and bound to the names the verbs use; templates are
filled here, and the LISTEN helpers live here too.

Parameters are always passed separately; identifiers go through psycopg.sql.Identifier.
Nothing here is session-scoped, so it all works behind PgBouncer in transaction mode,
except LISTEN, which the worker runs only on its own direct connection.
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

from psycopg import sql

from django_skipqueue.conf.validators import CHANNEL_NAME_MAX_LENGTH
from django_skipqueue.core.states import FINISHED_STATES, UNFINISHED_STATES, validate_queue_name

if TYPE_CHECKING:
    import psycopg
    from django.db.backends.utils import CursorWrapper

#: The files of statements, beside the verbs that run them.
SQL_FILES = (
    "claim",
    "outcomes",
    "enqueue",
    "relaying",
    "workflows",
    "stats",
    "awaiting",
    "steps",
)


def load_statements(text: str) -> dict[str, str]:
    """The statements of one .sql file by name: each starts at a `-- name: NAME` line; the
    comment lines right after it are its documentation, and the lines up to the next
    name are its text (kept as written, braces and all: templates are filled here)."""
    found = {}
    for chunk in re.split(r"^(?=-- name: )", text, flags=re.M)[1:]:
        header, _, rest = chunk.partition("\n")
        lines = rest.rstrip("\n").split("\n")
        while lines and lines[0].startswith("--"):
            lines.pop(0)
        found[header.removeprefix("-- name: ").strip()] = "\n" + "\n".join(lines) + "\n"
    return found


def _read_all() -> dict[str, str]:
    statements: dict[str, str] = {}
    for name in SQL_FILES:
        found = load_statements(Path(__file__).with_name(f"{name}.sql").read_text())
        twice = statements.keys() & found.keys()
        if twice:
            raise RuntimeError(f"{name}.sql names {sorted(twice)} again")
        statements |= found
    return statements


#: Every statement of the SQL_FILES, by name, read once at import.
STATEMENTS = _read_all()

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
    """The LISTEN/NOTIFY channel of a queue, under PostgreSQL's 63 bytes: "skipqueue_"
    and the name, or "#" and its md5 past CHANNEL_NAME_MAX_LENGTH bytes. The NOTIFY
    triggers compute the same in SQL (skipqueue_channel(), migration 0023)."""
    name = validate_queue_name(queue_name)
    if len(name.encode()) <= CHANNEL_NAME_MAX_LENGTH:
        return CHANNEL_PREFIX + name
    return CHANNEL_PREFIX + "#" + hashlib.md5(name.encode(), usedforsecurity=False).hexdigest()


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


_CLAIM = STATEMENTS["CLAIM"]


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

TRY_KEY_LOCKS = STATEMENTS["TRY_KEY_LOCKS"]


def positional(statement: str) -> tuple[str, tuple[str, ...]]:
    """A statement written with named parameters (`%(queue)s`) in the positional form
    (`%s`) and the names in their order: to sit inside CLAIM, whose own are positional."""
    names = tuple(re.findall(r"%\((\w+)\)s", statement))
    return re.sub(r"%\(\w+\)s", "%s", statement), names


# The locking query of a fair queue's claim (queue/fair.py), positional, and the names
# of its parameters in order.
FAIR_WALK = STATEMENTS["FAIR_WALK"].strip()
FAIR_LOCKING, FAIR_LOCKING_PARAMS = positional(STATEMENTS["FAIR_LOCKING"].format(walk=FAIR_WALK))
# Where a fair claim's walk ended (queue/fair.py), with named parameters.
FAIR_WALK_END = STATEMENTS["FAIR_WALK_END"].format(walk=FAIR_WALK)


LOCK_WORKFLOWS_OF = STATEMENTS["LOCK_WORKFLOWS_OF"]

ACK_MANY = STATEMENTS["ACK_MANY"]

RENEW_MANY = STATEMENTS["RENEW_MANY"]

RELEASE_MANY = STATEMENTS["RELEASE_MANY"]

#: The finished states, as an SQL list.
FINISHED = ", ".join(f"'{state}'" for state in FINISHED_STATES)

MARK_AWAITED = STATEMENTS["MARK_AWAITED"].format(finished=FINISHED)

FINISHED_AMONG = STATEMENTS["FINISHED_AMONG"].format(finished=FINISHED)

STEPS_OF = STATEMENTS["STEPS_OF"]

RECORD_STEP = STATEMENTS["RECORD_STEP"].format(locking="")

RECORD_ATOMIC_STEP = STATEMENTS["RECORD_STEP"].format(locking="FOR NO KEY UPDATE")

TAKE_SIGNAL = STATEMENTS["TAKE_SIGNAL"]

SEND_SIGNAL = STATEMENTS["SEND_SIGNAL"]

WAKE_SIGNALLED = STATEMENTS["WAKE_SIGNALLED"]

#: The columns ENQUEUE_MANY fills with the model fields' defaults: written into the
#: statement as literals, once (`enqueue_many_statement`), not sent with every call.
ENQUEUE_DEFAULTS = ("state", "attempts", "expirations", "releases", "last_error", "errors")

ENQUEUE_MANY = STATEMENTS["ENQUEUE_MANY"]

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
    "rate_rows": "",
    "rate_name": "",
}
# Rate limits per key (`rate_key=`): each row's own rate key, one JSON array of them.
_KEYED_RATE_PARTS = {
    "rate_column": ", rate_key, rate_limit",
    "rate_value": ", r, %(rate_limit)s",
    "rate_rows": ", jsonb_array_elements_text(%(rate_keys)s::jsonb)",
    "rate_name": "r, ",
}
_UNRATED_PARTS = dict.fromkeys(_RATED_PARTS, "")
# Fair queues (SKIPQUEUE['FAIR_QUEUES']): each row's fair key, and the spec's weight.
_FAIR_PARTS = {
    "fair_column": ", fair_key, fair_weight",
    "fair_value": ", f, %(fair_weight)s",
    "fair_rows": ", jsonb_array_elements_text(%(fair_keys)s::jsonb)",
    "fair_name": "f, ",
}
_UNFAIR_PARTS = dict.fromkeys(_FAIR_PARTS, "")
# Strict order per key: the rows' `order_hold` (their key is their concurrency key).
_ORDERED_PARTS = {"order_column": ", order_hold", "order_value": ", %(order_hold)s"}
_UNORDERED_PARTS = dict.fromkeys(_ORDERED_PARTS, "")

LOCK_ORDERED_KEYS = STATEMENTS["LOCK_ORDERED_KEYS"]
# Traced enqueues (OpenTelemetry): the W3C trace context of the enqueuing span.
_TRACED_PARTS = {"trace_column": ", trace_context", "trace_value": ", %(trace)s::jsonb"}
_UNTRACED_PARTS = dict.fromkeys(_TRACED_PARTS, "")


def _literals(defaults: tuple[tuple[str, object], ...]) -> dict[str, str]:
    """The defaults (column, value) as SQL literals quoted by psycopg, "%" doubled: the
    statements go through %-style parameter binding."""
    return {
        column: sql.Literal(value).as_string(None).replace("%", "%%") for column, value in defaults
    }


@functools.lru_cache(maxsize=128)
def enqueue_many_statement(
    defaults: tuple[tuple[str, object], ...],
    unique: bool = False,
    keyed: bool = False,
    expiring: bool = False,
    rated: bool = False,
    traced: bool = False,
    rate_keyed: bool = False,
    fair: bool = False,
    ordered: bool = False,
) -> str:
    """ENQUEUE_MANY with the defaults (column, value) quoted in as literals by psycopg;
    with `unique`, the form for unique jobs (a `keys` parameter: a JSON array of texts);
    with `keyed`, the concurrency key and limit columns; with `expiring`, `expires_at`;
    with `rated`, the rate key and limit (with `rate_keyed`, a rate key per row: a
    `rate_keys` parameter); with `traced`, the trace context; with `fair`, the fair key
    (a `fair_keys` parameter) and weight."""
    rate_parts = _KEYED_RATE_PARTS if rate_keyed else _RATED_PARTS
    return ENQUEUE_MANY.format(
        **_literals(defaults),
        **(_UNIQUE_PARTS if unique else _PLAIN_PARTS),
        **(_KEYED_PARTS if keyed else _UNKEYED_PARTS),
        **(_EXPIRING_PARTS if expiring else _LASTING_PARTS),
        **(rate_parts if rated else _UNRATED_PARTS),
        **(_TRACED_PARTS if traced else _UNTRACED_PARTS),
        **(_FAIR_PARTS if fair else _UNFAIR_PARTS),
        **(_ORDERED_PARTS if ordered else _UNORDERED_PARTS),
    )


ENQUEUE_ONE = STATEMENTS["ENQUEUE_ONE"]


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


UNFINISHED_WITH_KEYS = STATEMENTS["UNFINISHED_WITH_KEYS"]

COALESCE_INSERT = STATEMENTS["COALESCE_INSERT"]
COALESCE_HOLDER = STATEMENTS["COALESCE_HOLDER"]
# A debounce's conflict: the later call's arguments and run time, within the first's bound.
_DEBOUNCED = (
    "DO UPDATE SET args = EXCLUDED.args, kwargs = EXCLUDED.kwargs,\n"
    "    run_at = LEAST(EXCLUDED.run_at,\n"
    "        COALESCE(skipqueue_job.coalesce_until, EXCLUDED.run_at)),\n"
    "    expires_at = EXCLUDED.expires_at"
)


@functools.lru_cache(maxsize=8)
def coalesce_statement(columns: tuple[str, ...], debounce: bool) -> str:
    """COALESCE_INSERT for these model columns (each a parameter), then the run time's
    (an instant, or a delay), the bound's and the expiry's (an instant, or a delay): a
    debounce's form, or a throttle's."""
    return COALESCE_INSERT.format(
        columns=", ".join(f'"{column}"' for column in columns),
        values=", ".join(["%s"] * len(columns)),
        on_conflict=_DEBOUNCED if debounce else "DO NOTHING",
    )


REPLACE_PENDING = STATEMENTS["REPLACE_PENDING"].format(expires_at=EXPIRES_AT)


COUNT_PENDING_UP_TO = STATEMENTS["COUNT_PENDING_UP_TO"]


WRITE_BACK = STATEMENTS["WRITE_BACK"]


RESERVE_JOB_IDS = STATEMENTS["RESERVE_JOB_IDS"]

WORKFLOW_INSERT = STATEMENTS["WORKFLOW_INSERT"]


@functools.lru_cache(maxsize=4)
def workflow_insert_statement(defaults: tuple[tuple[str, object], ...]) -> str:
    """WORKFLOW_INSERT with ENQUEUE_DEFAULTS (column, value) quoted in as literals."""
    return WORKFLOW_INSERT.format(**_literals(defaults), unfinished=UNFINISHED)


WORKFLOW_COLUMNS = STATEMENTS["WORKFLOW_COLUMNS"]


@functools.lru_cache(maxsize=4)
def workflow_columns_statement(defaults: tuple[tuple[str, object], ...]) -> str:
    """WORKFLOW_COLUMNS with ENQUEUE_DEFAULTS (column, value) quoted in as literals."""
    return WORKFLOW_COLUMNS.format(**_literals(defaults), expires_at=EXPIRES_AT)


QUEUE_GAUGES = STATEMENTS["QUEUE_GAUGES"]

WAITING_BY_QUEUE = STATEMENTS["WAITING_BY_QUEUE"]

ADD_MINUTE = STATEMENTS["ADD_MINUTE"]

ADD_TASK_MINUTE = STATEMENTS["ADD_TASK_MINUTE"]

TASK_WINDOWS = STATEMENTS["TASK_WINDOWS"]


@functools.lru_cache(maxsize=2)
def task_windows_statement(buckets: int) -> str:
    """TASK_WINDOWS summing `buckets` histogram elements, each its own column."""
    sums = ", ".join(f"sum((run_buckets->>{i})::bigint)" for i in range(buckets))
    return TASK_WINDOWS.format(buckets=sums)


TASK_LAST_ERRORS = STATEMENTS["TASK_LAST_ERRORS"]

MINUTE_SAMPLED = STATEMENTS["MINUTE_SAMPLED"]
