"""The relay's verbs: rows of relayed queues published to the broker (the table as
their outbox), and outcomes written back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from django.db.models.functions import Now

from django_skipqueue.core.states import (
    CLAIM_ORDER,
    JobState,
)
from django_skipqueue.db.hooks import raw_delete
from django_skipqueue.queue import sql

if TYPE_CHECKING:
    from django_skipqueue.models import (
        Job,
    )

from django_skipqueue.queue.enqueue import EnqueueVerbs


class RelayVerbs(EnqueueVerbs):
    """The relay verbs of the job manager."""

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
        raw_delete(self.filter(id__in=ids), self.db)

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
