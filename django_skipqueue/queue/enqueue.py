"""Enqueueing: one INSERT in the caller's transaction (a call, a batch, unique keys, a
schedule's occurrences), its rows built by `rows`."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, overload

from django.db import DatabaseError, DataError, IntegrityError, connections, transaction
from django.db.models import (
    signals,
)

from django_skipqueue.conf import SkipQueueSettings, get_settings
from django_skipqueue.conf.relay import relayed_queues
from django_skipqueue.core import tracing
from django_skipqueue.core.payload import (
    encode,
    encode_arguments,
    normalize_arguments,
)
from django_skipqueue.core.states import (
    UNFINISHED_STATES,
)
from django_skipqueue.db.direct import (
    binary_bigint,
    binary_timestamptz,
    direct_row,
)
from django_skipqueue.db.hooks import (
    fetch_one,
    has_receivers,
    thread_connection,
)
from django_skipqueue.exceptions import (
    DuplicateJobError,
    InvalidJobError,
    QueueFullError,
)
from django_skipqueue.queue import sql
from django_skipqueue.queue.base import (
    UNIQUE_VIOLATION,
    Checked,
    _batches,
    _call_pair,
    _end_as_expired,
    _expires_at,
    _no_row_returned,
    _run_at,
)
from django_skipqueue.queue.coalesce import enqueue_coalesced
from django_skipqueue.queue.loading import job_cursor, loaded_job, loaded_jobs
from django_skipqueue.queue.rows import enqueue_parts, insert_defaults, insert_params, job_template

if TYPE_CHECKING:
    from django_skipqueue.core.spec import JobSpec
    from django_skipqueue.models import (
        Job,
    )

from django_skipqueue.queue.limited import LimitedClaimVerbs

logger = logging.getLogger(__name__)


class EnqueueVerbs(LimitedClaimVerbs):
    """The enqueue verbs of the job manager."""

    def build(self, spec: JobSpec, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Job:
        """An unsaved, checked Job for one call of `spec`. InvalidJobError before any SQL."""
        spec.check_call(args, kwargs)
        plain_args, plain_kwargs = normalize_arguments(
            args, kwargs, limit=get_settings().MAX_PAYLOAD_BYTES
        )
        self._check_room(spec, 1)
        job = self.model(**spec.columns(plain_args, plain_kwargs))
        if spec.run_after is not None:
            job.run_at = _run_at(spec.run_after)
        if spec.expires is not None:
            job.expires_at = _run_at(spec.expires)
        return job

    def _check_room(
        self, spec: JobSpec, adding: int, conf: SkipQueueSettings | None = None
    ) -> None:
        """The volume guards before any write (case S11, docs/explanation/failure-model.md):
        the spec's own bounds, then, with MAX_PENDING_PER_QUEUE, the queue's pending jobs,
        counted up to the cap only (an index scan of at most that many entries). `conf`:
        the settings the caller read already."""
        conf = conf or get_settings()
        spec.check_bounds(conf)
        self.check_room(spec.queue_name, adding, conf)

    def check_room(
        self, queue_name: str, adding: int, conf: SkipQueueSettings | None = None
    ) -> None:
        """With MAX_PENDING_PER_QUEUE, QueueFullError if `adding` more jobs would pass it
        (the queue's pending jobs counted up to the cap only)."""
        cap = (conf or get_settings()).MAX_PENDING_PER_QUEUE
        if cap is not None:
            pending = self.pending_up_to(queue_name, cap)
            if pending + adding > cap:
                raise QueueFullError(
                    f"queue {queue_name!r} holds {pending} pending jobs; adding {adding} "
                    f"would pass SKIPQUEUE['MAX_PENDING_PER_QUEUE'] ({cap})"
                )

    def enqueue(self, spec: JobSpec, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Job:
        """INSERT one pending job of `spec` in the caller's transaction and return it.

        One statement: `sql.ENQUEUE_ONE`, or `sql.ENQUEUE_MANY` for a job with a unique
        or concurrency key or a rate limit (their conflict and keyed paths live there);
        with a pre_save or post_save receiver connected for Job, the ORM's save(), so
        that the receivers see it.
        """
        if spec.coalesce:
            return enqueue_coalesced(self, spec, args, kwargs)
        receivers = has_receivers(signals.pre_save, self.model) or has_receivers(
            signals.post_save, self.model
        )
        plain = spec.plain
        if receivers and plain:
            job = self.build(spec, args, kwargs)
            job.trace_context = tracing.enqueue_context(spec.name, spec.queue_name)
            job.save(force_insert=True, using=self.db)
            return job
        if not plain:
            return self.enqueue_many(spec, [(args, kwargs)])[0]
        # Measured: one INSERT ... VALUES (sql.ENQUEUE_ONE), not the ORM's save(), which
        # compiles 20 fields per call, nor ENQUEUE_MANY's arrays; sent straight on libpq
        # where nothing can tell (db.direct.direct_row), its shared parameters encoded once
        # per spec.
        checked = self._checked(spec, [(args, kwargs)])
        plain_args, plain_kwargs, args_json, kwargs_json = checked[0]
        trace = tracing.enqueue_context(spec.name, spec.queue_name)
        statement = sql.enqueue_one_statement(
            insert_defaults(self.model), spec.expires is not None, trace is not None
        )
        shared, base_row = enqueue_parts(spec, self.model)
        direct = None
        if shared is not None:
            params = shared | {"args": args_json, "kwargs": kwargs_json}
            if trace is not None:
                params["trace"] = json.dumps(trace)
            direct = direct_row(thread_connection(self.db), statement, params)
        if direct is not None:
            if not direct:
                raise _no_row_returned(spec)
            try:
                job_id, created_at = binary_bigint(direct[0]), binary_timestamptz(direct[2])
                run_at = created_at if direct[1] == direct[2] else binary_timestamptz(direct[1])
            except OverflowError as exc:  # what psycopg's loader raises it as
                raise DataError(f"run_at {exc}: outside Python's years 1 to 9999") from exc
        else:
            params = insert_params(spec, checked)
            params["args"], params["kwargs"] = args_json, kwargs_json
            if trace is not None:
                params["trace"] = json.dumps(trace)
            with job_cursor(self.db) as cursor:
                cursor.execute(statement, params)
                returned = fetch_one(cursor)
            if returned is None:
                raise _no_row_returned(spec)
            job_id, run_at, created_at = returned
        own = {
            "id": job_id,
            "args": plain_args,
            "kwargs": plain_kwargs,
            "errors": [],
            "run_at": run_at,
            "created_at": created_at,
            "expires_at": _expires_at(spec.expires, created_at),
            "trace_context": trace,
        }
        return loaded_job(self.model, self.db, job_template(self.model)[0], base_row, own)

    @overload
    def enqueue_many(
        self,
        spec: JobSpec,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int = ...,
        ids_only: Literal[False] = ...,
    ) -> list[Job]: ...

    @overload
    def enqueue_many(
        self,
        spec: JobSpec,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int = ...,
        ids_only: Literal[True],
    ) -> list[int]: ...

    def enqueue_many(
        self,
        spec: JobSpec,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int = 5000,
        ids_only: bool = False,
    ) -> list[Job] | list[int]:
        """INSERT a pending job of `spec` per call, one statement per `batch_size`.

        See `Task.enqueue_many` for `ids_only`. Statements: `sql.ENQUEUE_MANY`, one per
        batch, in the caller's transaction; the returned jobs are built from what that
        statement returns (ids, run_at, created_at) and the checked calls.

        All or nothing: the batches run in one atomic() block (a savepoint in the
        caller's transaction), so a bad call deep in a stream leaves none of the jobs
        before it, and the caller's transaction goes on usable.
        """
        if batch_size < 1:
            raise InvalidJobError(f"batch_size must be at least 1, got {batch_size}")
        with transaction.atomic(using=self.db):
            return self._enqueue_many(spec, calls, batch_size=batch_size, ids_only=ids_only)

    def _enqueue_many(
        self,
        spec: JobSpec,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int,
        ids_only: bool,
    ) -> list[Job] | list[int]:
        if spec.coalesce:  # one statement per call: each may join another's job
            done = [
                enqueue_coalesced(self, spec, *_call_pair(spec.name, call, n))
                for n, call in enumerate(calls)
            ]
            return [job.id for job in done] if ids_only else done
        if spec.unique_key is not None:
            return self._enqueue_unique(spec, calls, batch_size=batch_size, ids_only=ids_only)
        if ids_only:
            ids: list[int] = []
            for some in _batches(iter(calls), batch_size):
                inserted = self._insert(spec, self._checked(spec, some, first=len(ids)))[0]
                ids.extend(inserted)
            return ids
        checked = self._checked(spec, list(calls))
        names, template = job_template(self.model)
        template = template | spec.shared_columns()
        jobs: list[Job] = []
        for start in range(0, len(checked), batch_size):
            batch = checked[start : start + batch_size]
            inserted, _, run_at, created_at, trace = self._insert(spec, batch)
            shared = template | {
                "trace_context": trace,
                "run_at": run_at,
                "created_at": created_at,
                "expires_at": _expires_at(spec.expires, created_at),
            }
            jobs.extend(
                loaded_jobs(
                    self.model,
                    self.db,
                    names,
                    (
                        shared
                        | {"id": job_id, "args": args, "kwargs": kwargs, "errors": []}
                        | spec.key_columns(args, kwargs)
                        for (args, kwargs, _, _), job_id in zip(batch, inserted, strict=True)
                    ),
                )
            )
        return jobs

    def _enqueue_unique(
        self,
        spec: JobSpec,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int,
        ids_only: bool,
    ) -> list[Job] | list[int]:
        """Unique jobs: each call's key (`Task.key_for`) either inserts a job or meets the
        unfinished job that holds it, and then `spec.on_conflict` decides: "existing"
        returns that job, "replace" gives it this call's arguments and run time if it is
        still pending, "raise" raises DuplicateJobError.

        Statements, in the caller's transaction: per batch, the INSERT ... ON CONFLICT DO
        NOTHING (`sql.ENQUEUE_MANY`, unique form); for the keys it did not insert, the
        replace (`sql.REPLACE_PENDING`) and a lookup of the jobs holding them
        (`sql.UNFINISHED_WITH_KEYS`). A holder that finished in between frees its key:
        the call is inserted again, a few times at most. No statement fails on a
        conflict, so the caller's transaction is never aborted by one.
        """
        checked: list[Checked] = []
        for some in _batches(iter(calls), batch_size):  # checked as they come, for errors
            checked += self._checked(spec, some, first=len(checked))
        keys = [spec.key_for(args, kwargs) for args, kwargs, _, _ in checked]
        # One call per key, as if the calls were made one after another: the first for
        # "existing", the last for "replace", and "raise" on a repeat.
        chosen: dict[str, int] = {}
        for position, key in enumerate(keys):
            if key in chosen and spec.on_conflict == "raise":
                raise DuplicateJobError(spec.name, key, None)
            if key not in chosen or spec.on_conflict == "replace":
                chosen[key] = position
        # The keys in one order across every batch, whoever inserts them: two
        # transactions enqueuing the same keys in opposite orders deadlocked on the key's
        # index when each batch alone was sorted (3 of 3, batches of 10).
        order = sorted(chosen)
        held: dict[str, int] = {}
        for start in range(0, len(order), batch_size):
            part = order[start : start + batch_size]
            holders = self._insert_unique(spec, [checked[chosen[key]] for key in part], part)
            held.update(zip(part, holders, strict=True))
        ids = [held[key] for key in keys]
        if ids_only:
            return ids
        found = self.in_bulk(ids)
        return [found[job_id] for job_id in ids]

    def _insert_unique(self, spec: JobSpec, checked: list[Checked], keys: list[str]) -> list[int]:
        """The ids of the jobs that now hold each key: inserted or already there."""
        holders: dict[str, int] = {}
        todo = list(range(len(checked)))
        for _ in range(5):
            if not todo:
                break
            batch = [checked[i] for i in todo]
            inserted, inserted_keys = self._insert(spec, batch, [keys[i] for i in todo])[:2]
            holders.update(zip(inserted_keys, inserted, strict=True))
            fresh = set(inserted_keys)
            conflicts = list(dict.fromkeys(keys[i] for i in todo if keys[i] not in fresh))
            if conflicts and self._expire_holders(spec.name, conflicts):
                continue  # a holder past its expiry, ended now: its key is free again
            if conflicts and spec.on_conflict == "raise":
                found = self._holders(spec, conflicts)
                key = conflicts[0]
                raise DuplicateJobError(spec.name, key, found.get(key, (None, None))[0])
            if conflicts and spec.on_conflict == "replace":
                last = {keys[i]: checked[i] for i in todo if keys[i] in conflicts}
                holders.update(self._replace_pending(spec, last))
            found = self._holders(spec, [key for key in conflicts if key not in holders])
            holders.update((key, job_id) for key, (job_id, _) in found.items())
            todo = [i for i in todo if keys[i] not in holders]
        if todo:
            raise DatabaseError(
                f"unique key {keys[todo[0]]!r} of {spec.name}: its holder kept finishing "
                f"while a new job was inserted; try again"
            )
        return [holders[key] for key in keys]

    def _expire_holders(self, task_name: str, keys: list[str]) -> int:
        """End the holders of these keys that are past their expiry (never to run): an
        enqueue meeting one must not return a job the reaper is about to end. In the
        caller's transaction; how many were ended."""
        return _end_as_expired(self.filter(task=task_name, unique_key__in=keys).past_expiry())

    def _holders(self, spec: JobSpec, keys: list[str]) -> dict[str, tuple[int, str]]:
        """{key: (id, state)} of the unfinished jobs of `spec` holding `keys`."""
        if not keys:
            return {}
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.UNFINISHED_WITH_KEYS, [spec.name, keys, list(UNFINISHED_STATES)])
            return {key: (job_id, state) for key, job_id, state in cursor.fetchall()}

    def _replace_pending(self, spec: JobSpec, calls: dict[str, Checked]) -> dict[str, int]:
        """The pending holders of these keys take the calls' arguments and run time."""
        params = insert_params(spec, list(calls.values()))
        params["keys"] = encode(list(calls))
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.REPLACE_PENDING, params)
            return dict(cursor.fetchall())

    def enqueue_occurrences(
        self,
        spec: JobSpec,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        *,
        schedule: str,
        instants: Sequence[datetime],
        expires_from: datetime | None = None,
    ) -> int:
        """Insert a schedule's due occurrences (one call of `spec`, at each of `instants`),
        in the caller's transaction; returns how many were inserted.

        Each row comes from `spec.columns()`, as every enqueue's does, with the
        occurrence's instant as its run_at. An occurrence another worker inserted first
        (the occurrence constraint), or whose unique key an unfinished job holds, is
        skipped, each in a savepoint so that the transaction goes on.
        `MAX_PENDING_PER_QUEUE` holds for them as for any enqueue: an occurrence that
        would pass it is not enqueued, and a warning says so. A schedule's expiry counts
        from each occurrence, or from `expires_from` (a backfill's now: its occurrences
        are past, and would all expire unrun).
        """
        jobs = [
            self.model(
                **spec.columns(args, kwargs),
                run_at=instant,
                schedule=schedule,
                scheduled_for=instant,
                # A schedule's expiry is a delay after the occurrence's instant.
                expires_at=_expires_at(spec.expires, expires_from or instant),
            )
            for instant in instants
        ]
        cap = get_settings().MAX_PENDING_PER_QUEUE
        inserted = 0
        for job in jobs:
            if cap is not None and self.pending_up_to(job.queue_name, cap) >= cap:
                logger.warning(
                    "schedule occurrence not enqueued schedule=%s at=%s: queue %s holds "
                    "SKIPQUEUE['MAX_PENDING_PER_QUEUE'] (%d) pending jobs",
                    job.schedule,
                    job.scheduled_for,
                    job.queue_name,
                    cap,
                )
                continue
            try:
                with transaction.atomic(using=self.db):
                    job.save(force_insert=True, using=self.db)
            except IntegrityError as error:
                if getattr(error.__cause__, "sqlstate", None) != UNIQUE_VIOLATION:
                    raise
                continue  # enqueued already, or its unique key is held
            inserted += 1
        return inserted

    # -- relayed queues: the table as the broker's outbox -----------------------------

    #: The columns a relayed job's message carries.
    MESSAGE_FIELDS = (
        "id", "task", "queue_name", "args", "kwargs", "attempts", "max_attempts", "lease"
    )  # fmt: skip

    def pending_up_to(self, queue_name: str, cap: int) -> int:
        """Pending jobs of a queue, counted up to `cap` only (`sql.COUNT_PENDING_UP_TO`)."""
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.COUNT_PENDING_UP_TO, [queue_name, cap])
            return int(cursor.fetchone()[0])

    def _checked(
        self,
        spec: JobSpec,
        calls: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        first: int = 0,
    ) -> list[Checked]:
        """Each call bound to the task's signature and encoded, then the volume guards.
        `first`: the index of the first of `calls` among the caller's, for errors."""
        settings = get_settings()
        limit = settings.MAX_PAYLOAD_BYTES
        keyed = not spec.plain
        if keyed and settings.RELAY and spec.queue_name in relayed_queues():
            raise InvalidJobError(
                f"queue {spec.queue_name!r} is relayed to RabbitMQ, which keeps no unique or "
                f"concurrency key and no rate limit: enqueue {spec.name} with its key or "
                f"limit on a queue of the job table, or without them"
            )
        checked: list[Checked] = []
        for call in calls:
            index = first + len(checked)
            args, kwargs = _call_pair(spec.name, call, index)
            try:
                spec.check_call(args, kwargs)
                checked.append(encode_arguments(args, kwargs, limit=limit))
            except InvalidJobError as error:
                if len(calls) > 1 or first:  # enqueue_many: which call, of thousands
                    error.args = (f"call {index}: {error}", *error.args[1:])
                raise
        self._check_room(spec, len(checked), settings)
        return checked

    def _insert(
        self, spec: JobSpec, batch: Sequence[Checked], keys: Sequence[str] | None = None
    ) -> tuple[list[int], list[str], datetime, datetime, dict[str, str] | None]:
        """One INSERT of checked calls: the ids inserted, their unique keys (with `keys`:
        conflicting calls insert nothing), the run_at and created_at they share, and the
        trace context stored with them."""
        params = insert_params(spec, batch)
        if keys is not None:
            params["keys"] = encode(list(keys))
        trace = tracing.enqueue_context(spec.name, spec.queue_name, len(batch))
        if trace is not None:
            params["trace"] = json.dumps(trace)
        keyed = spec.keyed
        if keyed or spec.fair:
            columns = [spec.key_columns(args, kwargs) for args, kwargs, _, _ in batch]
        if keyed:
            params["concurrency_keys"] = encode([one["concurrency_key"] for one in columns])
            params["concurrency_limit"] = columns[0]["concurrency_limit"] if columns else 1
            if spec.rate_key_rule is not None:
                params["rate_keys"] = encode([one["rate_key"] for one in columns])
        if spec.fair:
            params["fair_keys"] = encode([one["fair_key"] for one in columns])
            params["fair_weight"] = spec.fair_weight
        if spec.ordered_key is not None:
            params["order_hold"] = spec.order_hold
            with connections[self.db].cursor() as cursor:
                ordered = sorted({one["concurrency_key"] for one in columns})
                cursor.execute(sql.LOCK_ORDERED_KEYS, [ordered])
        statement = sql.enqueue_many_statement(
            insert_defaults(self.model),
            keys is not None,
            keyed,
            spec.expires is not None,
            spec.rate_limit is not None,
            trace is not None,
            spec.rate_key_rule is not None,
            spec.fair,
            spec.ordered_key is not None,
        )
        with job_cursor(self.db) as cursor:
            cursor.execute(statement, params)
            ids, inserted_keys, run_at, created_at = fetch_one(cursor)[:4]
        return ids, inserted_keys, run_at, created_at, trace
