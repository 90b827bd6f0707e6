"""The queue protocol: filters on JobQuerySet, state changes on JobManager.

Every time comparison uses the database clock (`Now()`, STATEMENT_TIMESTAMP() on
PostgreSQL), never the worker's. Every write that finishes or extends an attempt is
fenced: it matches the job id, `state = 'running'`, the claimed attempt number and an
unexpired lease in its own WHERE, so a stale attempt changes nothing (0 rows).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, models
from django.db.models import Expression, F, Func, Value
from django.db.models.functions import Greatest, JSONObject, Now

from django_skipqueue.base import FINISHED_STATES, JobState
from django_skipqueue.conf import get_settings

if TYPE_CHECKING:
    from django_skipqueue.models import Job, WorkerProcess
    from django_skipqueue.payload import JSONValue

logger = logging.getLogger(__name__)


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
        sql = (
            f"(CASE WHEN jsonb_array_length({h_sql}) >= {c_sql} THEN {h_sql} - 0 "
            f"ELSE {h_sql} END) || {e_sql}"
        )
        return sql, (*h_params, *c_params, *h_params, *h_params, *e_params)


@dataclass(frozen=True)
class ErrorInfo:
    """What went wrong in one attempt, already capped in size."""

    type: str
    message: str
    traceback: str = ""

    def entry(self) -> Expression:
        """The history entry as a jsonb object, stamped with the database clock."""
        return JSONObject(
            attempt=F("attempts"),
            at=Now(),
            type=Value(self.type),
            message=Value(self.message),
            traceback=Value(self.traceback),
        )

    def summary(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


LEASE_EXPIRED = ErrorInfo(
    "django_skipqueue.exceptions.LeaseExpiredError",
    "the lease ran out before this attempt was acknowledged; taken back",
)


@dataclass(frozen=True)
class ReapResult:
    """What one reap did: expired leases sent back to pending, or to failed (no attempt left)."""

    requeued: int = 0
    failed: int = 0

    @property
    def total(self) -> int:
        return self.requeued + self.failed


class JobQuerySet(models.QuerySet["Job"]):
    """Sets of jobs. These methods filter; they never write."""

    def pending(self) -> JobQuerySet:
        return self.filter(state=JobState.PENDING)

    def running(self) -> JobQuerySet:
        return self.filter(state=JobState.RUNNING)

    def due(self) -> JobQuerySet:
        """Pending jobs whose `run_at` has come, on the database clock."""
        return self.filter(state=JobState.PENDING, run_at__lte=Now())

    def scheduled(self) -> JobQuerySet:
        """Pending jobs due in the future."""
        return self.filter(state=JobState.PENDING, run_at__gt=Now())

    def expired(self) -> JobQuerySet:
        """Running jobs whose lease has run out and which the reaper has not yet taken back."""
        return self.filter(state=JobState.RUNNING, leased_until__lt=Now())

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

    def holding(self, job_id: int, attempt: int) -> JobQuerySet:
        """The fence: the job, only while `attempt` is its current, unexpired claim."""
        return self.filter(
            id=job_id, state=JobState.RUNNING, attempts=attempt, leased_until__gt=Now()
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

        Locks: FOR NO KEY UPDATE SKIP LOCKED on the chosen rows, held only until this
        method's transaction commits, before it returns. Statements: one
        (`sql.CLAIM_*`: a locking CTE and an UPDATE ... RETURNING), whatever `limit`
        is. Returned in claim order (priority, then run_at, then id). Each job's
        `attempts` is the attempt number that its ack, renew, fail and release must
        present. The lease is each job's own unless `lease` is given.
        """
        if limit < 1:
            return []
        from django_skipqueue import sql
        from django_skipqueue.loading import fetch_jobs

        names = list(queues)
        params: dict[str, Any] = {
            "queues": names[0] if len(names) == 1 else names,
            "limit": limit,
            "worker": worker.pk if worker is not None else None,
            "lease": lease,
        }
        statement = sql.CLAIM_ONE_QUEUE if len(names) == 1 else sql.CLAIM_QUEUES
        # One statement: in autocommit it is its own transaction and commits before
        # returning (no BEGIN/COMMIT round trips); inside atomic() it joins the caller's.
        with connections[self.db].cursor() as cursor:
            cursor.execute(statement, params)
            claimed = fetch_jobs(cursor, self.db)
        claimed.sort(key=lambda job: (-job.priority, job.run_at, job.id))
        return claimed

    def ack(self, job_id: int, attempt: int, result: JSONValue = None) -> bool:
        """Mark done only if `attempt` still holds the lease. False: this attempt lost it.

        The one-row case of `ack_many` (one fenced UPDATE), in autocommit or in the
        caller's transaction.
        """
        return job_id in self.ack_many([(job_id, attempt, result)])

    def ack_many(self, acks: Sequence[tuple[int, int, JSONValue]]) -> set[int]:
        """Fenced acks of several jobs in one statement: (job id, attempt, result) each.

        Each row is fenced on its own (`sql.ACK_MANY`: the same WHERE as `ack`), so one
        stale attempt changes nothing but itself. Returns the ids marked done; any other
        id's attempt had lost its lease.
        """
        from django_skipqueue import sql

        if not acks:
            return set()
        encoder = self.model._meta.get_field("result").encoder
        ids = [job_id for job_id, _, _ in acks]
        attempts = [attempt for _, attempt, _ in acks]
        results = [None if r is None else json.dumps(r, cls=encoder) for _, _, r in acks]
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.ACK_MANY, [ids, attempts, results])
            return {row[0] for row in cursor.fetchall()}

    def renew(self, job_id: int, attempt: int, lease: timedelta | None = None) -> bool:
        """Extend the lease to now + `lease` (the job's own by default). False: it was lost."""
        until = Now() + (Value(lease) if lease is not None else F("lease"))
        return self.holding(job_id, attempt).update(leased_until=until) == 1

    def fail(
        self, job_id: int, attempt: int, *, error: ErrorInfo, retry_in: timedelta | None
    ) -> str | None:
        """Record `error` for this attempt, then retry after `retry_in` or end failed.

        With `retry_in` None the error is not retryable and the job fails at once.
        Otherwise it goes back to pending, due after `retry_in`, if an attempt is left.
        At most two fenced UPDATEs. Returns the new state, or None if this attempt had
        lost the lease (nothing written).
        """
        history = _AppendCapped(F("errors"), error.entry(), get_settings().ERROR_HISTORY_LENGTH)
        fenced = self.holding(job_id, attempt)
        written = {"errors": history, "last_error": error.summary(), "leased_until": None}
        if retry_in is not None:
            retried = fenced.filter(attempts__lt=F("max_attempts")).update(
                state=JobState.PENDING, run_at=Now() + Value(retry_in), **written
            )
            if retried:
                return JobState.PENDING
        failed = fenced.update(state=JobState.FAILED, finished_at=Now(), **written)
        return JobState.FAILED if failed else None

    def release(self, job_id: int, attempt: int, *, delay: timedelta = timedelta(0)) -> bool:
        """Give the attempt back: pending again after `delay`, without spending an attempt.

        `attempts` is the fence and never goes down, so the attempt is given back by
        raising `max_attempts` by one; `releases` counts it. One fenced UPDATE.
        """
        return (
            self.holding(job_id, attempt).update(
                state=JobState.PENDING,
                run_at=Now() + Value(delay),
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
        cap = get_settings().ERROR_HISTORY_LENGTH
        written = {
            "leased_until": None,
            "expirations": F("expirations") + 1,
            "errors": _AppendCapped(F("errors"), LEASE_EXPIRED.entry(), cap),
            "last_error": LEASE_EXPIRED.summary(),
        }
        requeued = (
            self.expired()
            .filter(attempts__lt=F("max_attempts"))
            .update(state=JobState.PENDING, run_at=Now(), **written)
        )
        failed = (
            self.expired()
            .filter(attempts__gte=F("max_attempts"))
            .update(state=JobState.FAILED, finished_at=Now(), **written)
        )
        if requeued or failed:
            logger.warning("leases expired requeued=%d failed=%d", requeued, failed)
        return ReapResult(requeued=requeued, failed=failed)

    # -- operator actions (the admin's), each guarded and done in bounded batches ------

    def retry_now(self, ids: Iterable[int], *, batch_size: int = 1000) -> int:
        """Failed or cancelled jobs back to pending, due now; returns how many changed.

        The WHERE re-checks the state, so a job that changed meanwhile is skipped. An
        attempt is added when none is left (`attempts` itself never goes down).
        """
        return self._in_batches(
            ids,
            batch_size,
            lambda batch: self.filter(
                id__in=batch, state__in=[JobState.FAILED, JobState.CANCELLED]
            ).update(
                state=JobState.PENDING,
                run_at=Now(),
                finished_at=None,
                max_attempts=Greatest(F("max_attempts"), F("attempts") + 1),
            ),
        )

    def cancel(self, ids: Iterable[int], *, batch_size: int = 1000) -> int:
        """Pending jobs to cancelled; a job claimed meanwhile is skipped."""
        return self._in_batches(
            ids,
            batch_size,
            lambda batch: self.filter(id__in=batch, state=JobState.PENDING).update(
                state=JobState.CANCELLED, finished_at=Now()
            ),
        )

    def requeue(self, ids: Iterable[int], *, batch_size: int = 1000) -> int:
        """Stuck jobs (running, lease expired) back to pending now, counted as an expiry.

        The same guard as the reaper: a job acked or renewed meanwhile is left alone.
        """
        return self._in_batches(
            ids,
            batch_size,
            lambda batch: (
                self.expired()
                .filter(id__in=batch)
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
    def _in_batches(ids: Iterable[int], size: int, write: Any) -> int:
        ids = list(ids)
        return sum(write(ids[start : start + size]) for start in range(0, len(ids), size))


def _run_at(run_after: datetime | timedelta) -> datetime | Expression:
    if isinstance(run_after, timedelta):
        return Now() + Value(run_after)
    return run_after


class WorkerProcessQuerySet(models.QuerySet["WorkerProcess"]):
    def alive(self, within: timedelta) -> WorkerProcessQuerySet:
        """Workers whose heartbeat is newer than `within`, on the database clock."""
        return self.filter(heartbeat_at__gte=Now() - Value(within))

    def dead(self, after: timedelta) -> WorkerProcessQuerySet:
        return self.filter(heartbeat_at__lt=Now() - Value(after))
