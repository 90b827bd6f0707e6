"""Strict order per key (issue 56 point 3; `@task(ordered_key=...)`): a key's jobs run one
at a time in enqueue order across workers; a failed one holds the rest, or not (policy),
until an operator acts; concurrent enqueues of a key get ids in commit order."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from django_skipqueue import chain, task
from django_skipqueue.exceptions import ConfigurationError, InvalidJobError
from django_skipqueue.lag import job_reason
from django_skipqueue.models import Job, JobState, WorkerProcess
from django_skipqueue.testing import run_jobs
from tests.processes import wait_until
from tests.testapp import tasks
from tests.testapp.models import Span

pytestmark = [pytest.mark.django_db(transaction=True)]


def claim(limit: int = 10) -> list[Job]:
    return Job.objects.claim_limited(queues=["default"], limits={}, limit=limit)[0]


def test_a_keys_jobs_are_claimed_one_at_a_time_first_enqueued_first_and_keys_apart():
    a = tasks.ordered_step.enqueue_many([(("a", n), {}) for n in range(3)])
    b = tasks.ordered_step.enqueue_many([(("b", n), {}) for n in range(2)])
    first = claim()
    assert sorted(job.id for job in first) == [a[0].id, b[0].id]  # each key's head only
    assert claim() == []  # the heads run: nothing behind them moves
    for job in first:
        assert Job.objects.ack(job.id, job.attempts, result=None)
    assert sorted(job.id for job in claim()) == [a[1].id, b[1].id]


def test_a_failed_job_holds_its_key_until_retried_and_a_skipping_key_goes_on():
    held = tasks.ordered_step.enqueue_many([(("a", 0), {"fail": True}), (("a", 1), {})])
    skipping = tasks.ordered_skipping.enqueue_many([(("s", 0), {"fail": True}), (("s", 1), {})])
    run_jobs()
    states = dict(Job.objects.values_list("id", "state"))
    assert states[held[0].id] == JobState.FAILED and states[held[1].id] == JobState.PENDING
    assert states[skipping[0].id] == JobState.FAILED and states[skipping[1].id] == JobState.DONE
    WorkerProcess.objects.create(hostname="test", pid=1, queues=["default"])
    reason = job_reason(Job.objects.get(id=held[1].id))
    assert reason.startswith(f"in order behind job {held[0].id} of its key, which failed")
    # The operator retries the failed one (its cause fixed meanwhile: here, its own
    # arguments): it runs, then the next, in order.
    assert Job.objects.retry_now([held[0].id]) == 1
    Job.objects.filter(id=held[0].id, state=JobState.PENDING).update(kwargs={"fail": False})
    run_jobs()
    assert set(Job.objects.filter(id__in=[j.id for j in held]).values_list("state", flat=True)) == {
        JobState.DONE
    }


def test_concurrent_enqueues_of_a_key_get_ids_in_the_order_they_commit():
    """The first enqueue's transaction stays open while a second enqueues the same key:
    the second waits for the first's commit before it takes its id, so the claim's id
    order is the commit order (without the wait it took a smaller id... or a larger one
    and ran first: SKIP LOCKED alone cannot say)."""
    order: list[str] = []
    started = threading.Event()

    def slow_first() -> None:
        try:
            with transaction.atomic():
                tasks.ordered_step.enqueue("k", 1)
                started.set()
                time.sleep(0.5)
                order.append("first committed")
        finally:
            connection.close()

    thread = threading.Thread(target=slow_first)
    thread.start()
    started.wait(10)
    second = tasks.ordered_step.enqueue("k", 2)
    order.append("second enqueued")
    thread.join(10)
    assert order == ["first committed", "second enqueued"]
    first = Job.objects.get(kwargs={}, args=["k", 1])
    assert first.id < second.id


@pytest.mark.timeout(120)
def test_two_workers_run_each_keys_jobs_one_at_a_time_in_enqueue_order(start_worker):
    for n in range(8):  # interleaved keys, as events of several accounts come
        for account in ("a", "b", "c"):
            tasks.ordered_step.enqueue(account, n, seconds=0.02)
    start_worker("--concurrency", "4")
    start_worker("--concurrency", "4")
    wait_until(
        lambda: Job.objects.filter(state=JobState.DONE).count() == 24,
        timeout=60,
        message="the ordered jobs did not all run",
    )
    for account in ("a", "b", "c"):
        spans = sorted(
            Span.objects.filter(key__startswith=f"order-{account}:").values_list(
                "started_at", "ended_at", "key"
            )
        )
        assert [key for _, _, key in spans] == [f"order-{account}:{n}" for n in range(8)]
        for (_, ended, _), (started, _, _) in zip(spans, spans[1:], strict=False):
            assert ended <= started  # one at a time


def _ordered(account: str) -> None: ...


def test_options_that_cannot_go_with_an_ordered_key_are_refused_in_words():
    with pytest.raises(ConfigurationError, match="drop concurrency_key"):
        task(ordered_key=("account",), concurrency_key=("account",))(_ordered)
    with pytest.raises(ConfigurationError, match="'hold' or 'skip', got 'retry'"):
        task(ordered_key=("account",), order_failed="retry")(_ordered)
    with pytest.raises(InvalidJobError, match="has an ordered key: a workflow orders"):
        chain(tasks.add.s(1, 2), tasks.ordered_skipping.s(1)).enqueue()
