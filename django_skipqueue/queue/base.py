"""The queue's shared pieces: the job QuerySet (every filter a verb runs on), the values
verbs return (`ErrorInfo`, `Renewal`, `ReapResult`), and small helpers of the verbs'
modules. Every time comparison uses the database clock (`Now()`), never the worker's."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import logging
import math
import os
import reprlib
import socket
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from django.db import DatabaseError, connections, models, transaction
from django.db.models import (
    Count,
    Exists,
    Expression,
    F,
    Func,
    OuterRef,
    Q,
    Subquery,
    Value,
)
from django.db.models.functions import Cast, Coalesce, Concat, JSONObject, Now
from django.db.models.lookups import Exact

from django_skipqueue.conf import get_settings
from django_skipqueue.core.states import (
    CLAIM_ORDER,
    EXPIRED,
    FINISHED_STATES,
    UNFINISHED_STATES,
    UNNEEDED,
    UPSTREAM,
    JobState,
)
from django_skipqueue.exceptions import (
    InvalidJobError,
)

if TYPE_CHECKING:
    from django_skipqueue.core.payload import JSONValue
    from django_skipqueue.core.spec import JobSpec
    from django_skipqueue.models import (
        Job,
        Queue,
        RateBucket,
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
    find a job by its id (`tests/queue/test_managers.py` checks the plans).
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
            .filter(  # an ordered job: only the first unfinished one of its key
                Q(order_hold__isnull=True) | ~Exists(_earlier_in_order(self.model))
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


def _earlier_in_order(model: type[Job]) -> models.QuerySet[Job]:
    """For an ordered candidate (OuterRef): an earlier job of its key that holds it, an
    unfinished one, or a failed one whose failure holds the key (`order_hold`). The
    index skipqueue_job_ordered_idx serves it."""
    return model._base_manager.filter(
        Q(state__in=[JobState.PENDING, JobState.RUNNING, JobState.WAITING])
        | Q(state=JobState.FAILED, order_hold=True),
        concurrency_key=OuterRef("concurrency_key"),
        id__lt=OuterRef("id"),
        order_hold__isnull=False,
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


def _no_row_returned(spec: JobSpec) -> DatabaseError:
    return DatabaseError(
        f"the INSERT of a job of {spec.name} returned no row: a BEFORE INSERT trigger on "
        f"skipqueue_job that skips rows? Jobs must be written as they are enqueued"
    )


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


#: A token bucket no claim has touched for this long is full again: a rate's period is
#: a day at most (conf/limits.py MAX_RATE_PERIOD: a throttle's) and a bucket owes at
#: most one fill (`refilled`). A missing bucket is made full at its next claim, so such
#: a bucket is deleted (`RateBucketManager.prune_full`): a rate limit per key leaves no
#: row per key behind for anyone to clean up.
BUCKET_FULL_AFTER = timedelta(days=2)


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


GAUGE_NAMES = (
    "pending_due",
    "scheduled",
    "waiting",
    "sleeping",
    "awaiting_signal",
    "running",
    "stuck",
    "oldest_due_seconds",
)
