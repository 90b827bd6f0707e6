"""Outcomes of an attempt: ack, fail, release, give back, renew, progress and cancel
checks, each one guarded UPDATE fenced on the attempt and its lease."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections, transaction
from django.db.models import (
    Case,
    Exists,
    Expression,
    F,
    OuterRef,
    Value,
    When,
)
from django.db.models.functions import Greatest, JSONObject, Least, Now

from django_skipqueue.conf import MAX_LEASE, MIN_LEASE, get_settings
from django_skipqueue.core.payload import (
    encode,
)
from django_skipqueue.core.states import (
    JobState,
    ParkedOn,
)
from django_skipqueue.db.hooks import (
    fetch_all,
)
from django_skipqueue.faults import is_transient
from django_skipqueue.queue import sql
from django_skipqueue.queue.base import (
    GAUGE_NAMES,
    ErrorInfo,
    Renewal,
    _ack_parameters,
    _AppendCapped,
    _json_argument,
    _savepoint_if_in_transaction,
    _state_is,
    clamped_delay,
)
from django_skipqueue.queue.loading import job_cursor

if TYPE_CHECKING:
    from django_skipqueue.core.payload import JSONValue

from django_skipqueue.queue.relaying import RelayVerbs

logger = logging.getLogger(__name__)


class OutcomeVerbs(RelayVerbs):
    """The outcome verbs of the job manager."""

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
        """Per queue: jobs pending and due, scheduled, waiting (on a workflow parent),
        sleeping and awaiting a signal (durable jobs parked until their time), running
        and stuck, and the age in seconds of the oldest due job (database clock). Read only from the
        partial indexes of unfinished jobs, never the finished ones: the cost follows
        the backlog, not the table."""
        gauges: dict[str, dict[str, float]] = {}
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.QUEUE_GAUGES)
            for row in cursor.fetchall():
                name, due, scheduled, running, stuck, oldest, sleeping, awaiting = row
                gauges[name] = {
                    "pending_due": due,
                    "scheduled": scheduled,
                    "running": running,
                    "stuck": stuck,
                    "waiting": 0,
                    "sleeping": sleeping,
                    "awaiting_signal": awaiting,
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

    def release(
        self,
        job_id: int,
        attempt: int,
        *,
        delay: timedelta = timedelta(0),
        park: tuple[str, str] | None = None,
    ) -> bool:
        """Give the attempt back: pending again after `delay`, without spending an attempt.

        `attempts` is the fence and never goes down, so the attempt is given back by
        raising `max_attempts` by one; `releases` counts it. One fenced UPDATE; a job
        whose cancel was requested ends cancelled instead (a second one). `park`: see
        `give_back`.
        """
        return self.give_back(job_id, attempt, delay=delay, park=park) or self.end_cancelled(
            job_id, attempt
        )

    def give_back(
        self,
        job_id: int,
        attempt: int,
        *,
        delay: timedelta = timedelta(0),
        park: tuple[str, str] | None = None,
    ) -> bool:
        """`release` without its second step: False where the job was asked to stop (it
        stays running for `end_cancelled`) or the attempt had lost it.

        `park` (a durable sleep's or wait's Retry.park): what the job is parked on,
        written in `parked` and `parked_step`. Its `expires_at` is cleared: the job
        started in time, and finishes. For a wait, a signal of its name that is there
        now (its sender committed after the wait's look: queue/signals.py) makes the
        job due at once."""
        fenced = self.holding(job_id, attempt)
        run_at: Any = Now() + Value(clamped_delay(delay))
        parked: dict[str, Any] = {}
        if park is not None:
            kind, step = park
            parked = {"parked": kind, "parked_step": step, "expires_at": None}
            if kind == ParkedOn.SIGNAL:
                kept = self.model._meta.get_field("signals").related_model._default_manager
                there = kept.filter(job_id=OuterRef("id"), name=step)
                run_at = Case(When(Exists(there), then=Now()), default=run_at)
        return (
            fenced.filter(cancel_requested_at__isnull=True).update(
                state=JobState.PENDING,
                run_at=run_at,
                leased_until=None,
                max_attempts=F("max_attempts") + 1,
                releases=F("releases") + 1,
                **parked,
            )
            == 1
        )


@contextlib.contextmanager
def _workflows_first(manager: OutcomeVerbs, ids: Sequence[int], wanted: bool) -> Iterator[None]:
    """With `wanted`, a transaction around the block that first locks the workflows of
    `ids` (`JobManager.lock_workflows_of`); without, nothing: a job of no workflow pays
    no statement and no transaction."""
    if not wanted:
        yield
        return
    with transaction.atomic(using=manager.db):
        manager.lock_workflows_of(ids)
        yield
