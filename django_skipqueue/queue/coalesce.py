"""Debounce and throttle (`@task(debounce=...)`, `@task(throttle=...)`): the calls that
share a task and a coalesce key join one pending job (docs/howto/flow-control.md).

- Debounce (trailing): a call's job runs `debounce` after it; each call of the key that
  comes while the job is pending gives it its arguments and moves its run time to
  `debounce` after itself, but never past `debounce_max_wait` after the first call. The
  job runs once, with the last call's arguments.
  Its expiry is the last call's too; its queue and priority stay the first call's.
- Throttle (leading): at most one start per period per key, the token buckets of rate
  limits per key (`rate_limit` "1/<period>", spec.rate_key_rule); the first call's job
  is due at once, and the calls that come while a job of the key is pending join it.

One statement per call (`sql.COALESCE_INSERT`, INSERT ... ON CONFLICT on the partial
unique index of pending jobs by task and key), in the caller's transaction: concurrent
enqueues of one key, in any number of web processes, make one pending job; a rolled
back call changes nothing; a running job never takes a call (the next call makes the
next job: a change during a run is not lost). A claimed job leaves its key (the claim
clears `coalesce_key`): set back to pending by a retry, a release or the reaper, it is
a job of its own, which calls no longer join.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from django.db import connections

from django_skipqueue.conf import get_settings
from django_skipqueue.conf.relay import relayed_queues
from django_skipqueue.exceptions import InvalidJobError
from django_skipqueue.queue import sql

if TYPE_CHECKING:
    from django_skipqueue.core.spec import JobSpec
    from django_skipqueue.models import Job


class Builds(Protocol):
    """What this module needs of the job manager (queue/enqueue.py's EnqueueVerbs)."""

    db: str
    model: type[Job]

    def build(self, spec: JobSpec, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Job: ...


#: The columns the statement fills itself (the rest come from the built job).
OWN_COLUMNS = frozenset({"id", "run_at", "created_at", "coalesce_until", "expires_at"})
#: How often a throttled call tries again when the pending job it met was claimed
#: between its INSERT and its look (each a statement; then it inserts its own).
TRIES = 5


def enqueue_coalesced(
    jobs: Builds, spec: JobSpec, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Job:
    """One call of a debounced or throttled task: the pending job it made or joined."""
    if get_settings().RELAY and spec.queue_name in relayed_queues():
        raise InvalidJobError(
            f"queue {spec.queue_name!r} is relayed to RabbitMQ, which cannot join calls into "
            f"one job: enqueue {spec.name} on a queue of the job table"
        )
    job = jobs.build(spec, args, kwargs)  # the call's checks, the queue's room, its columns
    connection = connections[jobs.db]
    fields = [f for f in jobs.model._meta.concrete_fields if f.attname not in OWN_COLUMNS]
    values = [f.get_db_prep_save(getattr(job, f.attname), connection) for f in fields]
    run_after = spec.run_after
    delay = run_after if isinstance(run_after, timedelta) else timedelta(0)
    at = run_after if isinstance(run_after, datetime) else None
    debounced = spec.coalesce == "debounce"
    if debounced:
        delay += spec.debounce or timedelta(0)
    bound = spec.debounce_max_wait if debounced else None
    expires = spec.expires
    expires_at = expires if isinstance(expires, datetime) else None
    expires_in = expires if isinstance(expires, timedelta) else None
    statement = sql.coalesce_statement(tuple(f.column for f in fields), debounced)
    params = [*values, at, delay, bound, expires_at, expires_in]
    with connections[jobs.db].cursor() as cursor:
        for _ in range(TRIES):
            cursor.execute(statement, params)
            row = cursor.fetchone()
            if row is None:  # a throttle's conflict: the pending job of the key
                cursor.execute(sql.COALESCE_HOLDER, [spec.name, job.coalesce_key])
                row = cursor.fetchone()
            if row is not None:
                break
        else:
            raise InvalidJobError(
                f"{spec.name}: the pending job of its throttle key was claimed {TRIES} times "
                f"between this call's statements; enqueue again"
            )
        if spec.keyed:  # a throttle's rate: tell the workers' keyed claim
            cursor.execute("SELECT pg_notify(%s, '')", [sql.KEYED_CHANNEL])
    return jobs.model._base_manager.db_manager(jobs.db).get(pk=row[0])
