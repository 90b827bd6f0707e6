"""Unique jobs: at most one unfinished job per task and key (Job's skipqueue_job_unique_key)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import transaction
from django.db.models.functions import Now

from django_skipqueue import DuplicateJobError
from django_skipqueue.exceptions import ConfigurationError, InvalidJobError
from django_skipqueue.models import Job, JobState
from tests.guard import setting_up
from tests.processes import run_in_threads, start_python
from tests.testapp.tasks import add, send_invoice, sync_account

pytestmark = pytest.mark.django_db


def test_a_second_enqueue_with_the_same_key_returns_the_first_job() -> None:
    first = add.using(unique_key="sum:1").enqueue(1, 2)
    second = add.using(unique_key="sum:1").enqueue(5, 6)
    assert second.id == first.id
    assert second.args == [1, 2]  # the job as stored, not the refused call
    assert Job.objects.filter(task=add.name).count() == 1


def test_the_key_can_be_made_of_named_arguments() -> None:
    first = send_invoice.enqueue(42)
    assert first.unique_key == "invoice_id=42"
    assert send_invoice.enqueue(invoice_id=42, note="again").id == first.id
    assert send_invoice.enqueue(43).id != first.id


def test_a_key_function_and_replace_update_a_pending_job() -> None:
    first = sync_account.enqueue("acme")
    later = sync_account.using(run_after=timedelta(hours=1)).enqueue("acme", full=True)
    assert later.id == first.id
    job = Job.objects.get(id=first.id)
    assert job.kwargs == {"full": True}
    assert job.unique_key == "account:acme"
    assert Job.objects.filter(id=job.id, run_at__gt=Now() + timedelta(minutes=59)).exists()


def test_replace_leaves_a_running_job_alone(worker_process) -> None:
    first = sync_account.enqueue("acme")
    (claimed,) = Job.objects.claim(queues=["default"], worker=worker_process)
    assert claimed.id == first.id
    again = sync_account.enqueue("acme", full=True)
    assert again.id == first.id
    assert Job.objects.get(id=first.id).kwargs == {}


def test_raise_refuses_without_aborting_the_callers_transaction() -> None:
    with transaction.atomic():
        first = add.using(unique_key="once").enqueue(1, 1)
        with pytest.raises(DuplicateJobError, match=f"held by job {first.id}") as caught:
            add.using(unique_key="once", on_conflict="raise").enqueue(2, 2)
        assert caught.value.existing_id == first.id
        # The transaction is still usable: no IntegrityError aborted it.
        add.enqueue(3, 3)
    assert Job.objects.filter(task=add.name).count() == 2


def test_a_finished_job_frees_its_key(worker_process) -> None:
    first = add.using(unique_key="k").enqueue(1, 1)
    (claimed,) = Job.objects.claim(queues=["default"], worker=worker_process)
    assert Job.objects.ack(claimed.id, claimed.attempts, 2)
    second = add.using(unique_key="k").enqueue(1, 1)
    assert second.id != first.id


def test_enqueue_many_returns_the_holder_for_each_call() -> None:
    held = send_invoice.enqueue(1)
    jobs = send_invoice.enqueue_many([((1,), {}), ((2,), {}), ((2,), {"note": "x"}), ((3,), {})])
    ids = [job.id for job in jobs]
    assert ids[0] == held.id
    assert ids[1] == ids[2] != ids[3]
    assert Job.objects.filter(task=send_invoice.name).count() == 3
    assert send_invoice.enqueue_many([((3,), {}), ((4,), {})], ids_only=True)[0] == ids[3]


def test_retrying_a_failed_job_skips_it_while_its_key_is_held(worker_process) -> None:
    failed = add.using(unique_key="k").enqueue(1, 1)
    with setting_up():
        Job.objects.filter(id=failed.id).update(state=JobState.FAILED, finished_at=Now())
    holder = add.using(unique_key="k").enqueue(1, 1)
    assert holder.id != failed.id
    assert Job.objects.retry_now([failed.id]) == 0
    with setting_up():
        Job.objects.filter(id=holder.id).update(state=JobState.DONE, finished_at=Now())
    assert Job.objects.retry_now([failed.id]) == 1


def test_bad_keys_are_refused_before_any_write() -> None:
    with pytest.raises(InvalidJobError, match="at most 255"):
        add.using(unique_key="x" * 256).enqueue(1, 1)
    with pytest.raises(InvalidJobError, match="on_conflict='sometimes'"):
        add.using(unique_key="k", on_conflict="sometimes")
    with pytest.raises(ConfigurationError, match="does not take"):
        add.using(unique_key=["a", "c"])
    assert not Job.objects.exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_threads_and_processes_enqueuing_one_key_leave_one_job() -> None:
    code = (
        "from django.db import transaction\n"
        "from tests.testapp.tasks import send_invoice\n"
        "ids = set()\n"
        "for _ in range(200):\n"
        "    with transaction.atomic():\n"
        "        ids.add(send_invoice.enqueue(7).id)\n"
        "print(sorted(ids))\n"
    )
    children = [start_python(code) for _ in range(2)]
    start, lock, seen = threading.Barrier(8), threading.Lock(), []

    def enqueuer() -> None:
        start.wait(timeout=10)
        for _ in range(50):
            with transaction.atomic():
                job_id = send_invoice.enqueue(7).id
            with lock:
                seen.append(job_id)

    run_in_threads(enqueuer, 8)
    outputs = [child.communicate(timeout=60) for child in children]
    assert all(child.returncode == 0 for child in children), outputs
    job = Job.objects.get(task=send_invoice.name)
    assert set(seen) == {job.id}
    assert [eval(out.strip()) for out, _ in outputs] == [[job.id], [job.id]]  # noqa: S307


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_two_transactions_enqueuing_the_same_keys_in_opposite_orders_never_deadlock() -> None:
    calls = [((n,), {}) for n in range(4000)]
    start, errors, ids = threading.Barrier(2), [], []

    def enqueue(order: list) -> None:
        from django.db import connection

        try:
            start.wait(timeout=10)
            with transaction.atomic():
                ids.append(sorted(send_invoice.enqueue_many(order, ids_only=True)))
        except Exception as error:  # noqa: BLE001  (a deadlock is what we look for)
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=enqueue, args=(order,)) for order in (calls, calls[::-1])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert ids[0] == ids[1]  # the second met the first's jobs
    assert Job.objects.count() == 4000


def test_a_nul_or_a_lone_surrogate_in_a_key_is_refused_and_the_transaction_goes_on() -> None:
    with transaction.atomic():
        for key in ("a\x00b", "a\ud800b"):
            with pytest.raises(InvalidJobError, match="NUL character or a lone surrogate"):
                add.using(unique_key=key).enqueue(1, 1)
            with pytest.raises(InvalidJobError, match="NUL character or a lone surrogate"):
                add.using(concurrency_key=lambda a, b, key=key: key).enqueue(1, 1)
        add.enqueue(1, 1)  # the caller's transaction is still usable
    assert Job.objects.count() == 1


def test_one_batch_behaves_as_its_calls_made_one_after_another() -> None:
    replaced = add.using(unique_key="k", on_conflict="replace")
    jobs = replaced.enqueue_many([((1, 1), {}), ((2, 2), {}), ((3, 3), {})])
    assert len({job.id for job in jobs}) == 1
    assert Job.objects.get().args == [3, 3]  # the last call's, as sequential calls leave
    with pytest.raises(DuplicateJobError):
        add.using(unique_key="r", on_conflict="raise").enqueue_many([((1, 1), {}), ((2, 2), {})])
    assert not Job.objects.filter(unique_key="r").exists()


def test_a_keyword_named_self_is_refused_naming_it() -> None:
    with pytest.raises(InvalidJobError, match="self"):
        add.enqueue(1, 2, self=3)


def test_retrying_two_failed_jobs_of_one_key_retries_the_newest_and_skips_the_other() -> None:
    """A normal history (a unique job failed, was enqueued again and failed again) used
    to make a select-all Retry answer 500 on the key's unique index (trial finding)."""
    ids = []
    for _ in range(2):
        job = send_invoice.enqueue(777)
        with setting_up():
            Job.objects.filter(id=job.id).update(state=JobState.FAILED, finished_at=Now())
        ids.append(job.id)
    assert Job.objects.retry_now(ids) == 1
    assert dict(Job.objects.values_list("id", "state")) == {
        ids[0]: JobState.FAILED,
        ids[1]: JobState.PENDING,
    }


@pytest.mark.django_db(transaction=True)
def test_opposite_orders_in_batches_of_ten_never_deadlock() -> None:
    """The keys were sorted within each batch only: with batches of 10, two transactions
    enqueuing 40 keys in opposite orders deadlocked (3 of 3). Sorted across every batch,
    the second waits for the first and meets its jobs."""
    calls = [((n,), {}) for n in range(40)]
    for _ in range(3):
        Job.objects.all().delete()
        start, errors, ids = threading.Barrier(2), [], []

        def enqueue(order: list, start=start, errors=errors, ids=ids) -> None:
            from django.db import connection

            try:
                start.wait(timeout=10)
                with transaction.atomic():
                    ids.append(
                        sorted(send_invoice.enqueue_many(order, batch_size=10, ids_only=True))
                    )
            except Exception as error:  # noqa: BLE001  (a deadlock is what we look for)
                errors.append(error)
            finally:
                connection.close()

        run_in_threads_each([lambda: enqueue(calls), lambda: enqueue(calls[::-1])])
        assert errors == []
        assert ids[0] == ids[1] and Job.objects.count() == 40


def run_in_threads_each(targets: list) -> None:
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
