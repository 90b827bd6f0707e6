"""Workflows (tasks/canvas.py, queue/workflows.py, migration 0012's trigger).

Jobs run through `testing.run_jobs` (the worker's own executor, in this process) against
the real database and its trigger; tests/chaos/test_workflows.py runs them in worker
processes under SIGKILL.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from django.db import connection, transaction
from django.test import override_settings

from django_skipqueue import WorkflowFailed, chain, chord, group
from django_skipqueue.exceptions import (
    DuplicateJobError,
    InvalidJobError,
    QueueFullError,
    WorkflowNotFinished,
)
from django_skipqueue.models import Job, JobState, Workflow, WorkflowState
from django_skipqueue.testing import run_jobs
from tests.processes import listening_backends, wait_until
from tests.testapp import tasks
from tests.testapp.tasks import (
    add,
    breaks,
    breaks_unless_file,
    double,
    note_failure,
    pair,
    send_invoice,
    total,
)

pytestmark = pytest.mark.django_db


def states(workflow: Workflow) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for task_name, state in workflow.jobs.order_by("id").values_list("task", "state"):
        found.setdefault(task_name.rsplit(".", 1)[-1], []).append(state)
    return found


# -- results through chains, groups, chords and their nesting ---------------------------


def test_a_chain_passes_each_result_to_the_next_step():
    workflow = chain(add.s(1, 2), double.s(), pair.s(label="end")).enqueue()
    assert Job.objects.filter(workflow=workflow, state=JobState.PENDING).count() == 1
    run_jobs()
    assert workflow.wait(timeout=5) == [6, "end"]
    assert workflow.result == [6, "end"]
    workflow.refresh_from_db()
    assert workflow.state == WorkflowState.DONE and workflow.finished_at is not None


def test_a_group_gives_the_list_of_its_results_in_the_order_given():
    workflow = group(double.s(n) for n in range(10)).enqueue()
    run_jobs()
    assert workflow.wait(timeout=5) == [2 * n for n in range(10)]


def test_a_chord_calls_its_body_once_with_the_groups_results():
    workflow = chord(group(double.s(n) for n in range(5)), total.s(extra=100)).enqueue()
    body = workflow.jobs.get(task=total.name)
    assert (body.state, body.waiting_on) == (JobState.WAITING, 5)
    run_jobs()
    assert workflow.wait(timeout=5) == 120
    body.refresh_from_db()
    assert (body.state, body.attempts, body.waiting_on) == (JobState.DONE, 1, 0)


def test_a_group_inside_a_chain_gives_the_next_step_the_list():
    workflow = chain(add.s(1, 1), group(double.s(), pair.s("x")), pair.s()).enqueue()
    run_jobs()
    # Each member of the group receives 2 (add's result) as its first argument.
    assert workflow.wait(timeout=5) == [[4, [2, "x"]], ""]


def test_nested_groups_and_chains_keep_the_shape_of_their_results():
    workflow = group(chain(add.s(1, 2), double.s()), group(double.s(1), double.s(2))).enqueue()
    run_jobs()
    assert workflow.wait(timeout=5) == [6, [2, 4]]


def test_a_chord_can_be_a_step_of_a_chain():
    workflow = chain(
        add.s(2, 3), chord(group(double.s(), add.s(10)), total.s()), double.s()
    ).enqueue()
    run_jobs()
    assert workflow.wait(timeout=5) == 2 * (10 + 15)


def test_an_immutable_step_does_not_receive_its_parents_result():
    workflow = chain(add.s(1, 2), pair.si("alone", "no input")).enqueue()
    run_jobs()
    assert workflow.wait(timeout=5) == ["alone", "no input"]


def test_an_empty_group_is_done_at_once_and_a_chord_body_gets_an_empty_list():
    assert group([]).enqueue().wait(timeout=1) == []
    workflow = chord(group([]), total.s()).enqueue()
    run_jobs()
    assert workflow.wait(timeout=5) == 0


def test_options_given_with_using_are_kept_by_the_signature():
    workflow = chain(add.using(queue_name="other", priority=9).s(1, 2), double.s()).enqueue()
    first = workflow.jobs.order_by("id").first()
    assert (first.queue_name, first.priority) == ("other", 9)
    run_jobs(["default", "other"])
    assert workflow.wait(timeout=5) == 6


# -- the handle --------------------------------------------------------------------------


def test_the_handle_is_found_again_by_id_and_says_it_is_not_finished():
    workflow = chain(add.s(1, 2), double.s()).enqueue()
    again = Workflow.objects.get(id=workflow.id)
    assert again.state == WorkflowState.RUNNING and not again.is_finished
    with pytest.raises(WorkflowNotFinished):
        _ = again.result
    with pytest.raises(TimeoutError):
        again.wait(timeout=0.2)


@pytest.mark.django_db(transaction=True)
def test_wait_is_woken_by_the_finishing_ack_not_by_its_poll():
    workflow = chain(add.s(1, 2), double.s()).enqueue()
    run_jobs(limit=1)  # the first step
    answer: list[object] = []
    waiting = threading.Event()

    def waiter() -> None:
        try:
            waiting.set()
            answer.append(Workflow.objects.get(id=workflow.id).wait(timeout=10))
        finally:
            connection.close()

    thread = threading.Thread(target=waiter)
    thread.start()
    waiting.wait(timeout=5)
    run_jobs()
    thread.join(timeout=10)
    assert answer == [6]


@pytest.mark.django_db(transaction=True)
def test_await_result_works_in_async_code():
    import asyncio

    workflow = chain(add.s(4, 5), double.s()).enqueue()
    run_jobs()
    assert asyncio.run(workflow.await_result(timeout=5)) == 18


# -- transactional enqueue ------------------------------------------------------------


def test_a_rolled_back_workflow_leaves_no_row():
    with pytest.raises(RuntimeError), transaction.atomic():
        chord(group(double.s(n) for n in range(3)), total.s()).enqueue()
        raise RuntimeError("the view failed")
    assert not Job.objects.exists() and not Workflow.objects.exists()


def test_a_bad_call_anywhere_writes_nothing_and_names_the_step():
    with pytest.raises(InvalidJobError, match=r"double\(value\) cannot be called"):
        chain(add.s(1, 2), double.s(1)).enqueue()  # double gets add's result and 1
    assert not Job.objects.exists() and not Workflow.objects.exists()
    with pytest.raises(InvalidJobError, match="must be a signature"):
        chain(add.s(1, 2), double)  # the task, not a signature


def test_a_held_unique_key_refuses_the_whole_workflow_and_the_transaction_goes_on():
    holder = send_invoice.enqueue(7)
    with transaction.atomic():
        with pytest.raises(DuplicateJobError, match=f"held by job {holder.id}"):
            chain(add.s(1, 2), send_invoice.si(7)).enqueue()
        assert Job.objects.count() == 1  # the caller's transaction is usable
    assert not Workflow.objects.exists()


def test_a_waiting_job_holds_its_unique_key():
    workflow = chain(add.s(1, 2), send_invoice.si(8)).enqueue()
    waiting = workflow.jobs.get(task=send_invoice.name)
    assert waiting.state == JobState.WAITING
    assert send_invoice.enqueue(8).id == waiting.id  # "existing": the waiting one


def test_the_pending_cap_counts_a_workflows_jobs():
    with override_settings(SKIPQUEUE={"MAX_PENDING_PER_QUEUE": 3}), pytest.raises(QueueFullError):
        group(double.s(n) for n in range(5)).enqueue()


@override_settings(
    SKIPQUEUE={"RELAY": {"QUEUES": ["relayed"], "URL": "amqp://guest:guest@127.0.0.1:5672/"}}
)
def test_a_job_on_a_relayed_queue_is_refused_at_enqueue():
    with pytest.raises(InvalidJobError, match="relayed to RabbitMQ"):
        chain(add.s(1, 2), double.using(queue_name="relayed").s()).enqueue()


# -- failure, on_error, cancel and resume --------------------------------------------------


def test_a_failed_job_cancels_what_waits_on_it_and_on_error_runs_once():
    workflow = chain(
        group(breaks.si("first"), breaks.si("second"), double.s(1)), total.s(), double.s()
    ).enqueue(on_error=note_failure.s(where="handler"))
    run_jobs()
    workflow.refresh_from_db()
    assert workflow.state == WorkflowState.FAILED
    assert states(workflow) == {
        "breaks": ["failed", "failed"],
        "double": ["done", "cancelled"],
        "total": ["cancelled"],
        "note_failure": ["done"],
    }
    body = workflow.jobs.get(task=total.name)
    assert body.attempts == 0 and body.last_error.startswith("upstream job ")
    handler = workflow.jobs.get(task=note_failure.name)
    failed_id, error, where = handler.result
    assert failed_id == workflow.failed_job_id and where == "handler"
    assert "ValueError" in error and ("first" in error or "second" in error)
    with pytest.raises(WorkflowFailed, match=f"job {failed_id}"):
        workflow.wait(timeout=1)


def test_on_error_never_runs_when_the_workflow_succeeds():
    workflow = chain(add.s(1, 2), double.s()).enqueue(on_error=note_failure.s(where="x"))
    run_jobs()
    assert workflow.wait(timeout=5) == 6
    handler = workflow.jobs.get(task=note_failure.name)
    assert (handler.state, handler.attempts) == (JobState.CANCELLED, 0)


def test_cancelling_a_workflow_cancels_every_unfinished_job_of_it():
    workflow = chord(group(double.s(n) for n in range(3)), total.s()).enqueue(
        on_error=note_failure.s(where="x")
    )
    run_jobs(limit=1)
    assert Workflow.objects.cancel([workflow.id], by="ops") == 1
    workflow.refresh_from_db()
    assert workflow.state == WorkflowState.CANCELLED
    assert run_jobs() == []  # nothing left to run, not even on_error
    assert sorted(workflow.jobs.values_list("state", flat=True)) == [
        "cancelled", "cancelled", "cancelled", "cancelled", "done"
    ]  # fmt: skip
    with pytest.raises(WorkflowFailed, match="cancelled by ops"):
        workflow.wait(timeout=1)


def test_an_operators_retry_of_the_failed_job_resumes_the_workflow(tmp_path: Path):
    flag = tmp_path / "ready"
    workflow = chain(
        add.s(1, 2), breaks_unless_file.si(str(flag), 5), chord(group(double.s()), total.s())
    ).enqueue()
    run_jobs()
    workflow.refresh_from_db()
    assert workflow.state == WorkflowState.FAILED
    assert states(workflow)["total"] == ["cancelled"]
    flag.touch()
    assert Workflow.objects.retry_failed([workflow.id]) == 1
    workflow.refresh_from_db()
    assert workflow.state == WorkflowState.RUNNING
    assert states(workflow) == {
        "add": ["done"],
        "breaks_unless_file": ["pending"],
        "double": ["waiting"],
        "total": ["waiting"],
    }
    run_jobs()
    assert workflow.wait(timeout=5) == 10


def test_a_cancelled_dependent_is_not_retried_on_its_own():
    workflow = chain(breaks.si(), double.s()).enqueue()
    run_jobs()
    dependent = workflow.jobs.get(task=double.name)
    assert Job.objects.retry_now([dependent.id]) == 0  # it waits for its parent's retry
    dependent.refresh_from_db()
    assert dependent.state == JobState.CANCELLED


def test_an_operator_cancelling_one_member_ends_the_workflow_failed():
    workflow = chord(group(double.s(1), double.s(2)), total.s()).enqueue()
    first = workflow.jobs.filter(task=double.name).order_by("id").first()
    Job.objects.cancel([first.id], by="ops")
    run_jobs()
    workflow.refresh_from_db()
    assert (workflow.state, workflow.failed_job_id) == (WorkflowState.FAILED, first.id)
    assert workflow.error == "cancelled by ops"
    assert states(workflow) == {"double": ["cancelled", "done"], "total": ["cancelled"]}


# -- concurrency ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_two_hundred_siblings_finishing_together_unblock_the_body_exactly_once():
    """Twenty connections ack ten members each, released together by a barrier: the
    body's count reaches zero once, and it becomes due once."""
    workflow = chord(group(double.s(n) for n in range(200)), total.s()).enqueue()
    claimed = Job.objects.claim(queues=["default"], limit=200)
    assert len(claimed) == 200
    start, acked = threading.Barrier(20), []

    def acker(jobs: list[Job]) -> None:
        try:
            start.wait(timeout=10)
            for job in jobs:
                acked.append(Job.objects.ack(job.id, job.attempts, 2 * job.args[0]))
        finally:
            connection.close()

    threads = [threading.Thread(target=acker, args=(claimed[n::20],)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert acked.count(True) == 200
    body = workflow.jobs.get(task=total.name)
    assert (body.state, body.waiting_on) == (JobState.PENDING, 0)
    run_jobs()
    assert workflow.wait(timeout=5) == sum(2 * n for n in range(200))


def test_a_stale_attempts_ack_unblocks_nothing():
    workflow = chain(add.s(1, 2), double.s()).enqueue()
    (job,) = Job.objects.claim(queues=["default"], limit=1)
    with connection.cursor() as cursor:  # its lease runs out; the reaper takes it back
        cursor.execute(
            "UPDATE skipqueue_job SET leased_until = now() - interval '1 s' WHERE id = %s",
            [job.id],
        )
    Job.objects.reap()
    assert Job.objects.ack(job.id, job.attempts, 3) is False  # refused by the fence
    assert workflow.jobs.get(task=double.name).state == JobState.WAITING
    run_jobs()
    assert workflow.wait(timeout=5) == 6


# -- pruning --------------------------------------------------------------------------------


def test_pruning_keeps_the_results_a_running_workflow_still_needs():
    from datetime import timedelta

    from django_skipqueue.maintenance.reaper import Reaper

    finished = chain(add.s(1, 2), double.s()).enqueue()
    run_jobs()
    assert finished.wait(timeout=5) == 6
    running = chord(group(double.s(1), double.s(2)), total.s()).enqueue()
    run_jobs(limit=1)  # one member of the chord
    pruned = Reaper().prune(done_older_than=timedelta(seconds=-1))
    assert running.jobs.filter(state=JobState.DONE).count() == 1  # kept: total reads it
    assert pruned.pruned_done == 2 and pruned.pruned_workflows == 1
    assert not Workflow.objects.filter(id=finished.id).exists()
    run_jobs()
    assert running.wait(timeout=5) == 6


# -- groups of a generator: written batch by batch ----------------------------------------


def test_a_group_of_a_generator_is_written_in_batches_and_keeps_its_order(monkeypatch, caplog):
    import logging

    from django_skipqueue.queue import workflows

    caplog.set_level(logging.INFO, logger="django_skipqueue")
    monkeypatch.setattr(workflows, "INSERT_BATCH", 7)
    workflow = group(double.s(n) for n in range(30)).enqueue()
    assert workflow.name == "group(30 x double)"
    # Logged by its name once its members were read (it said "group(<members>)").
    assert f"workflow enqueued id={workflow.id} name=group(30 x double) jobs=30" in caplog.text
    run_jobs()
    assert workflow.wait(timeout=5) == [2 * n for n in range(30)]


def test_a_chord_of_a_generator_gives_its_body_every_result_in_order(monkeypatch):
    from django_skipqueue.queue import workflows

    monkeypatch.setattr(workflows, "INSERT_BATCH", 7)
    workflow = chord(group(double.s(n) for n in range(30)), total.s(extra=1)).enqueue(
        on_error=note_failure.s(where="x")
    )
    body = workflow.jobs.get(task=total.name)
    assert (body.state, body.waiting_on) == (JobState.WAITING, 30)
    run_jobs()
    assert workflow.wait(timeout=5) == sum(2 * n for n in range(30)) + 1
    assert workflow.jobs.get(task=note_failure.name).state == JobState.CANCELLED


def test_a_generator_chord_with_no_members_runs_its_body_with_an_empty_list():
    workflow = chord(group(double.s(n) for n in range(0)), total.s()).enqueue()
    run_jobs()
    assert workflow.wait(timeout=5) == 0


def test_a_refusal_in_a_later_batch_of_a_generator_leaves_nothing(monkeypatch):
    from django_skipqueue.queue import workflows

    monkeypatch.setattr(workflows, "INSERT_BATCH", 5)
    holder = send_invoice.enqueue(12)

    def members():
        yield from (double.s(n) for n in range(8))
        yield send_invoice.si(12)

    with transaction.atomic():
        with pytest.raises(DuplicateJobError):
            chord(group(members()), total.s()).enqueue()
        assert list(Job.objects.values_list("id", flat=True)) == [holder.id]
    assert not Workflow.objects.exists()
    mixed = (double.s(1) if n == 0 else chain(add.s(1, 2), double.s()) for n in range(2))
    with pytest.raises(InvalidJobError, match="signatures only"):
        group(mixed).enqueue()
    assert not Workflow.objects.exists()


def test_a_generator_of_chains_is_read_at_once_and_runs_as_a_list_would():
    workflow = group(chain(add.s(n, n), double.s()) for n in range(3)).enqueue()
    run_jobs()
    assert workflow.wait(timeout=5) == [0, 4, 8]


def test_a_member_whose_result_is_too_big_fails_at_its_ack_and_the_body_never_starts():
    """The body reads its parents' results at run time: a member whose result passes the
    payload limit ends failed with that reason, so the body is cancelled by upstream,
    never started with a part missing."""
    from tests.testapp.tasks import repeats

    with override_settings(SKIPQUEUE={"MAX_PAYLOAD_BYTES": 10_000}):
        workflow = chord(group(repeats.si("x", 20_000), repeats.si("y", 3)), pair.s()).enqueue(
            on_error=note_failure.s(where="big")
        )
        run_jobs()
    workflow.refresh_from_db()
    big = workflow.jobs.get(task=repeats.name, args=["x", 20_000])
    assert big.state == JobState.FAILED and "MAX_PAYLOAD_BYTES" in big.last_error
    body = workflow.jobs.get(task=pair.name)
    assert (body.state, body.attempts) == (JobState.CANCELLED, 0)
    assert workflow.state == WorkflowState.FAILED and workflow.failed_job_id == big.id


# -- the second outside trial ------------------------------------------------------------------


def test_retrying_one_of_two_failed_members_keeps_the_workflow_failed_until_both_are(
    tmp_path: Path,
):
    """Trial finding: the workflow went back to running while another member was still
    failed, and its body waited on it for ever (wait() never returned)."""
    flag = tmp_path / "ready"
    workflow = chord(
        group(breaks_unless_file.si(str(flag), 1), breaks_unless_file.si(str(flag), 2)),
        total.s(),
    ).enqueue()
    run_jobs()
    first, second = workflow.jobs.filter(task=breaks_unless_file.name).order_by("id")
    flag.touch()
    assert Job.objects.retry_now([first.id]) == 1
    run_jobs()
    workflow.refresh_from_db()
    assert (workflow.state, workflow.failed_job_id) == (WorkflowState.FAILED, second.id)
    assert Workflow.objects.retry_failed([workflow.id]) == 1  # the one still failed
    run_jobs()
    assert workflow.wait(timeout=5) == 3


def test_a_failed_workflows_jobs_are_kept_by_pruning_so_that_a_retry_can_resume_it(
    tmp_path: Path,
):
    from datetime import timedelta

    from django_skipqueue.maintenance.reaper import Reaper

    flag = tmp_path / "ready"
    workflow = chain(add.si(1, 2), pair.s(), breaks_unless_file.si(str(flag)), pair.s()).enqueue()
    run_jobs()
    Reaper().prune(done_older_than=timedelta(seconds=-1), failed_older_than=timedelta(seconds=-1))
    assert workflow.jobs.count() == 4
    flag.touch()
    assert Workflow.objects.retry_failed([workflow.id]) == 1
    run_jobs()
    assert workflow.wait(timeout=5) == [7, ""]


@pytest.mark.parametrize("stored", ['{"a": 1}', '["x"]', "5", "[99999999999999999999999]"])
def test_a_broken_dependents_column_stops_nothing(stored):
    """Trial finding: another client's non-array `dependents` made the trigger fail on
    every state change: the job could be neither claimed, failed nor cancelled."""
    from tests.guard import setting_up

    workflow = chain(add.si(1, 2), double.s()).enqueue()
    first = workflow.jobs.order_by("id").first()
    with setting_up(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE skipqueue_job SET dependents = %s::jsonb WHERE id = %s", [stored, first.id]
        )
    run_jobs()
    first.refresh_from_db()
    assert first.state == JobState.DONE
    assert Workflow.objects.cancel([workflow.id], by="ops") == 1  # the waiting one ends


@pytest.mark.parametrize(
    "inputs", ['{"results": "abc"}', '{"results": {"x": 1}}', '{"zzz": 1}', "[1, 2]"]
)
def test_inputs_of_no_known_shape_fail_the_job_at_once(inputs):
    from tests.guard import setting_up

    workflow = chain(add.si(1, 2), double.s()).enqueue()
    run_jobs(limit=1)
    second = workflow.jobs.get(task=double.name)
    with setting_up(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE skipqueue_job SET inputs = %s::jsonb, max_attempts = 5 WHERE id = %s",
            [inputs, second.id],
        )
    run_jobs()
    second.refresh_from_db()
    assert (second.state, second.attempts) == (JobState.FAILED, 1)  # not retried
    assert "InvalidJobError" in second.last_error


def _index_reads() -> dict[str, int]:
    """Index entries read so far, per index of the job table (this session's flushed)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")  # flushed as this one ends
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT indexrelname, idx_tup_read FROM pg_stat_user_indexes "
            "WHERE relname = 'skipqueue_job'"
        )
        return dict(cursor.fetchall())


@pytest.mark.django_db(transaction=True)
def test_a_steps_dependents_are_found_by_the_primary_key_where_statistics_are_stale():
    """ANALYZE ran on a table of finished jobs; then a group of 400 chains of two is
    enqueued, 400 jobs waiting. Each first step's ack moves its dependent on (the
    workflow trigger) through the primary key, never by a walk through the index of
    every waiting job (each walk reads 400 entries: migration 0019)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
                lease, attempts, max_attempts, expirations, releases, last_error, errors,
                created_at, finished_at)
            SELECT 'tests.testapp.tasks.add', '[]', '{}', 'default', 0, 'done', now(),
                   interval '5 minutes', 1, 5, 0, 0, '', '[]', now(), now()
            FROM generate_series(1, 20000)
            """
        )
        cursor.execute("ANALYZE skipqueue_job")
    workflow = group(chain(add.si(1, 2), double.s()) for _ in range(400)).enqueue()
    claimed = Job.objects.claim(queues=["default"], limit=20)
    assert len(claimed) == 20
    before = _index_reads()
    for job in claimed:
        assert Job.objects.ack(job.id, job.attempts, 3)
    after = _index_reads()
    walked = after["skipqueue_job_waiting_idx"] - before["skipqueue_job_waiting_idx"]
    assert walked < 400, f"{walked} waiting entries read for 20 acks"
    assert workflow.jobs.filter(task=double.name, state=JobState.PENDING).count() == 20


@pytest.mark.django_db(transaction=True)
def test_migration_0019_changes_the_workflow_function_both_ways():
    from django.core.management import call_command

    def body() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_get_functiondef('skipqueue_workflow_step'::regproc)")
            return cursor.fetchone()[0]

    assert body().count("(state || '') = 'waiting'") == 3
    try:
        call_command("migrate", "skipqueue", "0018", verbosity=0)
        assert "(state || '')" not in body()
        assert body().count("AND state = 'waiting'") >= 3
    finally:
        call_command("migrate", "skipqueue", verbosity=0)
    assert body().count("(state || '') = 'waiting'") == 3


# -- cancel against the members' acks (issue 52, point 2) ----------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(240)
def test_cancelling_a_large_workflow_while_three_workers_ack_its_members_never_deadlocks(
    start_worker,
):
    """The trigger moves a workflow on from the job it finishes: job, children, then the
    workflow's row; a cancel took the workflow's row, then its jobs: an ack and a cancel
    of the same workflow deadlocked (14 times in 12 rounds of a 400-member group on
    three -c 4 workers; four cancels raised, and those workflows ran to the end). Every
    writer now takes the workflow first. Rounds of a 300-member chord and group, the
    workflow cancelled (and, every other round, its members by `Job.objects.cancel` as
    the admin's job action does) while three workers ack its members: the cancel wins
    each time, and PostgreSQL counts no deadlock."""
    import time

    from tests.chaos.harness import deadlocks

    workers = [start_worker("--concurrency", "4", "--reap-interval", "1") for _ in range(3)]
    for worker in workers:
        worker.wait_for_output("worker started", timeout=20)
    before = deadlocks()
    probe = tasks.probe.using(lease=10.0)
    for round_ in range(6):
        members = group(probe.si(ms=2) for _ in range(300))
        flow = chord(members, tasks.chord_body.s()) if round_ % 2 else members
        workflow = flow.enqueue()
        ids = list(workflow.jobs.values_list("id", flat=True))
        wait_until(
            lambda ids=ids: Job.objects.filter(id__in=ids, state=JobState.DONE).count() >= 40,
            timeout=30,
        )
        if round_ % 2:
            Job.objects.cancel(ids[len(ids) // 2 :], by="test")
        assert Workflow.objects.cancel([workflow.id], by="test") == 1
        workflow.refresh_from_db()
        assert workflow.state == WorkflowState.CANCELLED
        wait_until(
            lambda ids=ids: (
                not Job.objects.filter(
                    id__in=ids, state__in=[JobState.PENDING, JobState.WAITING, JobState.RUNNING]
                ).exists()
            ),
            timeout=30,
            message="a member of the cancelled workflow is still unfinished",
        )
    time.sleep(1.0)  # the statistics of the workers' last transactions reach the view
    assert deadlocks() == before
    for worker in workers:
        assert "deadlock detected" not in worker.output()


@pytest.mark.django_db
def test_a_bad_member_deep_in_a_streamed_group_names_its_position():
    """A group read from a generator: member 1,234 has a call the task refuses. The
    refusal names it (nothing told which of thousands), and nothing is written."""

    def members():
        for n in range(2000):
            yield add.s(n, 1) if n != 1234 else add.s(n, 1, 2)

    with pytest.raises(InvalidJobError, match="member 1234 of the group"):
        group(members()).enqueue()
    assert not Job.objects.exists() and not Workflow.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_twenty_waiting_threads_share_one_listen_connection_and_all_wake():
    """Each waiting thread LISTENed on a connection of its own: 20 waiters held 40
    backends, and at 50 other clients were refused ("too many clients"). They share
    one now, and a finishing ack wakes every one of them (not its one-second poll)."""
    import time

    workflows = [chain(add.s(n, 1), double.s()).enqueue() for n in range(20)]
    answers: dict[int, object] = {}
    woken: dict[int, float] = {}
    ready = threading.Barrier(21)

    def waiter(workflow_id: int) -> None:
        try:
            ready.wait(timeout=10)
            answers[workflow_id] = Workflow.objects.get(id=workflow_id).wait(timeout=20)
            woken[workflow_id] = time.monotonic()
        finally:
            connection.close()

    threads = [threading.Thread(target=waiter, args=(w.id,)) for w in workflows]
    for thread in threads:
        thread.start()
    ready.wait(timeout=10)
    time.sleep(0.3)  # the waiters are past their first look (a deadline, not a sync)
    listening = listening_backends()
    finished_at = time.monotonic()
    run_jobs()
    for thread in threads:
        thread.join(timeout=20)
    assert listening == 1
    assert answers == {w.id: 2 * (n + 1) for n, w in enumerate(workflows)}
    assert max(woken.values()) - finished_at < 5
