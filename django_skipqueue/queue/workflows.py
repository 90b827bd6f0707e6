"""Workflows in the queue's tables: the verbs that start, wait for, cancel and resume them.

A workflow is a set of job rows (chains, groups, chords: docs/howto/workflows.md) and a
row of its own. `start` inserts them all in the caller's transaction (in a savepoint, so
that a refusal leaves the caller's transaction usable and nothing half-written). From
then on the database moves the workflow on by itself: the trigger of migration 0012 runs
in the transaction of whatever statement finishes one of its jobs (a fenced ack, the
reaper, an operator's cancel or retry), so no resolver sits beside the completion path:

- a job done: each dependent waits on one parent fewer, and the last parent's ack makes
  it pending (due) in that same transaction. A stale attempt's ack is refused by the
  fence before any of this, so it can unblock nothing. Concurrent siblings serialise on
  the dependent's row lock; each decrement applies to the latest count.
- a job failed (its attempts spent) or cancelled: every job downstream of it is ended
  cancelled (`cancelled_by` UPSTREAM, the reason in `last_error`) and never runs; the
  workflow ends failed once, and its `on_error` job becomes due.
- an operator's retry of that job: its downstream jobs wait again and the workflow runs.
- the last output job done: the workflow ends done; a NOTIFY wakes `wait()`ers.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.db import connections, models, transaction
from django.db.models.functions import Now

from django_skipqueue.conf import get_settings
from django_skipqueue.conf.relay import relayed_queues
from django_skipqueue.core import tracing
from django_skipqueue.core.payload import Undecodable, encode_arguments
from django_skipqueue.core.running import checked_timeout, refuse_waiting_in_a_task
from django_skipqueue.core.spec import JobSpec
from django_skipqueue.core.states import (
    FINISHED_STATES,
    UNFINISHED_STATES,
    UNNEEDED,
    UPSTREAM,
    JobState,
    WorkflowState,
)
from django_skipqueue.exceptions import (
    DuplicateJobError,
    InvalidJobError,
    WorkflowFailed,
    WorkflowNotFinished,
)
from django_skipqueue.queue import finished, sql
from django_skipqueue.queue.finished import finished_listener
from django_skipqueue.queue.rows import insert_defaults, insert_params

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Channel of the NOTIFY sent when a workflow finishes (no payload: waiters re-read
#: their own row). Waiting polls as well, every POLL_SECONDS, in case a NOTIFY is lost
#: (a pooler that does not pass LISTEN on, say).
FINISHED_CHANNEL = finished.FINISHED_CHANNEL
POLL_SECONDS = 1.0
#: Rows of one INSERT when a workflow's jobs are written.
INSERT_BATCH = 5000

#: A job's inputs, by its position in the plan: a position, or a list of such trees.
Tree = int | list[Any]


@dataclass(frozen=True)
class PlannedJob:
    """One job of a workflow, before it has an id: positions refer to other planned jobs."""

    spec: JobSpec
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    parents: tuple[int, ...] = ()
    #: The parents' results it receives as its first argument (None: none, `.si()`).
    inputs: Tree | None = None
    #: Its result is part of the workflow's result.
    output: bool = False
    #: The workflow's on_error job: it receives the failed job's id and error.
    on_error: bool = False


@dataclass(frozen=True)
class Plan:
    """A workflow's jobs in order (parents before their dependents) and its result tree."""

    name: str
    jobs: tuple[PlannedJob, ...]
    output: Tree


class WorkflowQuerySet(models.QuerySet["Any"]):
    def resumable(self) -> WorkflowQuerySet:
        """Running, or failed (an operator's retry resumes it): their jobs are kept."""
        return self.filter(state__in=[WorkflowState.RUNNING, WorkflowState.FAILED])

    def finished(self) -> WorkflowQuerySet:
        return self.exclude(state=WorkflowState.RUNNING)


class WorkflowManager(models.Manager.from_queryset(WorkflowQuerySet)):  # type: ignore[misc]
    """The protocol verbs of workflows; every one runs in the caller's transaction."""

    @property
    def _jobs(self) -> Any:
        """Job.objects on this manager's database (the model is reached through the
        relation, so that this module need not import models)."""
        job_model = self.model._meta.get_field("jobs").related_model
        return job_model.objects.db_manager(self.db)

    # -- start -------------------------------------------------------------------------

    def start(self, plan: Plan) -> Any:
        """Insert the workflow's row and every job of `plan`, in the caller's transaction.

        Checked before any row is written: each call against its task's signature (a
        dependent's first argument is its parents' result), the payload limit, the
        volume guards, and that no job is on a relayed queue. A unique key held by an
        unfinished job raises DuplicateJobError; the savepoint around the inserts is then
        rolled back, so the caller's transaction goes on and nothing of the workflow
        exists. Statements: the workflow row, one `nextval` of as many ids as jobs, and
        one INSERT per INSERT_BATCH jobs (`sql.workflow_insert_statement`).
        """
        checks = _Checks()
        encoded = [checks.encoded(planned) for planned in plan.jobs]
        self._check_room(plan.jobs)
        with transaction.atomic(using=self.db):
            workflow = self.create(name=plan.name[:255])
            ids = self._reserve_ids(len(plan.jobs))
            dependents: dict[int, list[int]] = {}
            for position, planned in enumerate(plan.jobs):
                for parent in sorted(set(planned.parents)):
                    dependents.setdefault(parent, []).append(ids[position])
            rows = [
                _row(ids, position, planned, dependents.get(position), args_json, kwargs_json)
                for position, (planned, (_, _, args_json, kwargs_json)) in enumerate(
                    zip(plan.jobs, encoded, strict=True)
                )
            ]
            for start in range(0, len(rows), INSERT_BATCH):
                self._insert(
                    workflow.id,
                    rows[start : start + INSERT_BATCH],
                    plan.jobs[start : start + INSERT_BATCH],
                    ids[start : start + INSERT_BATCH],
                )
            outputs = {ids[p] for p in _positions(plan.output)}
            on_error = [ids[p] for p, planned in enumerate(plan.jobs) if planned.on_error]
            self._finish_start(workflow, _with_ids(plan.output, ids), len(outputs), on_error)
        logger.info("workflow enqueued id=%s name=%s jobs=%d", workflow.id, workflow.name, len(ids))
        return workflow

    def start_streamed(
        self,
        name: str,
        members: Iterable[PlannedJob],
        *,
        body: PlannedJob | None = None,
        on_error: PlannedJob | None = None,
        named: Callable[[], str] | None = None,
    ) -> Any:
        """A group, or a chord's group and body, whose members come from an iterable read
        one INSERT_BATCH at a time: memory stays bounded by the batch (and the members'
        ids), as with `enqueue_many(ids_only=True)`. Members are independent jobs (no
        parents); with `body`, each names the body as its dependent, and the body (given
        its id first) waits on as many as there were. One savepoint around it all, as in
        `start`: a refusal in any batch leaves nothing of the workflow. `named`: the
        name, once the members were read (it says what they were), in place of `name`.
        """
        checks = _Checks()
        first = [checks.encoded(extra) for extra in (body, on_error) if extra is not None]
        with transaction.atomic(using=self.db):
            workflow = self.create(name=name[:255])
            extra_ids = self._reserve_ids(len(first))
            body_id = extra_ids[0] if body is not None else None
            member_ids: list[int] = []
            for batch in _chunks(iter(members), INSERT_BATCH):
                encoded = [
                    checks.encoded(planned, position=len(member_ids) + index)
                    for index, planned in enumerate(batch)
                ]
                self._check_room(batch)
                dependents = [body_id] if body_id is not None else None
                if _one_plain_spec(batch):  # the common fan-out: one INSERT by columns
                    member_ids.extend(self._insert_columns(workflow.id, batch, encoded, dependents))
                    continue
                ids = self._reserve_ids(len(batch))
                rows = [
                    _row(
                        ids,
                        position,
                        planned,
                        [body_id] if body_id is not None else None,
                        args_json,
                        kwargs_json,
                    )
                    for position, (planned, (_, _, args_json, kwargs_json)) in enumerate(
                        zip(batch, encoded, strict=True)
                    )
                ]
                self._insert(workflow.id, rows, batch, ids)
                member_ids.extend(ids)
            extras: list[PlannedJob] = []
            if body is not None:
                inputs = None if body.inputs is None else list(range(1, len(member_ids) + 1))
                extras.append(
                    dataclasses.replace(
                        body, parents=tuple(range(1, len(member_ids) + 1)), inputs=inputs
                    )
                )
            if on_error is not None:
                extras.append(on_error)
            if extras:
                # Positions 1.. are the members here: the body's row names their ids.
                lookup = [extra_ids[0], *member_ids] if body is not None else extra_ids
                rows = []
                for index, (planned, (_, _, args_json, kwargs_json)) in enumerate(
                    zip(extras, first, strict=True)
                ):
                    own = [extra_ids[index], *lookup[1:]]
                    rows.append(_row(own, 0, planned, None, args_json, kwargs_json))
                self._insert(workflow.id, rows, extras, extra_ids)
            output: Any = body_id if body_id is not None else member_ids
            outputs = 1 if body_id is not None else len(member_ids)
            errors = [extra_ids[-1]] if on_error is not None else []
            self._finish_start(workflow, output, outputs, errors)
            if named is not None:
                workflow.name = named()[:255]
                workflow.save(update_fields=["name"])
        logger.info(
            "workflow enqueued id=%s name=%s jobs=%d",
            workflow.id,
            workflow.name,
            len(member_ids) + len(first),
        )
        return workflow

    def _insert_columns(
        self,
        workflow_id: int,
        batch: list[PlannedJob],
        encoded: list[tuple[Any, Any, str, str]],
        dependents: list[int] | None,
    ) -> list[int]:
        """Members of one spec without keys, as `enqueue_many` writes jobs (one JSON array
        per payload column, the shared columns once: `sql.workflow_columns_statement`);
        their ids, in the order given."""
        spec, first = batch[0].spec, batch[0]
        params = insert_params(spec, encoded)
        params |= {
            "workflow": workflow_id,
            "dependents": None if dependents is None else json.dumps(dependents),
            "ends": True if first.output else None,
        }
        statement = sql.workflow_columns_statement(insert_defaults(self._jobs.model))
        with connections[self.db].cursor() as cursor:
            cursor.execute(statement, params)
            ids = sorted(row[0] for row in cursor.fetchall())  # nextval ran in this order
        if len(ids) != len(batch):
            raise InvalidJobError(f"{len(batch) - len(ids)} jobs of the workflow not written")
        return ids

    def _insert(
        self, workflow_id: int, rows: list[str], planned: Sequence[PlannedJob], ids: list[int]
    ) -> None:
        """One INSERT of these rows; DuplicateJobError if a unique key is held."""
        statement = sql.workflow_insert_statement(insert_defaults(self._jobs.model))
        with connections[self.db].cursor() as cursor:
            cursor.execute(statement, {"workflow": workflow_id, "rows": "[" + ",".join(rows) + "]"})
            got = {row[0] for row in cursor.fetchall()}
            trace = tracing.enqueue_context(
                "workflow", planned[0].spec.queue_name if planned else "", len(got)
            )
            if trace is not None and got:  # each job carries the enqueuing span's context
                cursor.execute(
                    "UPDATE skipqueue_job SET trace_context = %s::jsonb WHERE id = ANY(%s)",
                    [json.dumps(trace), sorted(got)],
                )
            if len(got) < len(rows):
                self._refuse_held_key(planned, ids, got)
            if any(job.spec.keyed for job in planned):
                cursor.execute("SELECT pg_notify(%s, '')", [sql.KEYED_CHANNEL])

    def _finish_start(self, workflow: Any, output: Any, outputs: int, on_error: list[int]) -> None:
        workflow.output = output
        workflow.outputs_left = outputs
        workflow.on_error_job_id = on_error[0] if on_error else None
        fields = ["output", "outputs_left", "on_error_job_id"]
        if not outputs:  # an empty group: nothing to wait for
            workflow.state, workflow.finished_at = WorkflowState.DONE, Now()
            fields += ["state", "finished_at"]
        workflow.save(update_fields=fields)
        if not outputs:
            workflow.refresh_from_db(fields=["finished_at"])
            if on_error:  # nothing can fail: its on_error job is not needed
                self._jobs.filter(id__in=on_error, state=JobState.WAITING).update(
                    state=JobState.CANCELLED, finished_at=Now(), cancelled_by=UNNEEDED
                )

    def _check_room(self, jobs: Sequence[PlannedJob]) -> None:
        cap = get_settings().MAX_PENDING_PER_QUEUE
        if cap is None:
            return
        adding: dict[str, int] = {}
        for planned in jobs:
            adding[planned.spec.queue_name] = adding.get(planned.spec.queue_name, 0) + 1
        for queue_name, count in adding.items():
            self._jobs.check_room(queue_name, count)

    def _reserve_ids(self, count: int) -> list[int]:
        """`count` job ids from the job table's own sequence, so that rows may name each
        other (dependents, inputs) in the INSERT that writes them."""
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.RESERVE_JOB_IDS, [count])
            return [row[0] for row in cursor.fetchall()]

    def _refuse_held_key(
        self, jobs: Sequence[PlannedJob], ids: Sequence[int], inserted: set[int]
    ) -> None:
        for position, planned in enumerate(jobs):
            if ids[position] in inserted or planned.spec.unique_key is None:
                continue
            key = planned.spec.key_for(planned.args, planned.kwargs)
            holder = (
                self._jobs.filter(
                    task=planned.spec.name, unique_key=key, state__in=UNFINISHED_STATES
                )
                .values_list("id", flat=True)
                .first()
            )
            raise DuplicateJobError(planned.spec.name, key, holder)

    # -- results -----------------------------------------------------------------------

    def result_of(self, workflow: Any) -> Any:
        """The result of a finished workflow, read now (see Workflow.result)."""
        workflow.refresh_from_db()
        if workflow.state == WorkflowState.RUNNING:
            raise WorkflowNotFinished(workflow.id)
        if workflow.state != WorkflowState.DONE:
            raise WorkflowFailed(
                workflow.id, workflow.failed_job_id, workflow.error or str(workflow.state)
            )
        return self.resolve(workflow.output)

    def resolve(self, tree: Any) -> Any:
        """A tree of job ids with each id replaced by that job's result."""
        try:
            wanted = list(_positions(tree))
        except (TypeError, ValueError) as error:  # a tree another client broke
            raise InvalidJobError(f"a workflow's tree of job ids is broken: {error!r}") from None
        results = dict(self._jobs.filter(id__in=wanted).values_list("id", "result"))
        for job_id, value in results.items():
            if isinstance(value, Undecodable):
                raise InvalidJobError(f"job {job_id}'s result cannot be loaded: {value.reason}")
        missing = [job_id for job_id in wanted if job_id not in results]
        if missing:
            raise InvalidJobError(
                f"the results of jobs {missing[:5]} are gone (pruned?): a workflow's "
                f"results live in its job rows"
            )
        return _replaced(tree, results)

    def inputs_of(self, job: Any) -> list[Any]:
        """What a workflow job receives before its own arguments, read at run time: its
        parents' results as one value, or for an on_error job the failed job's id and
        error. [] for a job without inputs."""
        inputs = job.inputs
        if not inputs:
            return []
        if not isinstance(inputs, dict):
            raise InvalidJobError(f"job {job.id} has inputs that are not a JSON object")
        try:
            if inputs.get("failure"):
                found = self.filter(id=job.workflow_id).values("failed_job_id", "error").first()
                if found is None:
                    return [None, ""]
                return [found["failed_job_id"], found["error"]]
            return [self.resolve(inputs["results"])]
        except (KeyError, TypeError, ValueError) as error:  # written by another client
            raise InvalidJobError(f"job {job.id} has inputs of no known shape: {error!r}") from None

    def wait_for(
        self, workflow: Any, timeout: float | None = None, *, allow_in_task: bool = False
    ) -> Any:
        """Block until `workflow` finishes; its result, or WorkflowFailed. TimeoutError
        after `timeout` seconds. Woken through this process's one LISTEN connection for
        every waiter (queue/finished.py: never the caller's connection, which may be in
        a transaction); reads the row again every POLL_SECONDS as the fallback. Refused
        inside a task unless `allow_in_task` (core/running.py)."""
        timeout = checked_timeout(timeout)
        refuse_waiting_in_a_task(f"workflow {workflow.id}", allow_in_task)
        deadline = None if timeout is None else time.monotonic() + timeout
        with finished_listener(self.db).waiting() as listener:
            seen = listener.generation
            while True:
                workflow.refresh_from_db(fields=["state"])
                if workflow.state != WorkflowState.RUNNING:
                    return self.result_of(workflow)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"workflow {workflow.id} still running after {timeout} s")
                wait = POLL_SECONDS if left is None else min(POLL_SECONDS, left)
                seen = listener.wait(seen, wait)

    # -- operators ---------------------------------------------------------------------

    def cancel(self, ids: Iterable[int], *, by: str = "") -> int:
        """End these workflows cancelled: each unfinished job of them is cancelled
        (waiting and pending ones at once, running ones asked to stop). Returns how many
        workflows changed; a finished workflow is left as it is."""
        ids = list(ids)
        with transaction.atomic(using=self.db):
            changed = list(
                self.filter(id__in=ids, state__in=[WorkflowState.RUNNING, WorkflowState.FAILED])
                .order_by("id")  # the one order every writer takes (sql.LOCK_WORKFLOWS_OF)
                .select_for_update(no_key=True)
                .values_list("id", flat=True)
            )
            if not changed:
                return 0
            self.filter(id__in=changed).update(
                state=WorkflowState.CANCELLED,
                finished_at=Now(),
                error=f"cancelled by {by or 'an operator'}",
            )
            unfinished = self._jobs.filter(workflow_id__in=changed).exclude(
                state__in=FINISHED_STATES
            )
            self._jobs.cancel(list(unfinished.values_list("id", flat=True)), by=by)
            with connections[self.db].cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, '')", [FINISHED_CHANNEL])
        return len(changed)

    def prune(self, *, finished_before: timedelta, dry_run: bool = False) -> int:
        """Delete workflows finished longer ago than `finished_before` whose jobs are all
        pruned already (their rows hold the results); how many (or would, `dry_run`)."""
        job_model = self._jobs.model
        old = (
            self.finished()
            .filter(finished_at__lt=Now() - finished_before)
            .exclude(models.Exists(job_model.objects.filter(workflow_id=models.OuterRef("id"))))
        )
        if dry_run:
            return int(old.count())
        return int(old.delete()[0])

    def retry_failed(self, ids: Iterable[int]) -> int:
        """An operator's retry of the failed or cancelled jobs of each failed workflow (not
        those cancelled because of them: they wait again on their own when their parent
        is retried). A workflow an operator cancelled is left as it is. Returns how many
        jobs were retried."""
        failed = self.filter(id__in=list(ids), state=WorkflowState.FAILED)
        jobs = self._jobs.filter(
            workflow__in=failed, state__in=[JobState.FAILED, JobState.CANCELLED]
        ).exclude(cancelled_by=UPSTREAM)
        return int(self._jobs.retry_now(list(jobs.values_list("id", flat=True))))


def _row(
    ids: Sequence[int],
    position: int,
    planned: PlannedJob,
    dependents: list[int] | None,
    args_json: str,
    kwargs_json: str,
) -> str:
    """One record of the INSERT's JSON array: the columns a spec shares (encoded once per
    spec, `_shared_json`), this job's own, and the payloads spliced in as encoded."""
    spec = planned.spec
    parents = set(planned.parents)
    inputs: Any = None
    if planned.on_error:
        inputs = {"failure": True}
    elif planned.inputs is not None:
        inputs = {"results": _with_ids(planned.inputs, ids)}
    own: dict[str, Any] = {
        "id": ids[position],
        "state": JobState.WAITING if parents or planned.on_error else JobState.PENDING,
    }
    if parents:
        own["waiting_on"] = len(parents)
    if dependents:
        own["dependents"] = dependents
    if inputs is not None:
        own["inputs"] = inputs
    if planned.output:
        own["ends_workflow"] = True
    if not spec.plain:
        own |= spec.key_columns(planned.args, planned.kwargs)
    text = json.dumps(own, separators=(",", ":"))
    return f'{text[:-1]},{_shared_json(spec)},"args":{args_json},"kwargs":{kwargs_json}}}'


@functools.lru_cache(maxsize=256)
def _shared_json(spec: JobSpec) -> str:
    """The columns every job of `spec` holds alike, as the members of a JSON object."""
    columns = spec.shared_columns()
    run_after = spec.run_after
    shared = {
        "task": columns["task"],
        "queue_name": columns["queue_name"],
        "priority": columns["priority"],
        "run_at": run_after.isoformat() if isinstance(run_after, datetime) else None,
        "delay": run_after.total_seconds() if isinstance(run_after, timedelta) else 0.0,
        "lease": columns["lease"].total_seconds(),
        "max_attempts": columns["max_attempts"],
        "expires_at": spec.expires.isoformat() if isinstance(spec.expires, datetime) else None,
        "expires_in": spec.expires.total_seconds() if isinstance(spec.expires, timedelta) else None,
        "rate_limit": spec.rate_limit,
    }
    if spec.rate_key_rule is None:  # per key: each job's own (`key_columns`), not shared
        shared["rate_key"] = spec.rate_key
    return json.dumps(shared, separators=(",", ":"))[1:-1]


class _Checks:
    """The checks of each job before any row is written, and its encoded arguments."""

    def __init__(self) -> None:
        self.settings = get_settings()
        self.relayed = relayed_queues() if self.settings.RELAY else set()
        self.bounded: dict[int, JobSpec] = {}  # specs checked already, by identity

    def encoded(
        self, planned: PlannedJob, position: int | None = None
    ) -> tuple[Any, Any, str, str]:
        """The job's encoded arguments, once its checks pass; `position`, a streamed
        group's member's index, is named in a refusal (member 70,001 of a generator)."""
        if position is None:
            return self._encoded(planned)
        try:
            return self._encoded(planned)
        except InvalidJobError as error:
            error.args = (f"member {position} of the group: {error}", *error.args[1:])
            raise

    def _encoded(self, planned: PlannedJob) -> tuple[Any, Any, str, str]:
        spec = planned.spec
        if self.bounded.get(id(spec)) is not spec:
            self._check_spec(spec)
            self.bounded[id(spec)] = spec
        first: tuple[Any, ...] = ()
        if planned.on_error:
            first = (0, "")
        elif planned.inputs is not None:
            first = (None,)
        spec.check_call((*first, *planned.args), planned.kwargs)
        return encode_arguments(planned.args, planned.kwargs, limit=self.settings.MAX_PAYLOAD_BYTES)

    def _check_spec(self, spec: JobSpec) -> None:
        if spec.queue_name in self.relayed:
            raise InvalidJobError(
                f"{spec.name} is on queue {spec.queue_name!r}, which is relayed to "
                f"RabbitMQ: a workflow needs the job table's fenced acks to move on; "
                f"put its jobs on queues of the table"
            )
        if spec.ordered_key is not None:
            raise InvalidJobError(
                f"{spec.name} has an ordered key: a workflow orders its jobs itself; "
                f"enqueue it from a step instead"
            )
        if spec.coalesce:
            raise InvalidJobError(
                f"{spec.name} is debounced or throttled: its calls join one pending job, "
                f"and a workflow's job must be its own; enqueue it from a step instead"
            )
        spec.check_bounds()


def _one_plain_spec(batch: list[PlannedJob]) -> bool:
    """Whether a batch of members shares one spec without keys (written by columns)."""
    spec = batch[0].spec
    output = batch[0].output
    return spec.plain and all(
        planned.spec is spec and planned.output == output for planned in batch
    )


def _chunks(items: Iterator[T], size: int) -> Iterator[list[T]]:
    while batch := list(itertools.islice(items, size)):
        yield batch


def _positions(tree: Any) -> Iterable[int]:
    if isinstance(tree, list):
        for item in tree:
            yield from _positions(item)
    elif tree is not None:
        yield int(tree)


def _with_ids(tree: Any, ids: Sequence[int]) -> Any:
    if isinstance(tree, list):
        return [_with_ids(item, ids) for item in tree]
    return ids[tree]


def _replaced(tree: Any, values: dict[int, Any]) -> Any:
    if isinstance(tree, list):
        return [_replaced(item, values) for item in tree]
    return values[int(tree)]
