"""Claiming under flow control: queue limits, task rate buckets and concurrency keys,
decided in one transaction (`claim_limited`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.db import connections
from django.db.models import (
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    Min,
)
from django.db.models.functions import Now

from django_skipqueue.conf.limits import parse_rate
from django_skipqueue.core.states import (
    JobState,
    sort_in_claim_order,
)
from django_skipqueue.exceptions import (
    ConfigurationError,
)
from django_skipqueue.queue import sql
from django_skipqueue.queue.base import (
    SLOT_RETRY_SECONDS,
    _queue_model,
    _rate_bucket_model,
    refilled,
)
from django_skipqueue.queue.connections import bounded

if TYPE_CHECKING:
    from django_skipqueue.conf.limits import QueueLimit
    from django_skipqueue.models import (
        Job,
        WorkerProcess,
    )

from django_skipqueue.queue.fair import FairClaimVerbs

logger = logging.getLogger(__name__)


class LimitedClaimVerbs(FairClaimVerbs):
    """The limited claim verbs of the job manager."""

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
