"""T46: the protocol against a pure-Python model, step by step, on a real PostgreSQL.

Rules: enqueue, claim(k), ack / fail / renew / release with a fresh or stale attempt,
expire a lease (leased_until moved into the past, on the database clock), reap.
After every step: C2 (a finished job never changes), C4/C5 (attempts never go down and
never exceed max_attempts), and the database's state equals the model's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from django.db import connection
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from django_skipqueue.models import FINISHED_STATES, Job, JobState
from django_skipqueue.queue.base import ErrorInfo
from tests.testapp import tasks

MAX_ATTEMPTS = 3
ERROR = ErrorInfo("E", "m")


@dataclass
class ModelJob:
    state: str = JobState.PENDING
    attempts: int = 0
    max_attempts: int = MAX_ATTEMPTS
    expirations: int = 0
    expired: bool = False
    due_seq: int = 0  # when it last became pending: the claim orders by run_at, then id
    history: list[tuple[str, int]] = field(default_factory=list)


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        Job.objects.all().delete()
        self.jobs: dict[int, ModelJob] = {}
        self.tokens: list[tuple[int, int]] = []  # every (job id, attempt) ever claimed
        self.seq = 0

    def became_pending(self, *jobs: ModelJob) -> None:
        """One statement's jobs get one run_at (its now()): a tie broken by id."""
        self.seq += 1
        for job in jobs:
            job.state, job.due_seq = JobState.PENDING, self.seq

    def holds(self, job_id: int, attempt: int) -> bool:
        job = self.jobs[job_id]
        return job.state == JobState.RUNNING and job.attempts == attempt and not job.expired

    @rule()
    def enqueue(self) -> None:
        job = tasks.add.using(max_attempts=MAX_ATTEMPTS, lease=3600).enqueue(1, 1)
        self.jobs[job.id] = ModelJob()
        self.became_pending(self.jobs[job.id])

    @rule(k=st.integers(1, 4))
    def claim(self, k: int) -> None:
        claimed = Job.objects.claim(queues=["default"], limit=k)
        pending = [
            (job.due_seq, i) for i, job in self.jobs.items() if job.state == JobState.PENDING
        ]
        due = [i for _, i in sorted(pending)]
        assert [job.id for job in claimed] == due[:k]
        for job in claimed:
            model = self.jobs[job.id]
            model.state, model.attempts, model.expired = JobState.RUNNING, model.attempts + 1, False
            assert job.attempts == model.attempts
            self.tokens.append((job.id, job.attempts))

    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        if self.tokens:
            job_id, attempt = data.draw(st.sampled_from(self.tokens))
            expected = self.holds(job_id, attempt)
            assert Job.objects.ack(job_id, attempt) is expected
            if expected:
                self.jobs[job_id].state = JobState.DONE

    @rule(data=st.data(), retryable=st.booleans())
    def fail(self, data: st.DataObject, retryable: bool) -> None:
        if self.tokens:
            job_id, attempt = data.draw(st.sampled_from(self.tokens))
            expected = self.holds(job_id, attempt)
            retry_in = timedelta(0) if retryable else None
            state = Job.objects.fail(job_id, attempt, error=ERROR, retry_in=retry_in)
            if not expected:
                assert state is None
                return
            model = self.jobs[job_id]
            if retryable and model.attempts < model.max_attempts:
                self.became_pending(model)
            else:
                model.state = JobState.FAILED
            assert state == model.state

    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        if self.tokens:
            job_id, attempt = data.draw(st.sampled_from(self.tokens))
            assert Job.objects.renew(job_id, attempt) is self.holds(job_id, attempt)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.tokens:
            job_id, attempt = data.draw(st.sampled_from(self.tokens))
            expected = self.holds(job_id, attempt)
            assert Job.objects.release(job_id, attempt) is expected
            if expected:
                model = self.jobs[job_id]
                model.max_attempts += 1
                self.became_pending(model)

    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        running = [i for i, job in self.jobs.items() if job.state == JobState.RUNNING]
        if running:
            job_id = data.draw(st.sampled_from(sorted(running)))
            with connection.cursor() as cursor:
                cursor.execute(
                    "UPDATE skipqueue_job SET leased_until = now() - interval '1 second' "
                    "WHERE id = %s",
                    [job_id],
                )
            self.jobs[job_id].expired = True

    @rule()
    def reap(self) -> None:
        result = Job.objects.reap()
        back, failed = [], 0
        for job in self.jobs.values():
            if job.state == JobState.RUNNING and job.expired:
                job.expirations += 1
                job.expired = False
                if job.attempts < job.max_attempts:
                    back.append(job)
                else:
                    job.state, failed = JobState.FAILED, failed + 1
        if back:
            self.became_pending(*back)
        assert (result.requeued, result.failed) == (len(back), failed)

    @invariant()
    def database_matches_the_model(self) -> None:
        rows = Job.objects.values_list("id", "state", "attempts", "max_attempts", "expirations")
        for job_id, state, attempts, max_attempts, expirations in rows:
            model = self.jobs[job_id]
            before = model.history[-1] if model.history else None
            assert (state, attempts, max_attempts, expirations) == (
                model.state,
                model.attempts,
                model.max_attempts,
                model.expirations,
            )
            assert attempts <= max_attempts  # C5
            if before is not None:
                assert attempts >= before[1]  # the fence never goes down
                if before[0] in FINISHED_STATES:
                    assert state == before[0]  # C2: finished is final
            model.history.append((state, attempts))


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(900)
def test_t46_the_protocol_matches_its_model(caplog):
    caplog.set_level(logging.ERROR, logger="django_skipqueue")  # thousands of reap warnings
    logging.getLogger("django_skipqueue").setLevel(logging.ERROR)
    run_state_machine_as_test(
        QueueMachine,
        settings=settings(
            max_examples=500,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )
