"""The queue protocol: filters on JobQuerySet, state changes on JobManager.

Every time comparison uses the database clock (`Now()`, STATEMENT_TIMESTAMP() on
PostgreSQL), never the worker's. Every write that finishes or extends an attempt is
fenced: it matches the job id, `state = 'running'`, the claimed attempt number and an
unexpired lease in its own WHERE, so a stale attempt changes nothing (0 rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import json
import logging
import math
import os
import reprlib
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeVar, overload

from django.db import DatabaseError, DataError, IntegrityError, connections, models, transaction
from django.db.models import (
    Count,
    DurationField,
    Exists,
    Expression,
    ExpressionWrapper,
    F,
    Func,
    Min,
    OuterRef,
    Q,
    Subquery,
    Value,
    signals,
)
from django.db.models.functions import Cast, Coalesce, Concat, Greatest, JSONObject, Least, Now
from django.db.models.lookups import Exact

from django_skipqueue.conf import MAX_LEASE, MIN_LEASE, SkipQueueSettings, get_settings
from django_skipqueue.conf.limits import parse_rate
from django_skipqueue.conf.relay import relayed_queues
from django_skipqueue.core import tracing
from django_skipqueue.core.payload import (
    encode,
    encode_arguments,
    normalize_arguments,
    storable_text,
)
from django_skipqueue.core.redaction import redact_text
from django_skipqueue.core.states import (
    ACTOR_MAX_LENGTH,
    CLAIM_ORDER,
    EXPIRED,
    FINISHED_STATES,
    UNFINISHED_STATES,
    UNNEEDED,
    UPSTREAM,
    JobState,
    sort_in_claim_order,
    validate_queue_name,
)
from django_skipqueue.db.direct import (
    binary_bigint,
    binary_timestamptz,
    direct_row,
    text_parameters,
)
from django_skipqueue.db.hooks import (
    fetch_all,
    fetch_one,
    has_receivers,
    quote_parameters,
    thread_connection,
)
from django_skipqueue.exceptions import (
    ConfigurationError,
    DuplicateJobError,
    InvalidJobError,
    QueueFullError,
)
from django_skipqueue.faults import is_transient
from django_skipqueue.queue import sql
from django_skipqueue.queue.connections import bounded
from django_skipqueue.queue.loading import fetch_jobs, job_cursor, loaded_job, loaded_jobs

if TYPE_CHECKING:
    import uuid
    from collections.abc import Callable

    from django_skipqueue.conf.limits import QueueLimit
    from django_skipqueue.core.payload import JSONValue
    from django_skipqueue.core.spec import JobSpec
    from django_skipqueue.models import (  # noqa: F401
        Job,
        Queue,
        QueueMinute,
        RateBucket,
        Schedule,
        WorkerProcess,
    )

T = TypeVar("T")
#: A call checked for enqueue: plain args, plain kwargs, and their JSON texts.
Checked: TypeAlias = "tuple[list[Any], dict[str, Any], str, str]"

logger = logging.getLogger(__name__)
#: The most jobs one reaper pass ends for their expiry (`end_expired`): a burst of
#: millions of expired jobs is ended over several passes, each a short UPDATE.
EXPIRE_BATCH_SIZE = 10_000
#: How long one reaper pass goes on ending expired jobs, batch after batch: expired rows
#: at the head of a queue cost every claim a look, so they are ended quickly.
EXPIRE_PASS_SECONDS = 2.0

#: PostgreSQL's SQLSTATE of a unique violation.
UNIQUE_VIOLATION = "23505"


class _AppendCapped(Func):
    """`history || entry` for a jsonb array, dropping the oldest entry once `cap` are kept."""

    output_field = models.JSONField()

    def __init__(self, history: Expression | F, entry: Expression, cap: int) -> None:
        super().__init__(history, entry, Value(cap))

    def as_sql(
        self,
        compiler: Any,
        connection: Any,
        function: str | None = None,
        template: str | None = None,
        arg_joiner: str | None = None,
        **extra_context: Any,
    ) -> tuple[str, tuple[Any, ...]]:
        (h_sql, h_params), (e_sql, e_params), (c_sql, c_params) = (
            compiler.compile(expression) for expression in self.get_source_expressions()
        )
        # A history that is not an array (written by hand or by another service) is
        # kept as the first entry of a new one: never lost, never an error.
        sql = (
            f"(CASE WHEN jsonb_typeof({h_sql}) <> 'array' THEN jsonb_build_array({h_sql}) "
            f"WHEN jsonb_array_length({h_sql}) >= {c_sql} THEN {h_sql} - 0 "
            f"ELSE {h_sql} END) || {e_sql}"
        )
        return sql, (*h_params, *h_params, *h_params, *c_params, *h_params, *h_params, *e_params)


def _text(value: str | None) -> Cast:
    """`%s::text`: a text parameter whose type the statement around it does not fix."""
    return Cast(Value(value), models.TextField())


def _json_argument(value: Any) -> Expression:
    """A value for jsonb_build_object(): a text or a None cast (see `ErrorInfo.entry`);
    a number or a bool is sent with its own type."""
    return _text(value) if value is None or isinstance(value, str) else Value(value)


@dataclass(frozen=True)
class ErrorInfo:
    """What went wrong in one attempt, already capped in size."""

    type: str
    message: str
    traceback: str = ""

    def entry(self) -> Expression:
        """The history entry as a jsonb object, stamped with the database clock.

        The texts are cast: jsonb_build_object() takes arguments of any type, so a
        parameter sent apart from the query (Django's `server_side_binding` option)
        must say its own, or PostgreSQL cannot tell it.
        """
        return JSONObject(
            attempt=F("attempts"),
            at=Now(),
            type=_text(self.type),
            message=_text(self.message),
            traceback=_text(self.traceback),
        )

    def summary(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


# The error type of a job ended by `_quarantine`: a row no attempt could run.
QUARANTINED = "django_skipqueue.exceptions.InvalidJobError"

LEASE_EXPIRED = ErrorInfo(
    "django_skipqueue.exceptions.LeaseExpiredError",
    "the lease ran out before this attempt was acknowledged; taken back",
)


class Renewal(enum.Enum):
    """What a lease renewal found (`JobManager.renewal`)."""

    RENEWED = "renewed"
    CANCEL_REQUESTED = "cancel requested"  # not renewed: the lease is left to run out
    LOST = "lost"  # this attempt no longer holds the job


#: How soon a claim held back by a concurrency limit is tried again (a slot frees when
#: a job of another worker ends, which sends no notification).
SLOT_RETRY_SECONDS = 0.1


@dataclass(frozen=True)
class ReapResult:
    """What one reap did: expired leases sent back to pending, or to failed (no attempt left)."""

    requeued: int = 0
    failed: int = 0
    cancelled: int = 0  # a cancel was requested: ended cancelled, not retried
    expired: int = 0  # not started by `expires_at`: ended cancelled, by EXPIRED
    #: Expired leases by queue, as counted just before the reap (the metrics' series
    #: skipqueue_lease_expirations_total).
    by_queue: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.requeued + self.failed + self.cancelled + self.expired


class _NoIndex(Func):
    """`column || ''`: the column's own text, in a form the planner matches to no index.

    A write that names its jobs by id tests their state as well (the fence's
    `state = 'running'`, a cancel's). That test also matches the predicate of the
    partial indexes over jobs in that state (`skipqueue_job_lease_idx` and
    `skipqueue_job_worker_run_idx` for running ones), and where the statistics count few
    such jobs (ANALYZE ran while none was running: the usual case, on a table of mostly
    finished jobs), the planner prices a walk through a whole such index at one row, as
    much as the primary key's probe, and may take it: then every ack and renewal reads
    the entry of every running job, dead entries included. Measured on PostgreSQL 15
    with 5,000 jobs running: a renewal 3.6 ms, an ack 5.5 ms, each reading 4,900 rows it
    then threw away. With the state hidden, the primary key is the only index left to
    find a job by its id (`tests/test_managers.py` checks the plans).
    """

    template = "(%(expressions)s || '')"
    output_field = models.CharField()


def _state_is(state: str) -> Exact:
    """`state = <state>`, looked up by the primary key only (see `_NoIndex`)."""
    return Exact(_NoIndex("state"), state)


def _ack_parameters(
    acks: Sequence[tuple[int, int, JSONValue]], texts: Sequence[str | None]
) -> dict[str, str]:
    """`sql.ACK_MANY`'s parameters for (id, attempt, result) rows and their results'
    JSON texts: the results as one JSON object by id (None left out), the ids as an
    array's text, and the attempts as one JSON object by id; all three text. Where an id
    comes twice, its higher attempt is kept: attempts never go down, so only that one can
    still hold the job."""
    chosen: dict[int, tuple[int, str | None]] = {}
    for (job_id, attempt, _), text in zip(acks, texts, strict=True):
        if job_id not in chosen or attempt > chosen[job_id][0]:
            chosen[job_id] = (int(attempt), text)
    results = ",".join(f'"{i}":{text}' for i, (_, text) in chosen.items() if text is not None)
    attempts = ",".join(f'"{i}":{attempt}' for i, (attempt, _) in chosen.items())
    return {
        "results": "{" + results + "}",
        "ids": "{" + ",".join(str(int(i)) for i in chosen) + "}",
        "attempts": "{" + attempts + "}",
    }


class JobQuerySet(models.QuerySet["Job"]):
    """Sets of jobs. These methods filter; they never write."""

    def pending(self) -> JobQuerySet:
        return self.filter(state=JobState.PENDING)

    def running(self) -> JobQuerySet:
        return self.filter(state=JobState.RUNNING)

    def due(self) -> JobQuerySet:
        """Pending jobs whose `run_at` has come, on the database clock."""
        return self.filter(state=JobState.PENDING, run_at__lte=Now())

    def unexpired(self) -> JobQuerySet:
        """Jobs without an expiry, or whose `expires_at` has not come (database clock):
        a claim or a relay never starts one past it (the reaper then ends it)."""
        return self.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=Now()))

    def past_expiry(self) -> JobQuerySet:
        """Unstarted jobs (pending, or waiting on a workflow's parents) whose
        `expires_at` has come: the reaper ends them cancelled, by EXPIRED."""
        return self.filter(state__in=[JobState.PENDING, JobState.WAITING], expires_at__lte=Now())

    def scheduled(self) -> JobQuerySet:
        """Pending jobs due in the future."""
        return self.filter(state=JobState.PENDING, run_at__gt=Now())

    def retryable(self) -> JobQuerySet:
        """Failed or cancelled jobs that `retry_now` would move: not a unique job whose
        key another unfinished job of its task holds, nor a workflow's job that its
        workflow ended (cancelled because of a failed parent, which an operator retries
        instead, or an on_error job that was not needed) or that was cancelled while it
        still waited on a parent."""
        # A workflow's job cancelled while it still waited on a parent (its count stays
        # above zero: a cancelled job is not counted down) would run before that parent.
        ended_by_workflow = Q(cancelled_by__in=[UPSTREAM, UNNEEDED]) | Q(waiting_on__gt=0)
        return (
            self.filter(state__in=[JobState.FAILED, JobState.CANCELLED])
            .exclude(ended_by_workflow)
            .exclude(
                Exists(
                    self.model._base_manager.filter(
                        task=OuterRef("task"),
                        unique_key=OuterRef("unique_key"),
                        state__in=UNFINISHED_STATES,
                    )
                )
            )
        )

    def expired(self) -> JobQuerySet:
        """Running jobs whose lease has run out and which the reaper has not yet taken back.

        A running row with no lease at all (written by hand or by another client) counts
        as expired: no attempt can hold it, since the fence needs a live lease.
        """
        return self.filter(
            Q(leased_until__lt=Now()) | Q(leased_until__isnull=True), state=JobState.RUNNING
        )

    def reapable(self) -> tuple[JobQuerySet, JobQuerySet, JobQuerySet]:
        """The expired jobs of this set the reaper sends back to pending (an attempt is
        left), those it ends failed (none is left) and those it ends cancelled (an
        operator asked them to stop). Only expired running jobs are in any of them."""
        expired = self.expired()
        uncancelled = expired.filter(cancel_requested_at__isnull=True)
        return (
            uncancelled.filter(attempts__lt=F("max_attempts")),
            uncancelled.filter(attempts__gte=F("max_attempts")),
            expired.filter(cancel_requested_at__isnull=False),
        )

    def repeatedly_expired(self, threshold: int) -> JobQuerySet:
        """Jobs whose lease ran out at least `threshold` times (poison suspects)."""
        return self.filter(expirations__gte=threshold)

    def finished(self) -> JobQuerySet:
        return self.filter(state__in=FINISHED_STATES)

    def for_queues(self, names: Iterable[str]) -> JobQuerySet:
        names = list(names)
        if len(names) == 1:  # equality, so the claim index gives the order directly
            return self.filter(queue_name=names[0])
        return self.filter(queue_name__in=names)

    def claimable(self, queues: Iterable[str]) -> JobQuerySet:
        """The jobs a claim takes, in the order it takes them: due, of these queues, in
        CLAIM_ORDER (the claim index's), each locked FOR NO KEY UPDATE SKIP LOCKED when
        the set is evaluated (which needs a transaction)."""
        return (
            self.due()
            .for_queues(queues)
            .filter(concurrency_key__isnull=True)  # keyed (and rate-limited) jobs: claim_limited()
            .unexpired()
            .order_by(*CLAIM_ORDER)
            .select_for_update(skip_locked=True, no_key=True)
        )

    def claimable_under_limits(
        self, *, keyed_in: Iterable[str], all_in: Iterable[str]
    ) -> JobQuerySet:
        """The jobs `claim_limited` considers, in claim order, locked FOR NO KEY UPDATE
        SKIP LOCKED: due jobs with a concurrency key in the queues `keyed_in`, and every
        due job of the queues `all_in` (those with a limit). A job whose key already
        runs its limit is left out, so that waiting jobs do not hide the others (the
        exact count is made again under the key's lock)."""
        running_of_key = (
            self.model._base_manager.filter(
                state=JobState.RUNNING,
                concurrency_key=OuterRef("concurrency_key"),
                leased_until__gt=Now(),
            )
            .order_by()
            .values("concurrency_key")
            .annotate(n=Count("id"))
            .values("n")
        )
        return (
            self.due()
            .filter(
                Q(queue_name__in=list(keyed_in), concurrency_key__isnull=False)
                | Q(queue_name__in=list(all_in))
            )
            .filter(
                Q(concurrency_key__isnull=True)
                | Q(concurrency_limit__gt=Coalesce(Subquery(running_of_key), 0))
            )
            .filter(  # a task whose rate bucket is empty: left out, as a full key is
                Q(rate_key__isnull=True)
                | ~Q(
                    rate_key__in=_rate_bucket_model(self.model)
                    .objects.filter(empty_until__gt=Now())
                    .values("key")
                )
            )
            .unexpired()
            .order_by(*CLAIM_ORDER)
            .select_for_update(skip_locked=True, no_key=True)
        )

    def holding(self, job_id: int, attempt: int) -> JobQuerySet:
        """The fence: the job, only while `attempt` is its current, unexpired claim."""
        return self.filter(
            _state_is(JobState.RUNNING), id=job_id, attempts=attempt, leased_until__gt=Now()
        )


def _call_pair(task: str, call: Any, index: int) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """One call of `enqueue_many`, `(args, kwargs)`, checked for its shape: `[(1, 2)]`
    for `add(1, 2)` raised "object of type 'int' has no len()", and `[("ab", {})]`
    enqueued add("a", "b")."""
    if isinstance(call, (tuple, list)) and len(call) == 2:
        args, kwargs = call
        if type(kwargs) is dict and type(args) in (tuple, list):
            return args, kwargs  # the usual shape, without the ABCs' checks (bulk speed)
        if (
            isinstance(args, Sequence)
            and not isinstance(args, (str, bytes, bytearray))
            and isinstance(kwargs, Mapping)
        ):
            return args, kwargs
    shown = reprlib.repr(call)
    raise InvalidJobError(
        f"enqueue_many of {task}: call {index} is {shown}; each call is a pair (args, "
        f"kwargs), a list or tuple of positional arguments and a dict of keyword ones: "
        f"((1, 2), {{}}) for task(1, 2), ((), {{'b': 2}}) for task(b=2)"
    )


class JobManager(models.Manager.from_queryset(JobQuerySet)):  # type: ignore[misc]
    """The protocol verbs. Each owns its transaction and says what its return means."""

    def claim(
        self,
        *,
        queues: Sequence[str],
        limit: int = 1,
        worker: WorkerProcess | None = None,
        lease: timedelta | None = None,
    ) -> list[Job]:
        """Lock up to `limit` due jobs (SKIP LOCKED), mark them running, commit, return them.

        Which jobs, and in which order, is `claimable(queues)`, a QuerySet. Its locking
        query (FOR NO KEY UPDATE SKIP LOCKED), compiled inside `transaction.atomic()`,
        becomes the CTE of one claiming statement, `sql.claim_statement`: a MATERIALIZED
        CTE and an UPDATE ... RETURNING that names its columns. In autocommit that one
        statement is the claim's whole transaction: the row locks are held only until it
        commits, before this returns (inside the caller's atomic(), it runs in a
        savepoint of the caller's transaction). Returned in claim order. Each job's
        `attempts` is the attempt number that its ack, renew, fail and release must
        present. The lease is each job's own unless `lease` is given.

        If the statement fails other than by the connection, the jobs are claimed one
        at a time (see `_claim_row_by_row`).

        Jobs with a concurrency key are not taken here (see `claim_limited`).
        """
        if limit < 1:
            return []
        names = tuple(queues)
        try:
            statement, params = self._bound_claim(names, limit, worker, lease)
            # One statement, its own transaction in autocommit (no BEGIN and COMMIT
            # round trips: measured 1.37x the cost per job with them, at 16 a claim);
            # inside the caller's atomic(), a savepoint of the caller's transaction.
            # Through Django's cursor: a named statement sent straight on libpq drained
            # slower (issue 53: run_peers.sh, the peer benchmark, three interleaved
            # runs each, median 1.77x PgQueuer's drain at --concurrency 4 with it,
            # 2.22x without; --processes 2, 0.51x and 0.63x pgbench's LIMIT 10).
            unloadable: list[tuple[int, str]] = []
            with _savepoint_if_in_transaction(self.db), job_cursor(self.db) as cursor:
                cursor.execute(statement, params)
                claimed = fetch_jobs(self.model, cursor, self.db, unloadable=unloadable)
            self._fail_unloadable(unloadable)
        except DatabaseError as error:
            if is_transient(error):
                raise
            logger.error("claim failed, claiming row by row: %s", redact_text(str(error)))
            claimed = self._claim_row_by_row(names, limit, worker, lease)
        sort_in_claim_order(claimed)
        return claimed

    def _bound_claim(
        self,
        queues: tuple[str, ...],
        limit: int,
        worker: WorkerProcess | None,
        lease: timedelta | None,
    ) -> tuple[str, list[Any] | None]:
        """A worker's claiming statement with its parameters quoted in, once per worker,
        queues, limit and lease: its parameters never change between two claims, and
        binding them on every claim cost about 5 % of a worker's CPU at concurrency 4
        (measured with py-spy; psycopg quotes them client-side, as Django has it do).
        The quoting is psycopg's own (`DatabaseOperations.compose_sql`), the very text a
        claim with parameters sends. Without a worker (an in-process claim, named by
        its thread) the parameters are bound per call, as any query's."""
        key = (self.model, self.db, queues, limit, worker.pk if worker else None, lease)
        bound = _BOUND_CLAIMS.get(key)
        if bound is not None:
            return bound, None
        statement, params = self.claim_statement(queues, limit=limit, worker=worker, lease=lease)
        connection = connections[self.db]
        if worker is None or connection.vendor != "postgresql":
            return statement, params
        if len(_BOUND_CLAIMS) >= 1024:  # bounded: one worker uses a few limits
            _BOUND_CLAIMS.clear()
        _BOUND_CLAIMS[key] = quote_parameters(connection, statement, params)
        return _BOUND_CLAIMS[key], None

    def _fail_unloadable(self, unloadable: list[tuple[int, str]]) -> None:
        """Claimed rows that Python cannot load (`fetch_jobs`) end failed, each with its
        reason: they could never run, and the rest of their batch runs as usual."""
        for job_id, reason in unloadable:
            self._quarantine(
                job_id,
                JobState.RUNNING,
                f"the job's row holds a value Python cannot load ({reason}); it was "
                f"written by another client",
            )

    def claim_statement(
        self,
        queues: Sequence[str],
        *,
        limit: int = 1,
        worker: WorkerProcess | None = None,
        lease: timedelta | None = None,
        only: int | None = None,
        ids: Sequence[int] | None = None,
        ids_only: bool = False,
    ) -> tuple[str, list[Any]]:
        """The claiming statement and its parameters, for claim() and for EXPLAIN.

        The locking query's SQL is compiled once per database, queues and limit (inside
        `transaction.atomic()`, where Django compiles it), and reused: a worker claims
        from the same queues again and again.
        """
        if ids is not None:  # rows this transaction already locked (claim_limited)
            locking_sql, locking_params = sql.CLAIM_THESE, (list(ids),)
        elif only is None:
            locking_sql, locking_params = _locking_query(self, tuple(queues), limit)
        else:  # one given row (the fallback), not cached
            with transaction.atomic(using=self.db):  # Django compiles FOR UPDATE only here
                one = self.claimable(queues).filter(id=only).values("id")[:1]
                locking_sql, locking_params = one.query.get_compiler(self.db).as_sql()
        columns = ("id",) if ids_only else _columns(self.model)
        params: list[Any] = [
            *locking_params,
            worker.pk if worker is not None else None,
            str(worker.pk) if worker is not None else in_process_claimer(),
            lease,
            MIN_LEASE,
            MAX_LEASE,
        ]
        if not ids_only:
            params += [MIN_LEASE, MAX_LEASE]  # the returned lease's bounds
        return sql.claim_statement(locking_sql, columns), params

    def _claim_row_by_row(
        self,
        queues: Sequence[str],
        limit: int,
        worker: WorkerProcess | None,
        lease: timedelta | None,
    ) -> list[Job]:
        """The claim after its statement failed: each row alone, in a savepoint.

        A row whose claim still fails (a trigger of the project's that refuses it, say)
        ends failed with the database's error, so it cannot stop its queue; every other
        row is claimed as usual. One transaction, committed before returning.
        """
        with bounded(self.db):
            ids = list(self.claimable(queues).values_list("id", flat=True)[:limit])
            return self._claim_each(queues, ids, worker, lease, locked=False)

    def _claim_each(
        self,
        queues: Sequence[str],
        ids: list[int],
        worker: WorkerProcess | None,
        lease: timedelta | None,
        *,
        locked: bool,
        ids_only: bool = False,
    ) -> list[Any]:
        """Claim each of `ids` alone, in a savepoint: rows this transaction locked
        (`locked`: `sql.CLAIM_THESE`) or rows to find again among the claimable. A row
        whose claim fails ends failed with the database's error."""
        claimed: list[Any] = []
        for job_id in ids:
            which: dict[str, Any] = {"ids": [job_id]} if locked else {"only": job_id}
            try:
                with transaction.atomic(using=self.db):
                    statement, params = self.claim_statement(
                        queues, worker=worker, lease=lease, ids_only=ids_only, **which
                    )
                    claimed.extend(self._run_claim(statement, params, ids_only=ids_only))
            except DatabaseError as error:
                if is_transient(error):
                    raise
                self._quarantine(job_id, JobState.PENDING, f"the claim failed: {error}")
        return claimed

    def _run_claim(self, statement: str, params: list[Any], ids_only: bool = False) -> list[Any]:
        """Run a claiming statement and load what it claimed, failing the rows Python
        cannot load (`_fail_unloadable`); with `ids_only`, the claimed ids."""
        if ids_only:
            with connections[self.db].cursor() as cursor:
                cursor.execute(statement, params)
                return [row[0] for row in cursor.fetchall()]
        unloadable: list[tuple[int, str]] = []
        with job_cursor(self.db) as cursor:
            cursor.execute(statement, params)
            claimed = fetch_jobs(self.model, cursor, self.db, unloadable=unloadable)
        self._fail_unloadable(unloadable)
        return claimed

    def _load_claimed(self, ids: list[int]) -> list[Job]:
        """The rows of jobs this worker claimed (committed already), as Job instances;
        rows Python cannot load end failed (`_fail_unloadable`)."""
        if not ids:
            return []
        unloadable: list[tuple[int, str]] = []
        statement = sql.load_claimed_statement(_columns(self.model))
        params: list[Any] = [MIN_LEASE, MAX_LEASE, ids]
        with job_cursor(self.db) as cursor:
            cursor.execute(statement, params)
            claimed = fetch_jobs(self.model, cursor, self.db, unloadable=unloadable)
        self._fail_unloadable(unloadable)
        return claimed

    def _claim_these(
        self,
        queues: Sequence[str],
        ids: list[int],
        worker: WorkerProcess | None,
        lease: timedelta | None,
    ) -> list[int]:
        """Claim rows this transaction has locked (`claim_limited`), in a savepoint; if
        the statement fails other than by the connection (one row's attempt counter at
        its maximum, a project's trigger), each row alone, and a row whose claim still
        fails ends failed with the database's error. One row cannot stop the others.
        Returns the claimed ids only (see `sql.load_claimed_statement`)."""
        try:
            with transaction.atomic(using=self.db):
                statement, params = self.claim_statement(
                    queues, worker=worker, lease=lease, ids=ids, ids_only=True
                )
                return self._run_claim(statement, params, ids_only=True)
        except DatabaseError as error:
            if is_transient(error):
                raise
            logger.error("limited claim failed, claiming row by row: %s", redact_text(str(error)))
        return self._claim_each(queues, ids, worker, lease, locked=True, ids_only=True)

    def keyed_due(self, queues: Sequence[str]) -> bool:
        """Whether a job with a concurrency key (a rate-limited task's included) is due in
        these queues: a probe of the index that holds only such pending jobs
        (skipqueue_job_keyed_claim_idx)."""
        if not queues:
            return False
        return self.due().for_queues(queues).filter(concurrency_key__isnull=False).exists()

    def seconds_until_rate_refill(self, queues: Sequence[str]) -> float | None:
        """Seconds (the database's clock) until the first token bucket that a claim left
        empty, of a due job in `queues`, holds a token again: 0 if it refilled since; None
        if no due job waits on such a bucket. `claimable_under_limits` leaves such jobs out
        without a wait: a burst worker asks here before it exits past them. A bucket that
        refilled between the claim that found it empty and this look still counts (its
        `empty_until` stays set until a claim touches it): the burst's next claim takes
        its job (a CI run under load exited past one, the look saying "nothing waits")."""
        waiting = self.due().for_queues(queues).filter(rate_key__isnull=False).values("rate_key")
        left = (
            _rate_bucket_model(self.model)
            .objects.db_manager(self.db)
            .filter(empty_until__isnull=False, key__in=waiting)
            .annotate(left=ExpressionWrapper(F("empty_until") - Now(), DurationField()))
            .aggregate(soonest=Min("left"))["soonest"]
        )
        return max(left.total_seconds(), 0.0) if left is not None else None

    def claim_limited(
        self,
        *,
        queues: Sequence[str],
        limits: Mapping[str, QueueLimit],
        limit: int,
        worker: WorkerProcess | None = None,
        lease: timedelta | None = None,
    ) -> tuple[list[Job], float | None]:
        """Claim under flow control: jobs with a concurrency key from `queues`, and any
        job of the queues among them that `limits` limits. Returns the jobs and, if a
        limit held some back, the seconds after which to try again (None otherwise).

        One transaction, so that no two workers count the same free slot:
        1. each limited queue's row is locked (FOR UPDATE, in name order), then its
           running jobs with a live lease are counted and its token bucket refilled on
           the database clock: what the queue allows now;
        2. the candidates are locked (`claimable_under_limits`, SKIP LOCKED);
        3. each key among them is locked with a transaction-level advisory lock, tried
           (a key another worker is deciding is left for later), then its running jobs
           with a live lease are counted: a statement after the locks, so it sees every
           claim committed before them;
        4. the candidates that fit are claimed in one statement (`sql.CLAIM_THESE`),
           returning their ids only, and the buckets are charged; after the commit the
           claimed rows are read (`sql.load_claimed_statement`), holding no lock.
        An expired lease holds no slot: its job counts again only once it is reclaimed.
        """
        if limit < 1:
            return [], None
        queue_rows = _queue_model(self.model).objects.db_manager(self.db)
        limited = sorted(name for name in queues if name in limits)
        keyed_in = [name for name in queues if name not in limits]
        waits: list[float] = []
        with bounded(self.db):
            allowed: dict[str, float] = {}
            buckets: dict[str, tuple[float, datetime]] = {}
            for name in limited:
                queue_limit = limits[name]
                found = queue_rows.locked(name)
                if found is None:  # another worker is deciding this queue's claim now
                    allowed[name] = 0
                    waits.append(SLOT_RETRY_SECONDS)
                    continue
                row, now = found
                room = math.inf
                if queue_limit.concurrency is not None:
                    running = self.filter(
                        state=JobState.RUNNING, queue_name=name, leased_until__gt=Now()
                    ).count()
                    room = max(queue_limit.concurrency - running, 0)
                    if not room:
                        waits.append(SLOT_RETRY_SECONDS)
                if queue_limit.rate is not None:
                    tokens = refilled(
                        queue_limit.rate,
                        queue_limit.period,
                        row.rate_tokens,
                        row.rate_refilled_at,
                        now,
                    )
                    buckets[name] = (tokens, now)
                    room = min(room, math.floor(tokens))
                    if tokens < 1:
                        waits.append((1 - tokens) / queue_limit.refill_per_second)
                allowed[name] = room
            open_limited = [name for name, room in allowed.items() if room >= 1]
            candidates = list(
                self.claimable_under_limits(keyed_in=keyed_in, all_in=open_limited).values_list(
                    "id",
                    "queue_name",
                    "concurrency_key",
                    "concurrency_limit",
                    "rate_key",
                    "rate_limit",
                )[:limit]
            )
            running_of = self._lock_keys(
                sorted({key for _, _, key, _, _, _ in candidates if key is not None})
            )
            rates_of = {rate_key: rate for _, _, _, _, rate_key, rate in candidates if rate_key}
            rated = self._rate_buckets(rates_of, waits)
            chosen: list[int] = []
            taken: dict[str, int] = {}
            spent: dict[str, int] = {}
            for job_id, queue_name, key, key_limit, rate_key, _ in candidates:
                if len(chosen) >= limit:
                    break
                if queue_name in allowed and allowed[queue_name] < 1:
                    continue
                if rate_key is not None and rate_key in rated:
                    left = rated[rate_key][0] - spent.get(rate_key, 0)
                    if left < 1:
                        continue  # its bucket is empty, or another claim holds it
                if key is not None:
                    if key not in running_of or running_of[key] >= (key_limit or 1):
                        waits.append(SLOT_RETRY_SECONDS)
                        continue
                    running_of[key] += 1
                if queue_name in allowed:
                    allowed[queue_name] -= 1
                    taken[queue_name] = taken.get(queue_name, 0) + 1
                if rate_key is not None and rate_key in rated:
                    spent[rate_key] = spent.get(rate_key, 0) + 1
                chosen.append(job_id)
            claimed_ids = self._claim_these(queues, chosen, worker, lease) if chosen else []
            for name, (tokens, now) in buckets.items():
                queue_rows.filter(name=name).update(
                    rate_tokens=tokens - taken.get(name, 0), rate_refilled_at=now
                )
            bucket_rows = _rate_bucket_model(self.model).objects.db_manager(self.db)
            for rate_key, (tokens, now) in rated.items():
                if math.isfinite(tokens):  # a bucket this claim locked
                    left = tokens - spent.get(rate_key, 0)
                    rate, period = parse_rate(rates_of[rate_key], "rate_limit")
                    bucket_rows.filter(key=rate_key).update(
                        tokens=left,
                        refilled_at=now,
                        empty_until=now + timedelta(seconds=(1 - left) * period / rate)
                        if left < 1
                        else None,
                    )
        # Committed: the payloads are read now, holding no lock (a frozen reader of a
        # large result cannot be ended by the server, and would hold the queue's row).
        claimed = self._load_claimed(claimed_ids)
        sort_in_claim_order(claimed)
        return claimed, min(waits) if waits else None

    def _rate_buckets(
        self, rates: Mapping[str, str], waits: list[float]
    ) -> dict[str, tuple[float, datetime]]:
        """The token buckets of these rate keys (`{key: "10/m"}`), each locked (FOR
        UPDATE SKIP LOCKED, in key order) and refilled on the database clock: what each
        allows now, and that now. A bucket another claim holds allows 0 for this one; a
        limit another client wrote that cannot be read limits nothing (logged). Adds to
        `waits` when a bucket holds less than one start."""
        rows = _rate_bucket_model(self.model).objects.db_manager(self.db)
        found: dict[str, tuple[float, datetime]] = {}
        for key in sorted(rates):
            try:
                rate, period = parse_rate(rates[key], "rate_limit")
            except ConfigurationError:
                logger.error(
                    "job rate limit unreadable key=%s limit=%r: not limited", key, rates[key]
                )
                continue
            locked = rows.locked(key)
            if locked is None:  # another worker is deciding this bucket's claim now
                found[key] = (-math.inf, datetime.min)  # allows none; never written
                waits.append(SLOT_RETRY_SECONDS)
                continue
            row, now = locked
            tokens = refilled(rate, period, row.tokens, row.refilled_at, now)
            found[key] = (tokens, now)
            if tokens < 1:
                waits.append((1 - tokens) * period / rate)
        return found

    def _lock_keys(self, keys: list[str]) -> dict[str, int]:
        """Try each key's advisory lock (`sql.TRY_KEY_LOCKS`); for the keys locked, the
        running jobs with a live lease, counted after the locks were taken."""
        if not keys:
            return {}
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.TRY_KEY_LOCKS, [keys])
            mine = [key for key, locked in cursor.fetchall() if locked]
        counted = (
            self.filter(state=JobState.RUNNING, concurrency_key__in=mine, leased_until__gt=Now())
            .order_by()
            .values_list("concurrency_key")
            .annotate(n=Count("id"))
        )
        return dict.fromkeys(mine, 0) | dict(counted)

    def _quarantine(self, job_id: int, state: str, why: str) -> None:
        """End a job that the protocol cannot move (its own write fails): failed, with `why`.

        In a savepoint, guarded by `state`; if even this fails, the error is logged and
        the row is left as it is.
        """
        why = redact_text(storable_text(why)[:8192])  # a database error may quote a row
        error = ErrorInfo(QUARANTINED, why)
        cap = get_settings().ERROR_HISTORY_LENGTH
        ended = {"state": JobState.FAILED, "finished_at": Now(), "leased_until": None}
        last: DatabaseError | None = None
        # With the reason in the history first; without it if the history itself is what
        # another client broke (not a JSON array).
        for written in ({"errors": _AppendCapped(F("errors"), error.entry(), cap)}, {}):
            try:
                with transaction.atomic(using=self.db):
                    self.filter(id=job_id, state=state).update(
                        **ended, **written, last_error=error.summary()
                    )
                logger.error("job failed id=%s: %s", job_id, why)
                return
            except DatabaseError as failure:
                if is_transient(failure):
                    raise
                last = failure
        logger.error(
            "job cannot be written id=%s: %s; then: %s", job_id, why, redact_text(str(last))
        )

    # -- enqueue: INSERTs in the caller's transaction ------------------------------------

    def build(self, spec: JobSpec, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Job:
        """An unsaved, checked Job for one call of `spec`. InvalidJobError before any SQL."""
        spec.check_call(args, kwargs)
        plain_args, plain_kwargs = normalize_arguments(
            args, kwargs, limit=get_settings().MAX_PAYLOAD_BYTES
        )
        self._check_room(spec, 1)
        job = self.model(**spec.columns(plain_args, plain_kwargs))
        if spec.run_after is not None:
            job.run_at = _run_at(spec.run_after)
        if spec.expires is not None:
            job.expires_at = _run_at(spec.expires)
        return job

    def _check_room(
        self, spec: JobSpec, adding: int, conf: SkipQueueSettings | None = None
    ) -> None:
        """The volume guards before any write (case S11, docs/explanation/failure-model.md):
        the spec's own bounds, then, with MAX_PENDING_PER_QUEUE, the queue's pending jobs,
        counted up to the cap only (an index scan of at most that many entries). `conf`:
        the settings the caller read already."""
        conf = conf or get_settings()
        spec.check_bounds(conf)
        self.check_room(spec.queue_name, adding, conf)

    def check_room(
        self, queue_name: str, adding: int, conf: SkipQueueSettings | None = None
    ) -> None:
        """With MAX_PENDING_PER_QUEUE, QueueFullError if `adding` more jobs would pass it
        (the queue's pending jobs counted up to the cap only)."""
        cap = (conf or get_settings()).MAX_PENDING_PER_QUEUE
        if cap is not None:
            pending = self.pending_up_to(queue_name, cap)
            if pending + adding > cap:
                raise QueueFullError(
                    f"queue {queue_name!r} holds {pending} pending jobs; adding {adding} "
                    f"would pass SKIPQUEUE['MAX_PENDING_PER_QUEUE'] ({cap})"
                )

    def enqueue(self, task: JobSpec, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Job:
        """INSERT one pending job of `task` in the caller's transaction and return it.

        One statement: `sql.ENQUEUE_ONE`, or `sql.ENQUEUE_MANY` for a job with a unique
        or concurrency key or a rate limit (their conflict and keyed paths live there);
        with a pre_save or post_save receiver connected for Job, the ORM's save(), so
        that the receivers see it.
        """
        receivers = has_receivers(signals.pre_save, self.model) or has_receivers(
            signals.post_save, self.model
        )
        plain = task.unique_key is None and not task.keyed
        if receivers and plain:
            job = self.build(task, args, kwargs)
            job.trace_context = tracing.enqueue_context(task.name, task.queue_name)
            job.save(force_insert=True, using=self.db)
            return job
        if not plain:
            return self.enqueue_many(task, [(args, kwargs)])[0]
        # Measured: one INSERT ... VALUES (sql.ENQUEUE_ONE), not the ORM's save(), which
        # compiles 20 fields per call, nor ENQUEUE_MANY's arrays; sent straight on libpq
        # where nothing can tell (db.direct.direct_row), its shared parameters encoded once
        # per spec.
        checked = self._checked(task, [(args, kwargs)])
        plain_args, plain_kwargs, args_json, kwargs_json = checked[0]
        trace = tracing.enqueue_context(task.name, task.queue_name)
        statement = sql.enqueue_one_statement(
            _insert_defaults(self.model), task.expires is not None, trace is not None
        )
        shared, base_row = _enqueue_parts(task, self.model)
        direct = None
        if shared is not None:
            params = shared | {"args": args_json, "kwargs": kwargs_json}
            if trace is not None:
                params["trace"] = json.dumps(trace)
            direct = direct_row(thread_connection(self.db), statement, params)
        if direct is not None:
            if not direct:
                raise _no_row_returned(task)
            try:
                job_id, created_at = binary_bigint(direct[0]), binary_timestamptz(direct[2])
                run_at = created_at if direct[1] == direct[2] else binary_timestamptz(direct[1])
            except OverflowError as exc:  # what psycopg's loader raises it as
                raise DataError(f"run_at {exc}: outside Python's years 1 to 9999") from exc
        else:
            params = self._insert_params(task, checked)
            params["args"], params["kwargs"] = args_json, kwargs_json
            if trace is not None:
                params["trace"] = json.dumps(trace)
            with job_cursor(self.db) as cursor:
                cursor.execute(statement, params)
                returned = fetch_one(cursor)
            if returned is None:
                raise _no_row_returned(task)
            job_id, run_at, created_at = returned
        own = {
            "id": job_id,
            "args": plain_args,
            "kwargs": plain_kwargs,
            "errors": [],
            "run_at": run_at,
            "created_at": created_at,
            "expires_at": _expires_at(task.expires, created_at),
            "trace_context": trace,
        }
        return loaded_job(self.model, self.db, _job_template(self.model)[0], base_row, own)

    @overload
    def enqueue_many(
        self,
        task: JobSpec,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int = ...,
        ids_only: Literal[False] = ...,
    ) -> list[Job]: ...

    @overload
    def enqueue_many(
        self,
        task: JobSpec,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int = ...,
        ids_only: Literal[True],
    ) -> list[int]: ...

    def enqueue_many(
        self,
        task: JobSpec,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int = 5000,
        ids_only: bool = False,
    ) -> list[Job] | list[int]:
        """INSERT a pending job of `task` per call, one statement per `batch_size`.

        See `Task.enqueue_many` for `ids_only`. Statements: `sql.ENQUEUE_MANY`, one per
        batch, in the caller's transaction; the returned jobs are built from what that
        statement returns (ids, run_at, created_at) and the checked calls.

        All or nothing: the batches run in one atomic() block (a savepoint in the
        caller's transaction), so a bad call deep in a stream leaves none of the jobs
        before it, and the caller's transaction goes on usable.
        """
        if batch_size < 1:
            raise InvalidJobError(f"batch_size must be at least 1, got {batch_size}")
        with transaction.atomic(using=self.db):
            return self._enqueue_many(task, calls, batch_size=batch_size, ids_only=ids_only)

    def _enqueue_many(
        self,
        task: JobSpec,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int,
        ids_only: bool,
    ) -> list[Job] | list[int]:
        if task.unique_key is not None:
            return self._enqueue_unique(task, calls, batch_size=batch_size, ids_only=ids_only)
        if ids_only:
            ids: list[int] = []
            for some in _batches(iter(calls), batch_size):
                inserted = self._insert(task, self._checked(task, some, first=len(ids)))[0]
                ids.extend(inserted)
            return ids
        checked = self._checked(task, list(calls))
        names, template = _job_template(self.model)
        template = template | task.shared_columns()
        jobs: list[Job] = []
        for start in range(0, len(checked), batch_size):
            batch = checked[start : start + batch_size]
            inserted, _, run_at, created_at, trace = self._insert(task, batch)
            shared = template | {
                "trace_context": trace,
                "run_at": run_at,
                "created_at": created_at,
                "expires_at": _expires_at(task.expires, created_at),
            }
            jobs.extend(
                loaded_jobs(
                    self.model,
                    self.db,
                    names,
                    (
                        shared
                        | {"id": job_id, "args": args, "kwargs": kwargs, "errors": []}
                        | task.key_columns(args, kwargs)
                        for (args, kwargs, _, _), job_id in zip(batch, inserted, strict=True)
                    ),
                )
            )
        return jobs

    def _enqueue_unique(
        self,
        task: JobSpec,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int,
        ids_only: bool,
    ) -> list[Job] | list[int]:
        """Unique jobs: each call's key (`Task.key_for`) either inserts a job or meets the
        unfinished job that holds it, and then `task.on_conflict` decides: "existing"
        returns that job, "replace" gives it this call's arguments and run time if it is
        still pending, "raise" raises DuplicateJobError.

        Statements, in the caller's transaction: per batch, the INSERT ... ON CONFLICT DO
        NOTHING (`sql.ENQUEUE_MANY`, unique form); for the keys it did not insert, the
        replace (`sql.REPLACE_PENDING`) and a lookup of the jobs holding them
        (`sql.UNFINISHED_WITH_KEYS`). A holder that finished in between frees its key:
        the call is inserted again, a few times at most. No statement fails on a
        conflict, so the caller's transaction is never aborted by one.
        """
        checked: list[Checked] = []
        for some in _batches(iter(calls), batch_size):  # checked as they come, for errors
            checked += self._checked(task, some, first=len(checked))
        keys = [task.key_for(args, kwargs) for args, kwargs, _, _ in checked]
        # One call per key, as if the calls were made one after another: the first for
        # "existing", the last for "replace", and "raise" on a repeat.
        chosen: dict[str, int] = {}
        for position, key in enumerate(keys):
            if key in chosen and task.on_conflict == "raise":
                raise DuplicateJobError(task.name, key, None)
            if key not in chosen or task.on_conflict == "replace":
                chosen[key] = position
        # The keys in one order across every batch, whoever inserts them: two
        # transactions enqueuing the same keys in opposite orders deadlocked on the key's
        # index when each batch alone was sorted (3 of 3, batches of 10).
        order = sorted(chosen)
        held: dict[str, int] = {}
        for start in range(0, len(order), batch_size):
            part = order[start : start + batch_size]
            holders = self._insert_unique(task, [checked[chosen[key]] for key in part], part)
            held.update(zip(part, holders, strict=True))
        ids = [held[key] for key in keys]
        if ids_only:
            return ids
        found = self.in_bulk(ids)
        return [found[job_id] for job_id in ids]

    def _insert_unique(self, task: JobSpec, checked: list[Checked], keys: list[str]) -> list[int]:
        """The ids of the jobs that now hold each key: inserted or already there."""
        holders: dict[str, int] = {}
        todo = list(range(len(checked)))
        for _ in range(5):
            if not todo:
                break
            batch = [checked[i] for i in todo]
            inserted, inserted_keys = self._insert(task, batch, [keys[i] for i in todo])[:2]
            holders.update(zip(inserted_keys, inserted, strict=True))
            fresh = set(inserted_keys)
            conflicts = list(dict.fromkeys(keys[i] for i in todo if keys[i] not in fresh))
            if conflicts and self._expire_holders(task.name, conflicts):
                continue  # a holder past its expiry, ended now: its key is free again
            if conflicts and task.on_conflict == "raise":
                found = self._holders(task, conflicts)
                key = conflicts[0]
                raise DuplicateJobError(task.name, key, found.get(key, (None, None))[0])
            if conflicts and task.on_conflict == "replace":
                last = {keys[i]: checked[i] for i in todo if keys[i] in conflicts}
                holders.update(self._replace_pending(task, last))
            found = self._holders(task, [key for key in conflicts if key not in holders])
            holders.update((key, job_id) for key, (job_id, _) in found.items())
            todo = [i for i in todo if keys[i] not in holders]
        if todo:
            raise DatabaseError(
                f"unique key {keys[todo[0]]!r} of {task.name}: its holder kept finishing "
                f"while a new job was inserted; try again"
            )
        return [holders[key] for key in keys]

    def _expire_holders(self, task_name: str, keys: list[str]) -> int:
        """End the holders of these keys that are past their expiry (never to run): an
        enqueue meeting one must not return a job the reaper is about to end. In the
        caller's transaction; how many were ended."""
        return _end_as_expired(self.filter(task=task_name, unique_key__in=keys).past_expiry())

    def _holders(self, task: JobSpec, keys: list[str]) -> dict[str, tuple[int, str]]:
        """{key: (id, state)} of the unfinished jobs of `task` holding `keys`."""
        if not keys:
            return {}
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.UNFINISHED_WITH_KEYS, [task.name, keys, list(UNFINISHED_STATES)])
            return {key: (job_id, state) for key, job_id, state in cursor.fetchall()}

    def _replace_pending(self, task: JobSpec, calls: dict[str, Checked]) -> dict[str, int]:
        """The pending holders of these keys take the calls' arguments and run time."""
        params = self._insert_params(task, list(calls.values()))
        params["keys"] = encode(list(calls))
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.REPLACE_PENDING, params)
            return dict(cursor.fetchall())

    def enqueue_occurrences(
        self,
        spec: JobSpec,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        schedule: str,
        instants: Sequence[datetime],
    ) -> int:
        """Insert a schedule's due occurrences (one call of `spec`, at each of `instants`),
        in the caller's transaction; returns how many were inserted.

        Each row comes from `spec.columns()`, as every enqueue's does, with the
        occurrence's instant as its run_at. An occurrence another worker inserted first
        (the occurrence constraint), or whose unique key an unfinished job holds, is
        skipped, each in a savepoint so that the transaction goes on.
        `MAX_PENDING_PER_QUEUE` holds for them as for any enqueue: an occurrence that
        would pass it is not enqueued, and a warning says so.
        """
        jobs = [
            self.model(
                **spec.columns(args, kwargs),
                run_at=instant,
                schedule=schedule,
                scheduled_for=instant,
                # A schedule's expiry is a delay after the occurrence's instant.
                expires_at=_expires_at(spec.expires, instant),
            )
            for instant in instants
        ]
        cap = get_settings().MAX_PENDING_PER_QUEUE
        inserted = 0
        for job in jobs:
            if cap is not None and self.pending_up_to(job.queue_name, cap) >= cap:
                logger.warning(
                    "schedule occurrence not enqueued schedule=%s at=%s: queue %s holds "
                    "SKIPQUEUE['MAX_PENDING_PER_QUEUE'] (%d) pending jobs",
                    job.schedule,
                    job.scheduled_for,
                    job.queue_name,
                    cap,
                )
                continue
            try:
                with transaction.atomic(using=self.db):
                    job.save(force_insert=True, using=self.db)
            except IntegrityError as error:
                if getattr(error.__cause__, "sqlstate", None) != UNIQUE_VIOLATION:
                    raise
                continue  # enqueued already, or its unique key is held
            inserted += 1
        return inserted

    # -- relayed queues: the table as the broker's outbox -----------------------------

    #: The columns a relayed job's message carries.
    MESSAGE_FIELDS = (
        "id", "task", "queue_name", "args", "kwargs", "attempts", "max_attempts", "lease"
    )  # fmt: skip

    def relayable(self, queues: Sequence[str], limit: int) -> list[Job]:
        """Due pending rows of relayed `queues`, in claim order, locked FOR NO KEY UPDATE
        SKIP LOCKED in the caller's transaction (the relay publishes them, waits for the
        broker's confirms, then marks or deletes them before it commits)."""
        return list(
            self.filter(queue_name__in=queues, state=JobState.PENDING, run_at__lte=Now())
            .unexpired()
            .order_by(*CLAIM_ORDER)
            .select_for_update(skip_locked=True, no_key=True)
            .only(*self.MESSAGE_FIELDS)[:limit]
        )

    def mark_relayed(self, ids: Sequence[int]) -> int:
        """RESULTS: published rows stay, `relayed`, until the consumer writes back."""
        return self.filter(id__in=ids, state=JobState.PENDING).update(
            state=JobState.RELAYED, started_at=Now()
        )

    def delete_relayed(self, ids: Sequence[int]) -> None:
        """Published rows, without RESULTS: gone once the broker holds their messages.
        A raw DELETE: the ORM's delete() would collect related rows first (a query)."""
        self.filter(id__in=ids)._raw_delete(self.db)

    def fail_unrelayable(self, job_id: int, error: str) -> int:
        """A pending row whose arguments cannot travel ends failed with `error`."""
        return self.filter(id=job_id, state=JobState.PENDING).update(
            state=JobState.FAILED, last_error=error, finished_at=Now()
        )

    def write_back(self, params: Sequence[Any]) -> None:
        """RESULTS: the final outcomes of brokered jobs onto their `relayed` rows, in one
        statement (`sql.WRITE_BACK`), in a transaction of its own."""
        with transaction.atomic(using=self.db), connections[self.db].cursor() as cursor:
            cursor.execute(sql.WRITE_BACK, list(params))

    def pending_up_to(self, queue_name: str, cap: int) -> int:
        """Pending jobs of a queue, counted up to `cap` only (`sql.COUNT_PENDING_UP_TO`)."""
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.COUNT_PENDING_UP_TO, [queue_name, cap])
            return int(cursor.fetchone()[0])

    def _checked(
        self,
        task: JobSpec,
        calls: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        first: int = 0,
    ) -> list[Checked]:
        """Each call bound to the task's signature and encoded, then the volume guards.
        `first`: the index of the first of `calls` among the caller's, for errors."""
        settings = get_settings()
        limit = settings.MAX_PAYLOAD_BYTES
        keyed = task.unique_key is not None or task.keyed
        if keyed and settings.RELAY and task.queue_name in relayed_queues():
            raise InvalidJobError(
                f"queue {task.queue_name!r} is relayed to RabbitMQ, which keeps no unique or "
                f"concurrency key and no rate limit: enqueue {task.name} with its key or "
                f"limit on a queue of the job table, or without them"
            )
        checked: list[Checked] = []
        for call in calls:
            index = first + len(checked)
            args, kwargs = _call_pair(task.name, call, index)
            try:
                task.check_call(args, kwargs)
                checked.append(encode_arguments(args, kwargs, limit=limit))
            except InvalidJobError as error:
                if len(calls) > 1 or first:  # enqueue_many: which call, of thousands
                    error.args = (f"call {index}: {error}", *error.args[1:])
                raise
        self._check_room(task, len(checked), settings)
        return checked

    def _insert(
        self, task: JobSpec, batch: Sequence[Checked], keys: Sequence[str] | None = None
    ) -> tuple[list[int], list[str], datetime, datetime, dict[str, str] | None]:
        """One INSERT of checked calls: the ids inserted, their unique keys (with `keys`:
        conflicting calls insert nothing), the run_at and created_at they share, and the
        trace context stored with them."""
        params = self._insert_params(task, batch)
        if keys is not None:
            params["keys"] = encode(list(keys))
        trace = tracing.enqueue_context(task.name, task.queue_name, len(batch))
        if trace is not None:
            params["trace"] = json.dumps(trace)
        keyed = task.keyed
        if keyed:
            columns = [task.key_columns(args, kwargs) for args, kwargs, _, _ in batch]
            params["concurrency_keys"] = encode([one["concurrency_key"] for one in columns])
            params["concurrency_limit"] = columns[0]["concurrency_limit"] if columns else 1
        statement = sql.enqueue_many_statement(
            _insert_defaults(self.model),
            keys is not None,
            keyed,
            task.expires is not None,
            task.rate_limit is not None,
            trace is not None,
        )
        with job_cursor(self.db) as cursor:
            cursor.execute(statement, params)
            ids, inserted_keys, run_at, created_at = fetch_one(cursor)[:4]
        return ids, inserted_keys, run_at, created_at, trace

    @staticmethod
    def _insert_params(task: JobSpec, batch: Sequence[Checked]) -> dict[str, Any]:
        shared = task.shared_columns()
        return {
            "task": shared["task"],
            "queue": shared["queue_name"],
            "priority": shared["priority"],
            "run_at": task.run_after if isinstance(task.run_after, datetime) else None,
            "delay": task.run_after if isinstance(task.run_after, timedelta) else timedelta(0),
            "lease": shared["lease"],
            "max_attempts": shared["max_attempts"],
            "expires_at": task.expires if isinstance(task.expires, datetime) else None,
            "expires_in": task.expires if isinstance(task.expires, timedelta) else None,
            "rate_key": task.rate_key,
            "rate_limit": task.rate_limit,
            # One JSON array text per column, not a text[] of one element per call:
            # psycopg dumps a list element by element (measured: a sixth of a bulk enqueue).
            "args": "[" + ", ".join(args_json for _, _, args_json, _ in batch) + "]",
            "kwargs": "[" + ", ".join(kwargs_json for _, _, _, kwargs_json in batch) + "]",
        }

    def ack(self, job_id: int, attempt: int, result: JSONValue = None) -> bool:
        """Mark done only if `attempt` still holds the lease. False: this attempt lost it.

        The one-row case of `ack_many` (one fenced UPDATE), in autocommit or in the
        caller's transaction.
        """
        return job_id in self.ack_many([(job_id, attempt, result)])

    def lock_workflows_of(self, ids: Sequence[int]) -> None:
        """Lock the workflows of these jobs (FOR NO KEY UPDATE, in id order), in the
        caller's transaction, before it changes the jobs' state (`sql.LOCK_WORKFLOWS_OF`:
        the one order every such write takes, so none deadlocks with another)."""
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.LOCK_WORKFLOWS_OF, [list(ids)])

    def ack_many(
        self,
        acks: Sequence[tuple[int, int, JSONValue]],
        *,
        errors: dict[int, DatabaseError] | None = None,
        workflows: bool = False,
    ) -> set[int]:
        """Fenced acks of several jobs in one statement: (job id, attempt, result) each.

        Each row is fenced on its own (`sql.ACK_MANY`: the same WHERE as `ack`), so one
        stale attempt changes nothing but itself. Returns the ids marked done; any other
        id's attempt had lost its lease, or (with `errors`) is listed there with the
        database error its own ack raised.

        If the statement fails other than by the connection (one row's result breaks a
        constraint, say), each row is acknowledged alone, in a savepoint, so that one
        bad row cannot fail the others. Without `errors`, a row's error is raised.

        `workflows`: some of the jobs belong to a workflow. The ack then runs in a
        transaction that locks their workflows first (`lock_workflows_of`).
        """
        if not acks:
            return set()
        texts = [None if r is None else encode(r) for _, _, r in acks]
        try:
            params = _ack_parameters(acks, texts)
            with (
                _workflows_first(self, [a[0] for a in acks], workflows),
                _savepoint_if_in_transaction(self.db),
                job_cursor(self.db) as cursor,
            ):
                cursor.execute(sql.ACK_MANY, params)
                return {row[0] for row in fetch_all(cursor)}
        except DatabaseError as error:
            if is_transient(error) or (len(acks) == 1 and errors is None):
                raise
            if len(acks) == 1:
                errors[acks[0][0]] = error  # type: ignore[index]
                return set()
            logger.error("batched ack failed, acknowledging row by row: %s", error)
        done: set[int] = set()
        for (job_id, attempt, _), text in zip(acks, texts, strict=True):
            try:
                with transaction.atomic(using=self.db), connections[self.db].cursor() as cursor:
                    if workflows:
                        self.lock_workflows_of([job_id])
                    cursor.execute(sql.ACK_MANY, _ack_parameters([(job_id, attempt, None)], [text]))
                    done.update(row[0] for row in cursor.fetchall())
            except DatabaseError as error:
                if is_transient(error) or errors is None:
                    raise
                errors[job_id] = error
        return done

    def renew(self, job_id: int, attempt: int, lease: timedelta | None = None) -> bool:
        """Extend the lease to now + `lease` (the job's own by default). False: it was
        lost, or a cancel was requested (see `renewal`)."""
        return self.renewal(job_id, attempt, lease) is Renewal.RENEWED

    def renew_many(self, held: Sequence[tuple[int, int]]) -> set[int]:
        """Renew the leases of several held attempts, (job id, attempt) each, by their
        jobs' own leases, in one statement (`sql.RENEW_MANY`): each row fenced on its own
        as `renewal` fences it. Returns the ids renewed; an id not returned was lost, has
        a cancel request or was locked by another session (`holding_many` tells which)."""
        params = {"min_lease": MIN_LEASE, "max_lease": MAX_LEASE}
        return self._fenced_many(sql.RENEW_MANY, held, params)

    def holding_many(self, held: Sequence[tuple[int, int]]) -> dict[int, bool]:
        """Of several attempts, (job id, attempt) each, those that still hold their job
        (the fence of `holding`): id -> whether a cancel was requested. One read, no
        lock: after `renew_many`, it tells a lease lost (absent) from a cancel request
        (True) and from a row that was locked elsewhere (False), for all the rest at
        once; two queries a job fell behind after a frozen worker lost 1,000 leases."""
        if not held:
            return {}
        attempts = {int(job_id): int(attempt) for job_id, attempt in held}
        rows = self.filter(
            _state_is(JobState.RUNNING), id__in=list(attempts), leased_until__gt=Now()
        ).values_list("id", "attempts", "cancel_requested_at")
        return {
            job_id: requested is not None
            for job_id, attempt, requested in rows
            if attempts[job_id] == attempt
        }

    def release_many(self, held: Sequence[tuple[int, int]]) -> set[int]:
        """`release` (without a delay) of several held attempts, (job id, attempt) each,
        in one statement (`sql.RELEASE_MANY`), each row fenced on its own. Returns the
        ids released; `release` of any other one tells a cancel request (it ends
        cancelled) from a lost lease."""
        return self._fenced_many(sql.RELEASE_MANY, held, {})

    def _fenced_many(
        self, statement: str, held: Sequence[tuple[int, int]], params: dict[str, Any]
    ) -> set[int]:
        """Run one of the statements written for many held attempts (`ids`, and
        `attempts` as one JSON object by id, as `sql.ACK_MANY` takes them); the ids
        it returns."""
        if not held:
            return set()
        fence = _ack_parameters(
            [(job_id, attempt, None) for job_id, attempt in held], [None] * len(held)
        )
        del fence["results"]  # the ids and attempts only, encoded as the ack's
        params = {**params, **fence}
        with connections[self.db].cursor() as cursor:
            cursor.execute(statement, params)
            return {row[0] for row in cursor.fetchall()}

    def renewal(
        self,
        job_id: int,
        attempt: int,
        lease: timedelta | None = None,
        *,
        keep_if_cancelled: bool = False,
    ) -> Renewal:
        """Extend the lease to now + `lease` (the job's own by default), unless a cancel
        was requested: then the lease is left to run out (a task that ignores the
        request loses the job at the end of it). With `keep_if_cancelled` (a job that
        holds a concurrency slot), the lease is extended all the same and
        CANCEL_REQUESTED returned: its slot stays taken while its code runs.

        Never shortens it: a lease that the task extended further (`extend_lease`) is
        kept. The job's own lease is clamped to MIN_LEASE..MAX_LEASE, whoever wrote it.
        One fenced UPDATE; a second query only when it changed nothing, to tell a
        requested cancel from a lost lease.
        """
        if lease is not None:
            wanted: Expression = Value(lease)
        else:
            wanted = Least(Greatest(F("lease"), Value(MIN_LEASE)), Value(MAX_LEASE))
        until = Greatest(F("leased_until"), Now() + wanted)
        fenced = self.holding(job_id, attempt)
        if fenced.filter(cancel_requested_at__isnull=True).update(leased_until=until):
            return Renewal.RENEWED
        if self.cancel_requested(job_id, attempt):
            if keep_if_cancelled and not fenced.update(leased_until=until):
                return Renewal.LOST
            return Renewal.CANCEL_REQUESTED
        return Renewal.LOST

    def queue_gauges(self) -> dict[str, dict[str, float]]:
        """Per queue: jobs pending and due, scheduled, waiting, running and stuck, and
        the age in seconds of the oldest due job (database clock). Read only from the
        partial indexes of unfinished jobs, never the finished ones: the cost follows
        the backlog, not the table."""
        gauges: dict[str, dict[str, float]] = {}
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.QUEUE_GAUGES)
            for name, due, scheduled, running, stuck, oldest in cursor.fetchall():
                gauges[name] = {
                    "pending_due": due,
                    "scheduled": scheduled,
                    "running": running,
                    "stuck": stuck,
                    "waiting": 0,
                    "oldest_due_seconds": float(oldest or 0.0),
                }
            cursor.execute(sql.WAITING_BY_QUEUE)
            for name, waiting in cursor.fetchall():
                gauges.setdefault(name, dict.fromkeys(GAUGE_NAMES, 0.0))["waiting"] = waiting
        return gauges

    def report_progress(self, job_id: int, attempt: int, progress: dict[str, Any]) -> bool:
        """Write a running attempt's progress (`context.set_progress()`), with the
        attempt and the database's time ("at"). Fenced like an ack: False means this attempt no
        longer holds the job, and nothing was written."""
        fields = {key: _json_argument(value) for key, value in progress.items()}
        stamped = JSONObject(**fields, attempt=Value(attempt), at=Now())
        return self.holding(job_id, attempt).update(progress=stamped) == 1

    def cancel_requested(self, job_id: int, attempt: int) -> bool:
        """Whether an operator asked this attempt, still held, to stop (one read)."""
        return self.holding(job_id, attempt).filter(cancel_requested_at__isnull=False).exists()

    def end_cancelled(self, job_id: int, attempt: int, *, workflow: bool = False) -> bool:
        """The attempt stopped on a cancel request: the job ends cancelled, never to be
        retried. One fenced UPDATE; False: the attempt had lost the job. `workflow`: the
        job is a workflow's, whose row is locked first (`lock_workflows_of`)."""
        with _workflows_first(self, [job_id], workflow):
            return (
                self.holding(job_id, attempt).update(
                    state=JobState.CANCELLED, finished_at=Now(), leased_until=None
                )
                == 1
            )

    def fail(
        self,
        job_id: int,
        attempt: int,
        *,
        error: ErrorInfo,
        retry_in: timedelta | None,
        workflow: bool = False,
    ) -> JobState | None:
        """Record `error` for this attempt, then retry after `retry_in` or end failed.

        With `retry_in` None the error is not retryable and the job fails at once.
        Otherwise it goes back to pending, due after `retry_in`, if an attempt is left.
        A job whose cancel was requested is not retried: it ends cancelled (the error is
        kept). At most three fenced UPDATEs, the third only after a cancel request.
        Returns the new state, or None if this attempt had lost the lease (nothing
        written). `workflow`: the job is a workflow's, whose row is locked first, in one
        transaction with the writes (`lock_workflows_of`).
        """
        with _workflows_first(self, [job_id], workflow):
            return self._fail(job_id, attempt, error=error, retry_in=retry_in)

    def _fail(
        self, job_id: int, attempt: int, *, error: ErrorInfo, retry_in: timedelta | None
    ) -> JobState | None:
        history = _AppendCapped(F("errors"), error.entry(), get_settings().ERROR_HISTORY_LENGTH)
        if retry_in is not None:
            retry_in = clamped_delay(retry_in)
        fenced = self.holding(job_id, attempt)
        written = {"errors": history, "last_error": error.summary(), "leased_until": None}
        uncancelled = fenced.filter(cancel_requested_at__isnull=True)
        if retry_in is not None:
            retried = uncancelled.filter(attempts__lt=F("max_attempts")).update(
                state=JobState.PENDING, run_at=Now() + Value(retry_in), **written
            )
            if retried:
                return JobState.PENDING
        if uncancelled.update(state=JobState.FAILED, finished_at=Now(), **written):
            return JobState.FAILED
        cancelled = fenced.update(state=JobState.CANCELLED, finished_at=Now(), **written)
        return JobState.CANCELLED if cancelled else None

    def release(self, job_id: int, attempt: int, *, delay: timedelta = timedelta(0)) -> bool:
        """Give the attempt back: pending again after `delay`, without spending an attempt.

        `attempts` is the fence and never goes down, so the attempt is given back by
        raising `max_attempts` by one; `releases` counts it. One fenced UPDATE; a job
        whose cancel was requested ends cancelled instead (a second one).
        """
        return self.give_back(job_id, attempt, delay=delay) or self.end_cancelled(job_id, attempt)

    def give_back(self, job_id: int, attempt: int, *, delay: timedelta = timedelta(0)) -> bool:
        """`release` without its second step: False where the job was asked to stop (it
        stays running for `end_cancelled`) or the attempt had lost it."""
        fenced = self.holding(job_id, attempt)
        return (
            fenced.filter(cancel_requested_at__isnull=True).update(
                state=JobState.PENDING,
                run_at=Now() + Value(clamped_delay(delay)),
                leased_until=None,
                max_attempts=F("max_attempts") + 1,
                releases=F("releases") + 1,
            )
            == 1
        )

    def reap(self) -> ReapResult:
        """Take back running jobs whose lease ran out; count each expiry once.

        Two UPDATEs, each deciding and writing in one statement whose WHERE re-checks
        `state = 'running'` and the lease (so a job acked, failed or reaped meanwhile is
        left alone, and two reapers never count a job twice): jobs with an attempt left
        go back to pending, due now; the others end failed.
        """
        # Per queue, for the metrics; the lease index serves it (usually no row).
        by_queue = dict(self.expired().order_by().values_list("queue_name").annotate(n=Count("id")))
        try:
            with transaction.atomic(using=self.db):  # a savepoint in the caller's
                if by_queue:  # their workflows first, as every writer takes them
                    self._lock_workflows_of_set(self.expired())
                result = self._reap(self.expired())
        except DatabaseError as error:
            if is_transient(error):
                raise
            logger.error("reap failed, reaping row by row: %s", error)
            result = self._reap_row_by_row()
        if result.total:
            result = dataclasses.replace(result, by_queue=by_queue)
            logger.warning(
                "leases expired requeued=%d failed=%d cancelled=%d",
                result.requeued,
                result.failed,
                result.cancelled,
            )
        expired, deadline = 0, time.monotonic() + EXPIRE_PASS_SECONDS
        while True:  # a mass expiry is ended in batches, for up to EXPIRE_PASS_SECONDS
            ended = self.end_expired()
            expired += ended
            if ended < EXPIRE_BATCH_SIZE or time.monotonic() >= deadline:
                break
        if expired:
            logger.warning("jobs expired before they started count=%d", expired)
            result = dataclasses.replace(result, expired=expired)
        return result

    def end_expired(self, limit: int = EXPIRE_BATCH_SIZE) -> int:
        """End cancelled (`cancelled_by` EXPIRED) up to `limit` unstarted jobs whose
        `expires_at` has come, oldest expiry first; returns how many. No claim starts
        such a job (`unexpired()`): this only gives it its visible end. One UPDATE whose
        WHERE re-checks the state and the expiry; rows another transaction holds are
        skipped, left to the next pass. A workflow's job ended so cancels what waits on
        it, as any cancel does (the workflow trigger)."""
        chosen = (
            self.past_expiry()
            .order_by("expires_at")
            .select_for_update(skip_locked=True, no_key=True)
            .values("id")[:limit]
        )
        with transaction.atomic(using=self.db):
            self._lock_workflows_of_set(self.past_expiry())  # before the jobs' rows
            return _end_as_expired(self.filter(id__in=chosen).past_expiry())

    def _lock_workflows_of_set(self, jobs: JobQuerySet) -> None:
        """`lock_workflows_of` for the jobs of a set, read in the same statement (the
        reaper's: which jobs expired is known only to the statement that reaps them;
        one that expires between the two is reaped without its workflow locked first)."""
        workflow = self.model._meta.get_field("workflow").related_model
        assert workflow is not None and not isinstance(workflow, str)  # noqa: S101
        list(
            workflow._default_manager.db_manager(self.db)
            .filter(id__in=jobs.filter(workflow_id__isnull=False).values("workflow_id"))
            .order_by("id")
            .select_for_update(no_key=True)
            .values_list("id", flat=True)
        )

    def _reap(self, jobs: JobQuerySet) -> ReapResult:
        """Reap the expired jobs among `jobs`: each UPDATE's WHERE is `reapable()`'s,
        so a job of the set that is not running with an expired lease is never written."""
        cap = get_settings().ERROR_HISTORY_LENGTH
        written = {
            "leased_until": None,
            "expirations": F("expirations") + 1,
            "errors": _AppendCapped(F("errors"), LEASE_EXPIRED.entry(), cap),
            "last_error": LEASE_EXPIRED.summary(),
        }
        to_pending, to_failed, to_cancelled = jobs.reapable()
        cancelled = to_cancelled.update(
            state=JobState.CANCELLED,
            finished_at=Now(),
            leased_until=None,
            expirations=F("expirations") + 1,
        )
        requeued = to_pending.update(state=JobState.PENDING, run_at=Now(), **written)
        failed = to_failed.update(state=JobState.FAILED, finished_at=Now(), **written)
        return ReapResult(requeued=requeued, failed=failed, cancelled=cancelled)

    def _reap_row_by_row(self, batch_size: int = 1000) -> ReapResult:
        """The reap after its batched statements failed: each expired row in a savepoint.

        A row that cannot be reaped ends failed with the database's error instead.
        """
        requeued = failed = cancelled = 0
        for job_id in self.expired().values_list("id", flat=True)[:batch_size]:
            try:
                with transaction.atomic(using=self.db):
                    one = self._reap(self.filter(id=job_id))
                requeued, failed = requeued + one.requeued, failed + one.failed
                cancelled += one.cancelled
            except DatabaseError as error:
                if is_transient(error):
                    raise
                self._quarantine(job_id, JobState.RUNNING, f"the reap failed: {error}")
                failed += 1
        return ReapResult(requeued=requeued, failed=failed, cancelled=cancelled)

    # -- operator actions (the admin's), each guarded and done in bounded batches ------

    def retry_now(self, ids: Iterable[int], *, batch_size: int = 1000) -> int:
        """Failed or cancelled jobs back to pending, due now; returns how many changed.

        A unique job is skipped while another unfinished job of its task holds its key;
        of several given jobs sharing a key, the newest is retried and the others are
        skipped (two would break the key's unique index).

        The WHERE re-checks the state, so a job that changed meanwhile is skipped. An
        attempt is added when none is left (`attempts` itself never goes down).
        """

        def retry(batch: list[int]) -> int:
            return (
                self.filter(id__in=batch)
                .retryable()  # a unique job whose key is held stays as it is
                .update(
                    state=JobState.PENDING,
                    run_at=Now(),
                    finished_at=None,
                    cancel_requested_at=None,
                    cancelled_by="",
                    expires_at=None,  # an operator's retry runs it, late or not
                    max_attempts=Greatest(F("max_attempts"), F("attempts") + 1),
                )
            )

        def write(batch: list[int]) -> int:
            with transaction.atomic(using=self.db):
                self.lock_workflows_of(batch)
                return write_locked(batch)

        def write_locked(batch: list[int]) -> int:
            newest: dict[tuple[str, str], int] = {}
            plain: list[int] = []
            rows = self.filter(id__in=batch).retryable().values_list("id", "task", "unique_key")
            for job_id, task_name, key in sorted(rows):
                if key is None:
                    plain.append(job_id)
                else:
                    newest[(task_name, key)] = job_id
            chosen = plain + sorted(newest.values())
            try:
                with transaction.atomic(using=self.db):
                    return retry(chosen)
            except IntegrityError:  # a key taken meanwhile by a concurrent enqueue
                changed = 0
                for job_id in chosen:
                    try:
                        with transaction.atomic(using=self.db):
                            changed += retry([job_id])
                    except IntegrityError:
                        continue
                return changed

        return self._in_batches(ids, batch_size, write)

    def cancel(self, ids: Iterable[int], *, by: str = "", batch_size: int = 1000) -> int:
        """Pending and waiting jobs end cancelled; running ones are asked to stop
        (`cancel_requested_at`: the worker's next lease renewal tells the task, which ends
        the job cancelled, or loses it at the end of its lease and the reaper ends it
        cancelled). Returns how many were cancelled or asked. Each write re-checks the
        state it expects."""
        who = by[:ACTOR_MAX_LENGTH]

        def write(batch: list[int]) -> int:
            with transaction.atomic(using=self.db):
                self.lock_workflows_of(batch)  # before the jobs, as every writer does
                return write_locked(batch)

        def write_locked(batch: list[int]) -> int:
            pending = self.filter(
                id__in=batch, state__in=[JobState.PENDING, JobState.WAITING]
            ).update(state=JobState.CANCELLED, finished_at=Now(), cancelled_by=who)
            running = self.filter(
                _state_is(JobState.RUNNING), id__in=batch, cancel_requested_at__isnull=True
            ).update(cancel_requested_at=Now(), cancelled_by=who)
            return pending + running

        return self._in_batches(ids, batch_size, write)

    def requeue(self, ids: Iterable[int], *, batch_size: int = 1000) -> int:
        """Stuck jobs (running, lease expired) back to pending now, counted as an expiry.

        The same guard as the reaper: a job acked or renewed meanwhile is left alone.
        """
        return self._in_batches(
            ids,
            batch_size,
            lambda batch: (
                self.expired()
                .filter(id__in=batch, cancel_requested_at__isnull=True)  # the reaper ends those
                .update(
                    state=JobState.PENDING,
                    run_at=Now(),
                    leased_until=None,
                    expirations=F("expirations") + 1,
                    max_attempts=Greatest(F("max_attempts"), F("attempts") + 1),
                )
            ),
        )

    @staticmethod
    def _in_batches(ids: Iterable[int], size: int, write: Callable[[list[int]], int]) -> int:
        ids = list(ids)
        return sum(write(ids[start : start + size]) for start in range(0, len(ids), size))


_LOCKING: dict[tuple[Any, ...], tuple[str, tuple[Any, ...]]] = {}
_BOUND_CLAIMS: dict[tuple[Any, ...], str] = {}  # JobManager._bound_claim


def _locking_query(
    manager: JobManager, queues: tuple[str, ...], limit: int
) -> tuple[str, tuple[Any, ...]]:
    """The compiled SQL and parameters of `claimable(queues)[:limit]`, selecting ids.

    The same arguments compile to the same SQL and parameters, so it is done once, in
    `transaction.atomic()` (Django compiles a locking query only in a transaction);
    after that a claim costs no compiling and no atomic() (measured: with either, the
    cost per job of a claim of 16 rose by 10 to 40 %; benchmarks/run.py --parts
    claimpath).
    """
    key = (manager.model, manager.db, connections[manager.db].vendor, queues, limit)
    compiled = _LOCKING.get(key)
    if compiled is None:
        with transaction.atomic(using=manager.db):
            locking = manager.claimable(queues).values("id")[:limit]
            sql_text, params = locking.query.get_compiler(manager.db).as_sql()
        if len(_LOCKING) >= 1024:  # bounded: limits and queue sets are few in practice
            _LOCKING.clear()
        compiled = _LOCKING[key] = (sql_text, tuple(params))
    return compiled


def _rate_bucket_model(job_model: type[Job]) -> type[RateBucket]:
    """The RateBucket model, from the app registry (models.py imports this module)."""
    model: type[RateBucket] = job_model._meta.apps.get_model(
        job_model._meta.app_label, "RateBucket"
    )
    return model


def _queue_model(job_model: type[Job]) -> type[Queue]:
    """The Queue model, from the app registry (models.py imports this module)."""
    queue: type[Queue] = job_model._meta.apps.get_model(job_model._meta.app_label, "Queue")
    return queue


def in_process_claimer() -> str:
    """What `worker_ids` records for an attempt claimed without a worker (run_jobs, a
    script): this host and process."""
    return f"in-process:{socket.gethostname()}:{os.getpid()}"


@functools.cache
def _job_template(model: type[Job]) -> tuple[list[str], dict[str, Any]]:
    """The concrete attnames of `model`, and a row of them holding each field's default
    (None where it has none): what an enqueued job holds before its own columns. Fields
    whose default is a callable (args, kwargs, errors: a new list or dict) are set by
    every enqueue itself; the template's copies are never handed out."""
    fields = model._meta.concrete_fields
    names = [field.attname for field in fields]
    defaults = {field.attname: field.get_default() for field in fields if field.has_default()}
    return names, dict.fromkeys(names) | defaults


@contextlib.contextmanager
def _workflows_first(manager: JobManager, ids: Sequence[int], wanted: bool) -> Iterator[None]:
    """With `wanted`, a transaction around the block that first locks the workflows of
    `ids` (`JobManager.lock_workflows_of`); without, nothing: a job of no workflow pays
    no statement and no transaction."""
    if not wanted:
        yield
        return
    with transaction.atomic(using=manager.db):
        manager.lock_workflows_of(ids)
        yield


def _no_row_returned(spec: JobSpec) -> DatabaseError:
    return DatabaseError(
        f"the INSERT of a job of {spec.name} returned no row: a BEFORE INSERT trigger on "
        f"skipqueue_job that skips rows? Jobs must be written as they are enqueued"
    )


def _enqueue_parts(
    spec: JobSpec, model: type[Job]
) -> tuple[dict[str, bytes | None] | None, dict[str, Any]]:
    """What every enqueue of `spec` shares, kept on the spec: its INSERT's parameters
    other than the call's own, in the text form `db.direct.direct_row` sends (None where
    one has none), and the job row before the call's own columns."""
    cached = spec.__dict__.get("_skipqueue_enqueue_parts")
    if cached is not None and cached[0] is model:
        return cached[1], cached[2]
    params = JobManager._insert_params(spec, [])
    del params["args"], params["kwargs"]
    parts = (model, text_parameters(params), _job_template(model)[1] | spec.shared_columns())
    object.__setattr__(spec, "_skipqueue_enqueue_parts", parts)  # JobSpec is frozen
    return parts[1], parts[2]


@functools.cache
def _insert_defaults(model: type[Job]) -> tuple[tuple[str, object], ...]:
    """The model's defaults of the columns `sql.ENQUEUE_MANY` fills with them (the model
    fields are their one source), as (column, value) for `sql.enqueue_many_statement`."""
    fields = {field.name: field for field in model._meta.concrete_fields}
    values = {name: fields[name].get_default() for name in sql.ENQUEUE_DEFAULTS}
    values |= {"state": str(values["state"]), "errors": encode(values["errors"])}
    return tuple(values.items())


@functools.cache
def _columns(model: type[Job]) -> tuple[str, ...]:
    return tuple(field.column for field in model._meta.concrete_fields if field.column)


def _batches(calls: Iterator[T], size: int) -> Iterator[list[T]]:
    while batch := list(itertools.islice(calls, size)):
        yield batch


def _savepoint_if_in_transaction(alias: str) -> Any:
    """A savepoint inside the caller's transaction (so a failed statement does not abort
    it); nothing in autocommit, where each statement is its own transaction."""
    if connections[alias].in_atomic_block:
        return transaction.atomic(using=alias)
    return contextlib.nullcontext()


def clamped_delay(delay: timedelta) -> timedelta:
    """A retry's or a release's delay held to 0..MAX_DELAY_SECONDS: a huge one (a policy
    with a cap of 1e13 seconds) would overflow the database's timestamp, and the write
    that records the attempt's real error would fail with it."""
    ceiling = timedelta(seconds=get_settings().MAX_DELAY_SECONDS)
    return max(min(delay, ceiling), timedelta(0))


def _end_as_expired(jobs: JobQuerySet) -> int:
    """End `jobs` (a `past_expiry()` set, which the UPDATE's WHERE re-checks) cancelled,
    by EXPIRED, the expiry in `last_error`; how many."""
    return jobs.update(
        state=JobState.CANCELLED,
        finished_at=Now(),
        leased_until=None,
        cancelled_by=EXPIRED,
        last_error=Concat(
            Value("expired: not started by "),
            Cast(F("expires_at"), output_field=models.TextField()),
        ),
    )


def _expires_at(expires: datetime | timedelta | None, start: datetime) -> datetime | None:
    """The `expires_at` of a job enqueued (or scheduled) at `start`, a database time."""
    if isinstance(expires, timedelta):
        return start + expires
    return expires


def _run_at(run_after: datetime | timedelta) -> datetime | Expression:
    if isinstance(run_after, timedelta):
        return Now() + Value(run_after)
    return run_after


def dead_after() -> timedelta:
    """How long without a heartbeat before a worker counts as dead (WORKER_DEAD_AFTER_SECONDS)."""
    return timedelta(seconds=get_settings().WORKER_DEAD_AFTER_SECONDS)


class WorkerProcessQuerySet(models.QuerySet["WorkerProcess"]):
    def alive(self, within: timedelta | None = None) -> WorkerProcessQuerySet:
        """Workers whose heartbeat is newer than `within` (default: `dead_after()`), on the
        database clock."""
        return self.filter(heartbeat_at__gte=Now() - Value(within or dead_after()))

    def dead(self, after: timedelta) -> WorkerProcessQuerySet:
        return self.filter(heartbeat_at__lt=Now() - Value(after))


class WorkerProcessManager(models.Manager.from_queryset(WorkerProcessQuerySet)):  # type: ignore[misc]
    """The worker registry's verbs; each one statement."""

    def register(
        self, *, queues: Sequence[str], concurrency: int, kind: str = "worker"
    ) -> WorkerProcess:
        """The row of a worker starting in this process (hostname, pid, queues); `kind`
        is a WorkerKind: a claiming worker, a broker consumer or a relay."""
        return self.create(
            hostname=socket.gethostname()[:255],
            pid=os.getpid(),
            queues=list(queues),
            concurrency=concurrency,
            kind=kind,
        )

    def mark_stopped(self, worker_id: uuid.UUID) -> None:
        """A worker stopped cleanly: `stopped_at` says so, and its heartbeat is set as old
        as a dead one's, at once."""
        self.filter(id=worker_id).update(
            heartbeat_at=Now() - dead_after(), stopped_at=Now(), waiting_since=None
        )

    def set_waiting(self, worker_id: uuid.UUID, waiting: bool) -> None:
        """The worker waits for a NOTIFY of its queues from now (`waiting`), or no longer
        (runtime/waiting.py); a stopped worker's row is left as it is."""
        rows = self.filter(id=worker_id, stopped_at__isnull=True)
        if waiting:
            rows.filter(waiting_since__isnull=True).update(waiting_since=Now())
        else:
            rows.filter(waiting_since__isnull=False).update(waiting_since=None)

    def forget_waiting_of_dead(self) -> int:
        """Dead workers wait for nothing: their flags would keep every enqueue of their
        queues notifying (the reaper's pass). Returns how many were cleared."""
        waiting = self.filter(waiting_since__isnull=False)
        return waiting.dead(dead_after()).update(waiting_since=None)


class ScheduleQuerySet(models.QuerySet["Schedule"]):
    def active(self) -> ScheduleQuerySet:
        return self.filter(paused_at__isnull=True)

    def paused(self) -> ScheduleQuerySet:
        return self.filter(paused_at__isnull=False)


class ScheduleManager(models.Manager.from_queryset(ScheduleQuerySet)):  # type: ignore[misc]
    """An operator's verbs on schedules; the scheduler's are in scheduler.py."""

    def pause(self, names: Iterable[str], *, by: str = "") -> int:
        """Stop enqueuing these schedules' occurrences until resumed; returns how many
        were running. Occurrences passed while paused are not run on resume."""
        return self.filter(name__in=list(names), paused_at__isnull=True).update(
            paused_at=Now(), paused_by=by[:ACTOR_MAX_LENGTH]
        )

    def resume(self, names: Iterable[str]) -> int:
        """Start these paused schedules again from now: the occurrences passed while
        paused are skipped, whatever their `missed` policy. Returns how many resumed."""
        return self.filter(name__in=list(names), paused_at__isnull=False).update(
            paused_at=None,
            paused_by="",
            last_occurrence_at=Greatest(Coalesce(F("last_occurrence_at"), Now()), Now()),
        )


class QueueQuerySet(models.QuerySet["Queue"]):
    def paused(self) -> QueueQuerySet:
        return self.filter(paused_at__isnull=False)


class QueueManager(models.Manager.from_queryset(QueueQuerySet)):  # type: ignore[misc]
    """Pausing queues, and the row lock of a limited queue's claims."""

    def pause(self, names: Iterable[str], *, by: str = "") -> int:
        """No worker claims from these queues until resumed: each worker learns it from
        a NOTIFY at once, or within a second by polling. Jobs already running finish.
        Returns how many queues were running. Kept across restarts (it is a row)."""
        names = [validate_queue_name(name) for name in dict.fromkeys(names)]
        with bounded(self.db):
            self.bulk_create([self.model(name=name) for name in names], ignore_conflicts=True)
            changed = self.filter(name__in=names, paused_at__isnull=True).update(
                paused_at=Now(), paused_by=by[:ACTOR_MAX_LENGTH]
            )
            _notify_control(self.db)
        return changed

    def resume(self, names: Iterable[str]) -> int:
        """Let workers claim from these queues again; returns how many were paused."""
        with bounded(self.db):
            changed = self.filter(name__in=list(names), paused_at__isnull=False).update(
                paused_at=None, paused_by=""
            )
            _notify_control(self.db)
        return changed

    def paused_names(self, names: Iterable[str]) -> set[str]:
        """Which of these queues are paused (one query on the small queue table)."""
        return set(self.paused().filter(name__in=list(names)).values_list("name", flat=True))

    def locked(self, name: str) -> tuple[Queue, datetime] | None:
        """The queue's row, created if missing and locked (see `locked_row`)."""
        return locked_row(self, name)


class RateBucketManager(models.Manager["RateBucket"]):
    """The token buckets of tasks' rate limits (`@task(rate_limit=...)`)."""

    def locked(self, key: str) -> tuple[RateBucket, datetime] | None:
        """The bucket's row, created if missing and locked (see `locked_row`)."""
        return locked_row(self, key)


def locked_row(manager: models.Manager[Any], pk: str) -> tuple[Any, datetime] | None:
    """The row `pk` (a queue's or a rate bucket's), created if missing and locked FOR
    UPDATE SKIP LOCKED (the caller is in a transaction), with the database's now: what
    serializes the claims under one limit. None while another transaction holds it:
    that limit's jobs are skipped for this claim and tried again soon, so a worker
    frozen inside its claim never makes the others wait (and the server ends its
    transaction, `bounded`)."""
    for _ in range(2):
        row = (
            manager.select_for_update(skip_locked=True).annotate(db_now=Now()).filter(pk=pk).first()
        )
        if row is not None:
            return row, row.db_now
        if manager.filter(pk=pk).exists():
            return None  # there, and locked by another claim
        manager.bulk_create([manager.model(pk=pk)], ignore_conflicts=True)
    return None


def refilled(
    rate: int, period: float, stored: float, refilled_at: datetime | None, now: datetime
) -> float:
    """A token bucket of `rate` starts per `period` seconds, holding up to `rate`: what it
    holds at `now`, from what it held (`stored`) when last refilled. A bucket never
    refilled is full; one written by another client (not finite) counts as empty; one
    owes at most one fill."""
    tokens = float(rate)
    if refilled_at is not None:
        elapsed = max((now - refilled_at).total_seconds(), 0.0)
        if not math.isfinite(stored):
            stored = 0.0
        stored = max(stored, -tokens)
        tokens = min(tokens, stored + elapsed * rate / period)
    return tokens


def _notify_control(alias: str) -> None:
    """Tell every listening worker to read the queue table again (sent at commit). The
    payload is empty, like every NOTIFY of ours: channels are visible to every user."""
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, '')", [sql.CONTROL_CHANNEL])


#: The names of `JobManager.queue_gauges()`' numbers, per queue.
GAUGE_NAMES = ("pending_due", "scheduled", "waiting", "running", "stuck", "oldest_due_seconds")

#: The counts a QueueMinute row adds up (its integer and float columns).
MINUTE_COUNTS = (
    "succeeded",
    "retried",
    "released",
    "failed",
    "cancelled",
    "lost",
    "unknown",
    "pickups",
    "pickup_seconds",
    "runs",
    "run_seconds",
)


class QueueMinuteManager(models.Manager["QueueMinute"]):
    """The per-minute counts the admin's charts read (see models.QueueMinute)."""

    def add(self, rows: Mapping[str, Mapping[str, Any]]) -> None:
        """Add each queue's counts to its row of the database's current minute: one
        upsert, queues in name order (two workers never wait on each other's rows in
        opposite orders). A count missing from a row adds 0; `pickup_buckets` adds up
        bucket by bucket; `oldest_due_seconds` keeps the largest."""
        if not rows:
            return
        records = []
        for name in sorted(rows):
            counts = rows[name]
            record: dict[str, Any] = {"queue_name": name}
            record |= {column: counts.get(column, 0) for column in MINUTE_COUNTS}
            record["pickup_buckets"] = list(counts.get("pickup_buckets") or [])
            record["oldest_due_seconds"] = counts.get("oldest_due_seconds")
            records.append(record)
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.ADD_MINUTE, [json.dumps(records)])

    def sampled_this_minute(self) -> bool:
        """Whether a reaper has written the oldest due jobs' ages this minute."""
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.MINUTE_SAMPLED)
            return bool(cursor.fetchone()[0])

    def prune(self, older_than: timedelta) -> int:
        """Delete the minutes older than `older_than` (the minute index serves it)."""
        return self.filter(minute__lt=Now() - older_than).delete()[0]
