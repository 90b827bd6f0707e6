"""Claiming: one statement that locks due jobs (SKIP LOCKED, the QuerySet's
`select_for_update(skip_locked=True)` in `claimable()`), marks them running and returns
them, committed before any task code runs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections, models, transaction
from django.db.models import (
    F,
)
from django.db.models.functions import Now

from django_skipqueue.conf import MAX_LEASE, MIN_LEASE, get_settings
from django_skipqueue.core.payload import (
    storable_text,
)
from django_skipqueue.core.redaction import redact_text
from django_skipqueue.core.states import (
    JobState,
    sort_in_claim_order,
)
from django_skipqueue.db.hooks import (
    compiled_sql,
    quote_parameters,
)
from django_skipqueue.faults import is_transient
from django_skipqueue.queue import sql
from django_skipqueue.queue.base import (
    QUARANTINED,
    ErrorInfo,
    JobQuerySet,
    _AppendCapped,
    _savepoint_if_in_transaction,
    in_process_claimer,
)
from django_skipqueue.queue.connections import bounded
from django_skipqueue.queue.loading import fetch_jobs, job_cursor
from django_skipqueue.queue.rows import job_columns

if TYPE_CHECKING:
    from django_skipqueue.models import (
        Job,
        WorkerProcess,
    )


logger = logging.getLogger(__name__)


_LOCKING: dict[tuple[Any, ...], tuple[str, tuple[Any, ...]]] = {}
_BOUND_CLAIMS: dict[tuple[Any, ...], str] = {}  # JobManager._bound_claim


def _locking_query(
    manager: ClaimVerbs, queues: tuple[str, ...], limit: int
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
            sql_text, params = compiled_sql(locking, manager.db)
        if len(_LOCKING) >= 1024:  # bounded: limits and queue sets are few in practice
            _LOCKING.clear()
        compiled = _LOCKING[key] = (sql_text, params)
    return compiled


class ClaimVerbs(models.Manager.from_queryset(JobQuerySet)):  # type: ignore[misc]
    """The claim verbs of the job manager."""

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
            claimed = self._claim_by(statement, params)
        except DatabaseError as error:
            if is_transient(error):
                raise
            logger.error("claim failed, claiming row by row: %s", redact_text(str(error)))
            claimed = self._claim_row_by_row(names, limit, worker, lease)
        sort_in_claim_order(claimed)
        return claimed

    def _claim_by(self, statement: str, params: list[Any] | None) -> list[Job]:
        """Run a claiming statement as its own transaction in autocommit (inside the
        caller's atomic(), a savepoint of it) and load the claimed rows, failing those
        Python cannot load (`_fail_unloadable`)."""
        unloadable: list[tuple[int, str]] = []
        with _savepoint_if_in_transaction(self.db), job_cursor(self.db) as cursor:
            cursor.execute(statement, params)
            claimed = fetch_jobs(self.model, cursor, self.db, unloadable=unloadable)
        self._fail_unloadable(unloadable)
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
        locking: tuple[str, Sequence[Any]] | None = None,
    ) -> tuple[str, list[Any]]:
        """The claiming statement and its parameters, for claim() and for EXPLAIN.

        The locking query's SQL is compiled once per database, queues and limit (inside
        `transaction.atomic()`, where Django compiles it), and reused: a worker claims
        from the same queues again and again.
        """
        if locking is not None:  # a locking query of its own (a fair queue's: queue/fair.py)
            locking_sql, locking_params = locking[0], tuple(locking[1])
        elif ids is not None:  # rows this transaction already locked (claim_limited)
            locking_sql, locking_params = sql.CLAIM_THESE, (list(ids),)
        elif only is None:
            locking_sql, locking_params = _locking_query(self, tuple(queues), limit)
        else:  # one given row (the fallback), not cached
            with transaction.atomic(using=self.db):  # Django compiles FOR UPDATE only here
                one = self.claimable(queues).filter(id=only).values("id")[:1]
                locking_sql, locking_params = compiled_sql(one, self.db)
        columns = ("id",) if ids_only else job_columns(self.model)
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
        statement = sql.load_claimed_statement(job_columns(self.model))
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
