"""The reaper's verbs: expired leases taken back (pending, or failed after the last
attempt), expired jobs ended."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from django.db import DatabaseError, transaction
from django.db.models import (
    Count,
    F,
)
from django.db.models.functions import Now

from django_skipqueue.conf import get_settings
from django_skipqueue.core.states import (
    JobState,
)
from django_skipqueue.faults import is_transient
from django_skipqueue.queue.base import (
    EXPIRE_BATCH_SIZE,
    EXPIRE_PASS_SECONDS,
    LEASE_EXPIRED,
    JobQuerySet,
    ReapResult,
    _AppendCapped,
    _end_as_expired,
)

if TYPE_CHECKING:
    pass

from django_skipqueue.queue.outcomes import OutcomeVerbs

logger = logging.getLogger(__name__)


class ReapVerbs(OutcomeVerbs):
    """The reaper verbs of the job manager."""

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
