"""Housekeeping: reap expired leases and prune old jobs and dead workers, in batches.

One housekeeper at a time does it, under a transaction-level advisory lock (safe
behind a transaction pooler); another that finds the lock taken skips its turn.
Reaping is correct without the lock too (each row moves once); the lock only avoids
doing the same work twice.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections, transaction
from django.db.models import Q
from django.db.models.functions import Now

from django_skipqueue import signals
from django_skipqueue.conf import get_settings
from django_skipqueue.faults import is_transient, sqlstate
from django_skipqueue.models import (
    Job,
    JobState,
    QueueMinute,
    RateBucket,
    TaskMinute,
    WorkerProcess,
    Workflow,
)
from django_skipqueue.queue.base import ReapResult
from django_skipqueue.queue.connections import (
    LOCK_NOT_AVAILABLE,
    SIDE_WRITE_LOCK_SECONDS,
    bounded,
    lock_wait_within,
)
from django_skipqueue.queue.sql import try_advisory_xact_lock

if TYPE_CHECKING:
    from django.db.models import QuerySet

logger = logging.getLogger(__name__)

PRUNE_BATCH_SIZE = 1000
#: How long the per-minute counts (QueueMinute, TaskMinute) are kept: the longest
#: window of the queue and task overviews is a day.
MINUTES_KEPT = timedelta(hours=25)


@dataclass(frozen=True)
class HousekeepingResult:
    """What one pass did. `locked_out`: another housekeeper held the lock; nothing done."""

    requeued: int = 0
    failed: int = 0
    cancelled: int = 0  # expired with a cancel request: ended cancelled, not retried
    expired: int = 0  # not started by their expires_at: ended cancelled (EXPIRED)
    pruned_done: int = 0
    pruned_failed: int = 0
    pruned_workers: int = 0
    pruned_workflows: int = 0
    pruned_minutes: int = 0
    pruned_buckets: int = 0  # rate buckets full again (queue/base.py BUCKET_FULL_AFTER)
    locked_out: bool = False
    #: Expired leases taken back, per queue (the metrics).
    lease_expirations: Mapping[str, int] = field(default_factory=dict)


class Reaper:
    """Reaps and prunes on one database. Each method is one short pass."""

    def __init__(self, *, database: str | None = None, batch_size: int = PRUNE_BATCH_SIZE):
        self.database = database or get_settings().DATABASE_ALIAS
        self.batch_size = batch_size

    def reap(
        self, *, dry_run: bool = False, lock_seconds: float | None = None
    ) -> HousekeepingResult:
        """Take back expired leases (pending again, or failed with no attempt left), and
        end the jobs not started by their `expires_at`.

        With `dry_run`, count what the reap would do (the same classification,
        `JobQuerySet.reapable`) and change nothing. `lock_seconds` bounds its waits for
        a lock (`bounded`; the worker's housekeeper passes SIDE_WRITE_LOCK_SECONDS).
        """
        jobs = Job.objects.db_manager(self.database)
        if dry_run:
            requeued, failed, cancelled = jobs.reapable()
            return HousekeepingResult(
                requeued=requeued.count(),
                failed=failed.count(),
                cancelled=cancelled.count(),
                expired=jobs.past_expiry().count(),
            )
        with bounded(self.database, lock_seconds=lock_seconds):
            if not self._locked():
                return HousekeepingResult(locked_out=True)
            result: ReapResult = jobs.reap()
            self._sample_oldest_due(jobs)
        # The jobs parked on a signal whose sender died before its wake-up (autocommit:
        # after the reap's transaction, as the sender's own wake-up is).
        woken = jobs.wake_signalled()
        if woken:
            logger.info("jobs woken by a signal their sender did not wake them for count=%d", woken)
        if result.total:
            signals.job_reaped.send(
                sender=Job,
                requeued=result.requeued,
                failed=result.failed,
                cancelled=result.cancelled,
                expired=result.expired,
            )
        return HousekeepingResult(
            requeued=result.requeued,
            failed=result.failed,
            cancelled=result.cancelled,
            expired=result.expired,
            lease_expirations=result.by_queue,
        )

    def _sample_oldest_due(self, jobs: Any) -> None:
        """The age of each queue's oldest due job, into the current minute's rows (the
        overview's chart): by the housekeeper holding the lock, once a minute across
        every worker (a pass that finds this minute sampled reads nothing more)."""
        minutes = QueueMinute.objects.db_manager(self.database)
        try:  # never the reap's undoing: a table locked for seconds skips this minute's
            with lock_wait_within(self.database, SIDE_WRITE_LOCK_SECONDS):
                if minutes.sampled_this_minute():  # a read: ACCESS EXCLUSIVE stops it too
                    return
                gauges = jobs.queue_gauges()
                minutes.add(
                    {
                        name: {"oldest_due_seconds": g["oldest_due_seconds"]}
                        for name, g in gauges.items()
                    }
                )
        except DatabaseError as error:
            if sqlstate(error) != LOCK_NOT_AVAILABLE:
                raise
            logger.warning(
                "the oldest due jobs' ages skipped: a lock on skipqueue_queueminute was held "
                "for more than %.1fs (the reap went on)",
                SIDE_WRITE_LOCK_SECONDS,
            )

    def prune(
        self,
        *,
        done_older_than: timedelta | None = None,
        failed_older_than: timedelta | None = None,
        workers_dead_for: timedelta | None = None,
        minutes_older_than: timedelta | None = None,
        dry_run: bool = False,
    ) -> HousekeepingResult:
        """Delete finished jobs and dead worker rows older than the given ages; with
        `minutes_older_than`, the per-minute counts older than that and the rate buckets
        full again (a rate limit per key leaves a bucket per key).

        Jobs go in batches of `batch_size` ids, each DELETE its own short transaction,
        so a large backlog never becomes one huge statement or one long lock. With
        `dry_run`, count what would go and delete nothing.
        """
        done = self._prune_jobs([JobState.DONE, JobState.CANCELLED], done_older_than, dry_run)
        failed = self._prune_jobs([JobState.FAILED], failed_older_than, dry_run)
        workers = 0
        if workers_dead_for is not None:
            dead = WorkerProcess.objects.using(self.database).dead(workers_dead_for)
            workers = dead.count() if dry_run else dead.delete()[0]
            if not dry_run:  # and no dead worker waits for a NOTIFY (runtime/waiting.py)
                WorkerProcess.objects.db_manager(self.database).forget_waiting_of_dead()
        workflows = 0
        if done_older_than is not None:
            workflows = Workflow.objects.db_manager(self.database).prune(
                finished_before=done_older_than, dry_run=dry_run
            )
        minutes = buckets = 0
        if minutes_older_than is not None and not dry_run:
            minutes = QueueMinute.objects.db_manager(self.database).prune(minutes_older_than)
            minutes += TaskMinute.objects.db_manager(self.database).prune(minutes_older_than)
            buckets = RateBucket.objects.db_manager(self.database).prune_full()
        return HousekeepingResult(
            pruned_done=done,
            pruned_failed=failed,
            pruned_workers=workers,
            pruned_workflows=workflows,
            pruned_minutes=minutes,
            pruned_buckets=buckets,
        )

    def _prune_jobs(self, states: list[str], older_than: timedelta | None, dry_run: bool) -> int:
        if older_than is None:
            return 0
        # A job of a running or failed workflow stays: a step that waits reads its
        # result, and an operator's retry resumes a failed workflow (cancel it to let
        # its jobs go).
        old = (
            Job.objects.db_manager(self.database)
            .filter(state__in=states, finished_at__lt=Now() - older_than)
            .exclude(
                Q(workflow_id__isnull=False)
                & Q(workflow_id__in=Workflow.objects.using(self.database).resumable().values("id"))
            )
        )
        if dry_run:
            return old.count()
        deleted = 0
        refused: list[int] = []  # rows whose DELETE fails: skipped for this pass
        while True:
            with bounded(self.database):
                # Lock the batch, skipping rows another pruner holds: batches never
                # overlap, so two pruners never wait on each other (without it, two
                # DELETEs of overlapping batches deadlocked once in T43).
                batch = old.exclude(id__in=refused).select_for_update(skip_locked=True).order_by()
                ids = list(batch.values_list("id", flat=True)[: self.batch_size])
                if not ids:
                    return deleted
                # Re-check state in the DELETE itself: a job retried meanwhile stays.
                try:
                    with transaction.atomic(using=self.database):
                        deleted += old.filter(id__in=ids).delete()[0]
                except DatabaseError as error:
                    if is_transient(error):
                        raise
                    logger.error("prune failed, deleting row by row: %s", error)
                    deleted += self._delete_row_by_row(old, ids, refused)
            logger.info("pruned jobs count=%d states=%s", deleted, ",".join(states))

    def _delete_row_by_row(self, old: QuerySet[Job], ids: list[int], refused: list[int]) -> int:
        """Each row alone, in a savepoint; one that cannot be deleted (a project's
        foreign key or trigger, say) is logged and left, and the others go."""
        deleted = 0
        for job_id in ids:
            try:
                with transaction.atomic(using=self.database):
                    deleted += old.filter(id=job_id).delete()[0]
            except DatabaseError as error:
                if is_transient(error):
                    raise
                refused.append(job_id)
                logger.error("job not pruned id=%s: %s", job_id, error)
        return deleted

    def _locked(self) -> bool:
        with connections[self.database].cursor() as cursor:
            return try_advisory_xact_lock(cursor)
