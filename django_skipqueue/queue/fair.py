"""Fair share within a queue (SKIPQUEUE['FAIR_QUEUES'], docs/howto/flow-control.md).

In a fair queue every job has a fair key (a tenant, say; "" for a job without one) and
a weight. While several keys have due jobs, each gets claims in proportion to its
weight; a key alone gets every worker (nothing is held back for keys that have no
work). Priorities order the jobs within a key.

How, without a process of its own on the claim path and across every worker: a claim
of a fair queue is CLAIM with another locking query, `sql.FAIR_LOCKING`. It places
each due job at its key's running jobs plus its rank in its key, divided by the weight
(a water-filling of the workers: the key furthest under its share goes first), and
takes the lowest, SKIP LOCKED. The state is the job table's own: the running jobs
count for their key until they end, on every worker alike. Two claims at the same
instant see the same running jobs and may both favour one key for that moment; the
next claims see it running and even it out.

What it costs (benchmarks/RESULTS.md): one index probe per key with pending jobs (at
most MAX_FAIR_KEYS a claim, taken round from where the worker's last claim ended, so
every key comes round), one index range per key for its first jobs, and the running
jobs of the queue. The plain claim of other queues is unchanged.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections

from django_skipqueue.core.redaction import redact_text
from django_skipqueue.core.states import sort_in_claim_order
from django_skipqueue.faults import is_transient
from django_skipqueue.queue import sql
from django_skipqueue.queue.claim import ClaimVerbs

if TYPE_CHECKING:
    from django_skipqueue.models import Job, WorkerProcess

logger = logging.getLogger(__name__)

#: The most keys with due jobs one claim of a fair queue shares its jobs between, and
#: the most keys it looks at (those without a due job too: scheduled, expired), so that
#: a claim's cost stays bounded with many thousands of tenants. The next claim starts
#: where this one's jobs ended, or, when it found none due, where its walk ended.
MAX_FAIR_KEYS = 1000
MAX_FAIR_WALK = 4 * MAX_FAIR_KEYS


class FairClaimVerbs(ClaimVerbs):
    """The fair claim verb of the job manager."""

    def claim_fair(
        self,
        *,
        queue: str,
        limit: int = 1,
        worker: WorkerProcess | None = None,
        lease: timedelta | None = None,
        start: str = "",
    ) -> list[Job]:
        """Claim up to `limit` due jobs of the fair queue `queue` by share (the module
        doc), committed before this returns, as `claim` does. `start`: the largest
        fair key of this worker's last claim of the queue (its keys are looked at from
        there on, round to it). Jobs with a concurrency key are left to `claim_limited`.

        A fair queue's jobs written without a fair key (before the queue was made fair,
        or by an older release) are taken by the plain claim when no keyed job is due;
        if the fair statement fails other than by the connection, the plain claim, with
        its row-by-row fallback, takes this claim's place."""
        return self.claim_fair_from(
            queue=queue, limit=limit, worker=worker, lease=lease, start=start
        )[0]

    def claim_fair_from(
        self,
        *,
        queue: str,
        limit: int,
        worker: WorkerProcess | None = None,
        lease: timedelta | None = None,
        start: str = "",
    ) -> tuple[list[Job], str]:
        """`claim_fair`, and where the next claim of the queue starts looking at its keys:
        the largest key of the jobs claimed by share; the end of this claim's walk when it
        found no due job in it but the plain claim found some past it (FAIR_WALK_END: a
        walk that meets thousands of keys without a due job moves on); else `start`."""
        if limit < 1:
            return [], start
        claimed = self._claim_fair_once(queue, limit, worker, lease, start)
        if limit // 2 <= len(claimed) < limit and claimed:
            # The statement counts each key's share in numbers, not in jobs: keys with
            # fewer due jobs than their share leave slots over, for the others now. Not
            # when it took under half: the queue is nearly drained, and a second
            # statement would mostly find nothing (the next claim takes what is left).
            claimed += self._claim_fair_once(queue, limit - len(claimed), worker, lease, start)
        if claimed:
            sort_in_claim_order(claimed)
            return claimed, max(job.fair_key or "" for job in claimed)
        # No due job in the walk: those without a key, if any, and those past the walk.
        plain = self.claim(queues=[queue], limit=limit, worker=worker, lease=lease)
        if any(job.fair_key is not None for job in plain):
            start = self._walk_end(queue, start) or ""
        return plain, start

    def _walk_end(self, queue: str, start: str) -> str | None:
        values: dict[str, Any] = {"queue": queue, "start": start, "max_walk": MAX_FAIR_WALK}
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.FAIR_WALK_END, values)
            row = cursor.fetchone()
        return row[0] if row else None

    def _claim_fair_once(
        self,
        queue: str,
        limit: int,
        worker: WorkerProcess | None,
        lease: timedelta | None,
        start: str,
    ) -> list[Job]:
        values: dict[str, Any] = {
            "queue": queue,
            "start": start,
            "max_keys": MAX_FAIR_KEYS,
            "max_walk": MAX_FAIR_WALK,
            "limit": limit,
        }
        locking = (sql.FAIR_LOCKING, [values[name] for name in sql.FAIR_LOCKING_PARAMS])
        statement, params = self.claim_statement(
            [queue], limit=limit, worker=worker, lease=lease, locking=locking
        )
        try:
            return self._claim_by(statement, params)
        except DatabaseError as error:
            if is_transient(error):
                raise
            logger.error("fair claim failed, claiming in claim order: %s", redact_text(str(error)))
            return self.claim(queues=[queue], limit=limit, worker=worker, lease=lease)
