"""An operator's verbs: retry now, cancel, requeue, in batches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from django.db import IntegrityError, transaction
from django.db.models import (
    F,
)
from django.db.models.functions import Greatest, Now

from django_skipqueue.core.states import (
    ACTOR_MAX_LENGTH,
    JobState,
)
from django_skipqueue.queue.base import _state_is

if TYPE_CHECKING:
    from collections.abc import Callable


from django_skipqueue.queue.reap import ReapVerbs


class OperatorVerbs(ReapVerbs):
    """The operator verbs of the job manager."""

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

    def restart_from_step(self, job_id: int, position: int) -> bool:
        """Run a durable job again from its step `position` (from 1): its checkpoints
        from there on are deleted, so its next attempt runs that step and the ones after
        it again, and gets the earlier ones' results from their records. A failed or
        cancelled job is retried now (as `retry_now`), a pending one (asleep, or in its
        backoff) made due now. False, and nothing changed, if the job is running or done
        (cancel a running one first), or a unique job whose key another job holds."""
        steps = self.model._meta.get_field("steps").related_model._default_manager  # Step's
        if isinstance(position, bool) or not isinstance(position, int) or position < 1:
            raise ValueError(f"restart_from_step(): position must be an int >= 1, got {position!r}")
        with transaction.atomic(using=self.db):
            self.lock_workflows_of([job_id])  # the order every state change takes its locks in
            state = (
                self.select_for_update().filter(id=job_id).values_list("state", flat=True).first()
            )
            if state not in (JobState.FAILED, JobState.CANCELLED, JobState.PENDING):
                return False
            steps.using(self.db).filter(job_id=job_id, position__gte=position).delete()
            if state == JobState.PENDING:
                changed = self.filter(id=job_id, state=JobState.PENDING).update(run_at=Now())
            else:
                changed = self.retry_now([job_id])
            if not changed:
                transaction.set_rollback(True, using=self.db)  # the checkpoints stay
            return bool(changed)

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
