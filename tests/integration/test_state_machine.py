"""The state machine as a stateful property test, against the real job table.

Hypothesis drives every verb that writes a job (enqueue, unique and keyed enqueue, claim,
claim under limits, ack, ack_many, fail, release, renew, cancel, expire a lease, reap,
retry_now, requeue, pause and resume a queue, a schedule's tick, a workflow enqueued,
cancelled or retried) in random orders, and
after each step checks the invariants (docs/explanation/failure-model.md, "The state
machine"):
- the state guard recorded nothing (tests/testapp migration 0005: only the changes in
  django_skipqueue.core.states.TRANSITIONS, attempts never down, a finished job never
  rewritten);
- a finished job never changes unless an operator's retry_now took it back;
- at most one attempt holds a job (passes the fence);
- running jobs of a concurrency key never exceed its limit;
- a unique key has at most one unfinished job;
- a workflow's job is due only once every parent is done, and a waiting one waits on
  exactly its parents that are not done.
The deeper model-based test, which also predicts every verb's answer, is T46 in
tests/chaos/test_model_based.py.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Count
from django.db.models.functions import Now
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from django_skipqueue import Cron, chain, group
from django_skipqueue.conf.limits import QueueLimit
from django_skipqueue.core.states import UNFINISHED_STATES
from django_skipqueue.maintenance.scheduler import sync, tick
from django_skipqueue.models import FINISHED_STATES, Job, Queue, Schedule, Workflow
from django_skipqueue.queue.base import ErrorInfo
from django_skipqueue.tasks.base import bind_schedules
from tests import guard
from tests.testapp import tasks

ERROR = ErrorInfo("E", "m")
LIMITS = {"default": QueueLimit(concurrency=3)}
SNAPSHOT = ("state", "attempts", "finished_at", "result", "last_error", "errors", "run_at")


class Protocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        Job.objects.all().delete()
        Queue.objects.all().delete()
        Schedule.objects.all().delete()
        Workflow.objects.all().delete()
        guard.clear()
        self.tokens: list[tuple[int, int]] = []  # every (job id, attempt) ever claimed
        self.finished: dict[int, tuple] = {}  # finished jobs as last seen
        self.operator_retried: set[int] = set()
        self.schedules = {
            cron.name: cron
            for cron in bind_schedules(
                tasks.add, Cron(expression="* * * * * *", name="each-second", args=[1, 2])
            )
        }
        sync(self.schedules, database="default")

    def _claimed(self, jobs: list[Job]) -> None:
        self.tokens.extend((job.id, job.attempts) for job in jobs)

    # Every draw is of positions, made whatever the table holds, so that the examples
    # Hypothesis replays draw the same way although ids and timings differ.

    def _token(self, data: st.DataObject) -> tuple[int, int] | None:
        position = data.draw(st.integers(0, 999))
        return self.tokens[position % len(self.tokens)] if self.tokens else None

    def _pick(self, data: st.DataObject, ids: list[int], most: int = 3) -> list[int]:
        positions = data.draw(st.lists(st.integers(0, 999), min_size=1, max_size=most))
        return sorted({ids[p % len(ids)] for p in positions}) if ids else []

    def _ids(self, data: st.DataObject) -> list[int]:
        return self._pick(data, sorted(Job.objects.values_list("id", flat=True)))

    # -- producers -------------------------------------------------------------------

    @rule()
    def enqueue(self) -> None:
        tasks.add.using(max_attempts=3, lease=3600).enqueue(1, 1)

    @rule(key=st.sampled_from(["a", "b"]), on_conflict=st.sampled_from(["existing", "replace"]))
    def enqueue_unique(self, key: str, on_conflict: str) -> None:
        tasks.add.using(unique_key=key, on_conflict=on_conflict, max_attempts=3).enqueue(2, 2)

    @rule(account=st.sampled_from(["x", "y"]))
    def enqueue_keyed(self, account: str) -> None:
        tasks.per_account.using(max_attempts=3, lease=3600).enqueue(account=account)

    @rule()
    def enqueue_workflow(self) -> None:
        def step(task):  # type: ignore[no-untyped-def]
            return task.using(max_attempts=3, lease=3600)

        chain(
            step(tasks.add).s(1, 1),
            group(step(tasks.double).s(), step(tasks.double).s()),
            step(tasks.total).s(),
        ).enqueue(on_error=step(tasks.note_failure).s(where="machine"))

    @rule()
    def schedule_tick(self) -> None:
        Schedule.objects.update(last_occurrence_at=Now() - timedelta(seconds=2))
        tick(self.schedules, database="default")

    # -- a worker's verbs ------------------------------------------------------------

    @rule(k=st.integers(1, 4))
    def claim(self, k: int) -> None:
        self._claimed(Job.objects.claim(queues=["default"], limit=k))

    @rule(k=st.integers(1, 4))
    def claim_limited(self, k: int) -> None:
        claimed, _ = Job.objects.claim_limited(queues=["default"], limits=LIMITS, limit=k)
        self._claimed(claimed)

    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        if token := self._token(data):
            Job.objects.ack(*token, result={"ok": True})

    @rule(data=st.data())
    def ack_many(self, data: st.DataObject) -> None:
        positions = data.draw(st.lists(st.integers(0, 999), max_size=3))
        if self.tokens:
            picked = {self.tokens[p % len(self.tokens)] for p in positions}
            Job.objects.ack_many([(job_id, attempt, None) for job_id, attempt in picked])

    @rule(data=st.data(), retryable=st.booleans())
    def fail(self, data: st.DataObject, retryable: bool) -> None:
        if token := self._token(data):
            retry_in = timedelta(0) if retryable else None
            Job.objects.fail(*token, error=ERROR, retry_in=retry_in)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if token := self._token(data):
            Job.objects.release(*token)

    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        if token := self._token(data):
            Job.objects.renewal(*token)

    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        for job_id in self._pick(
            data, sorted(Job.objects.running().values_list("id", flat=True)), 1
        ):
            with connection.cursor() as cursor:
                cursor.execute(
                    "UPDATE skipqueue_job SET leased_until = now() - interval '1 second' "
                    "WHERE id = %s",
                    [job_id],
                )

    @rule()
    def reap(self) -> None:
        Job.objects.reap()

    # -- an operator's ---------------------------------------------------------------

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        Job.objects.cancel(self._ids(data), by="ops")

    @rule(data=st.data())
    def cancel_running(self, data: st.DataObject) -> None:
        running = sorted(Job.objects.running().values_list("id", flat=True))
        Job.objects.cancel(self._pick(data, running, 1), by="ops")

    @rule(data=st.data())
    def retry_now(self, data: st.DataObject) -> None:
        ids = self._ids(data)
        before = set(Job.objects.filter(id__in=ids).finished().values_list("id", flat=True))
        self._resumable(Job.objects.filter(id__in=ids).values_list("workflow_id", flat=True))
        Job.objects.retry_now(ids)
        self.operator_retried |= before

    def _resumable(self, workflow_ids: object) -> None:
        """An operator's retry of a workflow's job takes back what its failure cancelled
        (cancelled -> waiting): those are the operator's changes too."""
        self.operator_retried |= set(
            Job.objects.filter(workflow_id__in=[w for w in workflow_ids if w])  # type: ignore[attr-defined]
            .finished()
            .values_list("id", flat=True)
        )

    @rule(data=st.data())
    def cancel_workflow(self, data: st.DataObject) -> None:
        ids = sorted(Workflow.objects.values_list("id", flat=True))
        Workflow.objects.cancel(self._pick(data, ids, 1), by="ops")

    @rule(data=st.data())
    def retry_workflow(self, data: st.DataObject) -> None:
        picked = self._pick(data, sorted(Workflow.objects.values_list("id", flat=True)), 1)
        self._resumable(picked)
        Workflow.objects.retry_failed(picked)

    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        Job.objects.requeue(self._ids(data))

    @rule(paused=st.booleans())
    def pause(self, paused: bool) -> None:
        if paused:
            Queue.objects.pause(["default"], by="ops")
        else:
            Queue.objects.resume(["default"])

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def the_guard_recorded_nothing(self) -> None:
        assert guard.violations() == []

    @invariant()
    def a_finished_job_changes_only_by_an_operator(self) -> None:
        now = {
            row[0]: row[1:]
            for row in Job.objects.filter(state__in=FINISHED_STATES).values_list("id", *SNAPSHOT)
        }
        for job_id, seen in self.finished.items():
            if job_id in self.operator_retried:
                continue
            assert now.get(job_id) == seen, f"finished job {job_id} changed"
        self.finished = {**{k: v for k, v in self.finished.items() if k in now}, **now}
        for job_id in self.operator_retried:
            self.finished.pop(job_id, None)
            if job_id in now:
                self.finished[job_id] = now[job_id]
        self.operator_retried = set()

    @invariant()
    def at_most_one_attempt_holds_a_job(self) -> None:
        holders: dict[int, int] = {}
        for job_id, attempt in self.tokens:
            if Job.objects.holding(job_id, attempt).exists():
                holders[job_id] = holders.get(job_id, 0) + 1
        assert all(count == 1 for count in holders.values())

    @invariant()
    def a_key_never_runs_past_its_limit(self) -> None:
        running = (
            Job.objects.running()
            .filter(concurrency_key__isnull=False, leased_until__gt=Now())
            .values("concurrency_key")
            .annotate(n=Count("id"))
        )
        assert all(row["n"] <= 1 for row in running)  # per_account: limit 1

    @invariant()
    def a_unique_key_has_at_most_one_unfinished_job(self) -> None:
        unfinished = (
            Job.objects.filter(unique_key__isnull=False, state__in=UNFINISHED_STATES)
            .values("task", "unique_key")
            .annotate(n=Count("id"))
        )
        assert all(row["n"] == 1 for row in unfinished)

    @invariant()
    def a_workflow_job_is_due_only_once_its_parents_are_done(self) -> None:
        rows = list(
            Job.objects.filter(workflow__isnull=False).values(
                "id", "state", "waiting_on", "dependents"
            )
        )
        state = {row["id"]: row["state"] for row in rows}
        parents: dict[int, list[int]] = {}
        for row in rows:
            for child in row["dependents"] or []:
                parents.setdefault(child, []).append(row["id"])
        for row in rows:
            above = parents.get(row["id"], [])
            not_done = sum(state[parent] != "done" for parent in above)
            if row["state"] in ("pending", "running", "done"):
                assert not_done == 0, f"job {row['id']} is {row['state']} before its parents"
            if row["state"] == "waiting" and above:
                assert row["waiting_on"] == not_done, f"job {row['id']} waits on a wrong count"


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(300)
def test_the_state_machine_holds_under_random_orders_of_every_verb(caplog):
    caplog.set_level(logging.ERROR, logger="django_skipqueue")
    logging.getLogger("django_skipqueue").setLevel(logging.ERROR)
    try:
        run_state_machine_as_test(
            Protocol,
            settings=settings(
                max_examples=40,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                database=None,
            ),
        )
    finally:
        logging.getLogger("django_skipqueue").setLevel(logging.NOTSET)
