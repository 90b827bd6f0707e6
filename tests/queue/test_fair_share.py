"""Fair share within a queue (SKIPQUEUE['FAIR_QUEUES'], issue 56 point 1): while several
keys have due jobs, each gets claims in proportion to its weight, across every worker;
a key alone gets them all; priorities order the jobs within a key. The tests settings
make the queue "tenants" fair."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db.models.functions import Now

from django_skipqueue import group
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.models import Job, JobState
from django_skipqueue.queue import fair
from tests.processes import run_in_threads, wait_until
from tests.testapp import tasks
from tests.testapp.models import Span

pytestmark = [pytest.mark.django_db(transaction=True)]


def claim(limit: int, start: str = "") -> list[Job]:
    return Job.objects.claim_fair(queue="tenants", limit=limit, start=start)


def tenants_of(jobs: list[Job]) -> list[str]:
    return sorted(job.fair_key or "" for job in jobs)


def enqueue(tenant: str, count: int, **options: Any) -> list[Job]:
    chosen = tasks.tenant_job.using(**options) if options else tasks.tenant_job
    return chosen.enqueue_many([((tenant, n), {}) for n in range(count)])


def test_every_way_of_enqueueing_into_a_fair_queue_writes_a_fair_key():
    one = tasks.tenant_job.enqueue("acme")
    [many] = enqueue("globex", 1, fair_weight=3)
    keyless = tasks.keyless_tenant_job.enqueue()
    moved = tasks.add.using(queue_name="tenants").enqueue(1, 2)
    group(tasks.tenant_job.s("initech"), tasks.keyless_tenant_job.s()).enqueue()
    elsewhere = tasks.add.enqueue(1, 2)
    rows = {job.id: (job.fair_key, job.fair_weight) for job in Job.objects.all()}
    assert rows[one.id] == ("acme", 1)
    assert rows[many.id] == ("globex", 3)
    assert rows[keyless.id] == ("", 1) and rows[moved.id] == ("", 1)
    assert sorted(key for key, _ in rows.values() if key is not None) == [
        "",
        "",
        "",
        "acme",
        "globex",
        "initech",
    ]
    assert rows[elsewhere.id] == (None, 1)  # not a fair queue: no key


def test_a_fair_key_or_weight_off_a_fair_queue_or_out_of_bounds_is_refused():
    with pytest.raises(ConfigurationError, match=r"queue 'default' is not fair.*FAIR_QUEUES"):
        tasks.tenant_job.using(queue_name="default").enqueue("acme")
    with pytest.raises(ConfigurationError, match=r"fair_weight of .* from 1 to 1000, got 0"):
        tasks.tenant_job.using(fair_weight=0)
    assert Job.objects.count() == 0


def test_each_key_gets_a_turn_before_any_key_gets_a_second_and_one_key_alone_gets_all():
    enqueue("noisy", 50)
    for tenant in ("a", "b", "c", "d", "e"):
        enqueue(tenant, 3)
    # No job ends meanwhile: the running jobs count for their keys claim after claim.
    assert tenants_of(claim(6)) == ["a", "b", "c", "d", "e", "noisy"]
    assert tenants_of(claim(6)) == ["a", "b", "c", "d", "e", "noisy"]
    assert tenants_of(claim(12)) == ["a", "b", "c", "d", "e", *["noisy"] * 7]
    assert tenants_of(claim(10)) == ["noisy"] * 10  # alone now: every slot is its


def test_a_key_of_weight_three_gets_three_claims_to_one():
    enqueue("gold", 30, fair_weight=3)
    enqueue("basic", 30)
    assert tenants_of(claim(4)) == ["basic", "gold", "gold", "gold"]
    assert tenants_of(claim(8)) == ["basic", "basic", *["gold"] * 6]
    running = Job.objects.filter(state=JobState.RUNNING)
    assert running.filter(fair_key="gold").count() == 3 * running.filter(fair_key="basic").count()


def test_the_finished_jobs_no_longer_count_for_their_key():
    enqueue("a", 5)
    enqueue("b", 5)
    first = claim(2)
    assert tenants_of(first) == ["a", "b"]
    a_job = next(job for job in first if job.fair_key == "a")
    assert Job.objects.ack(a_job.id, a_job.attempts, result=None)
    assert tenants_of(claim(1)) == ["a"]  # a runs none now, b one


def test_priorities_order_the_jobs_within_a_key():
    low = enqueue("a", 1)[0]
    high = tasks.tenant_job.using(priority=5).enqueue("a", 99)
    enqueue("b", 1)
    got = claim(2)
    assert {job.id for job in got} == {high.id} | {j.id for j in got if j.fair_key == "b"}
    assert low.id not in {job.id for job in got}


def test_jobs_not_due_expired_or_with_a_concurrency_key_are_not_the_fair_claims():
    enqueue("a", 1, run_after=timedelta(hours=1))
    past = enqueue("b", 1)[0]
    Job.objects.filter(id=past.id).update(expires_at=Now())
    keyed = tasks.tenant_job.using(concurrency_key="one-at-a-time").enqueue("c")
    assert claim(5) == []
    limited, _ = Job.objects.claim_limited(queues=["tenants"], limits={}, limit=5)
    assert [job.id for job in limited] == [keyed.id]


def test_a_fair_queues_jobs_without_a_key_are_claimed_once_no_keyed_job_is_due():
    """Jobs written before the queue was made fair (no key at all) are not lost: the
    plain claim takes them when no keyed job is due."""
    old = tasks.keyless_tenant_job.enqueue()
    Job.objects.filter(id=old.id).update(fair_key=None)
    enqueue("a", 1)
    assert tenants_of(claim(5)) == ["a"]
    assert [job.id for job in claim(5)] == [old.id]


def test_past_the_keys_one_claim_looks_at_the_next_claim_goes_on_from_where_it_ended(
    monkeypatch,
):
    monkeypatch.setattr(fair, "MAX_FAIR_KEYS", 2)
    for tenant in ("a", "b", "c", "d", "e"):
        enqueue(tenant, 2)
    start, seen = "", []
    for _ in range(5):
        [job] = claim(1, start)
        seen.append(job.fair_key)
        start = job.fair_key or ""
    assert sorted(seen) == ["a", "b", "c", "d", "e"]  # each came round, none twice


def test_claims_from_threads_at_once_never_take_a_job_twice_and_share_the_keys():
    for tenant in ("a", "b", "c", "d"):
        enqueue(tenant, 10)
    barrier = threading.Barrier(4)
    claimed: list[Job] = []
    errors: list[BaseException] = []

    def claims() -> None:
        try:
            barrier.wait()
            while got := claim(2):  # a claim that collided with another takes fewer
                claimed.extend(got)
        except BaseException as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    run_in_threads(claims, 4)
    assert not errors
    assert len({job.id for job in claimed}) == len(claimed)  # none twice
    assert Job.objects.filter(state=JobState.PENDING).count() == 0
    assert len(claimed) == 40


@pytest.mark.timeout(120)
def test_a_noisy_tenants_backlog_does_not_keep_small_tenants_waiting_on_real_workers(
    start_worker,
):
    """The issue's case, small: a tenant enqueues 300 jobs, then ten tenants 3 each. In
    claim order the small ones would start after the 300; by share, each small
    tenant's jobs start among the first ones (each claim takes one per key), and the
    noisy tenant still gets the workers the others leave."""
    enqueue_slow = tasks.tenant_job.enqueue_many
    enqueue_slow([(("noisy", n, 0.01), {}) for n in range(300)])
    small = [f"small-{i}" for i in range(10)]
    for tenant in small:
        enqueue_slow([((tenant, n, 0.01), {}) for n in range(3)])
    start_worker("--queue", "tenants", "--concurrency", "4")
    start_worker("--queue", "tenants", "--concurrency", "4")
    wait_until(
        lambda: Job.objects.filter(state=JobState.DONE).count() == 330,
        timeout=90,
        message="the tenants' jobs did not all run",
    )
    order = list(Span.objects.order_by("started_at", "id").values_list("key", flat=True))
    assert len(order) == 330
    last_small = max(index for index, key in enumerate(order) if key != "noisy")
    assert last_small < 120, last_small  # in claim order: 300 or more
    assert order.count("noisy") == 300


def test_a_jobs_page_says_its_keys_share_and_shows_the_key_only_to_who_sees_payloads(
    client, admin_client
):
    from django.contrib.auth.models import Permission, User
    from django.urls import reverse

    from django_skipqueue.models import WorkerProcess

    WorkerProcess.objects.create(hostname="test", pid=1, queues=["tenants"])
    first, second, third = enqueue("tenant-secret-9", 3, fair_weight=2)
    [running] = claim(1)
    assert running.id == first.id
    url = reverse("admin:skipqueue_job_change", args=[third.id])
    viewer = User.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(*Permission.objects.filter(codename__startswith="view_"))
    viewer.user_permissions.remove(Permission.objects.get(codename="view_job_payload"))
    client.force_login(viewer)
    page = client.get(url).content.decode()
    assert "fair share: its key runs 1 jobs (weight 2), 1 of its due jobs come before it" in page
    assert "tenant-secret-9" not in page and "set (hidden)" in page
    assert "tenant-secret-9 (weight 2)" in admin_client.get(url).content.decode()


def test_the_overview_counts_a_fair_queues_keys_and_its_largest_backlog_without_names():
    from django_skipqueue.lag import queue_reasons
    from django_skipqueue.models import WorkerProcess
    from django_skipqueue.stats import queue_stats

    WorkerProcess.objects.create(hostname="test", pid=1, queues=["tenants"])
    enqueue("noisy-secret", 20)
    enqueue("a", 2)
    enqueue("b", 3)
    text = " ".join(queue_reasons(queue_stats(broker=False))["tenants"])
    assert "fair share between 3 keys with due jobs; the largest backlog holds 20 of 25" in text
    assert "noisy-secret" not in text


def test_keys_without_a_due_job_do_not_fill_a_claims_walk_and_the_walk_moves_on(monkeypatch):
    """The outside trial's starvation: 1,100 tenants with only scheduled jobs sorted
    before the due ones, and the claim's look at its first 1,000 keys found none due;
    the plain claim then took a noisy tenant's jobs in claim order, again and again.
    Keys are now counted by the due ones (up to MAX_FAIR_KEYS) within a longer walk,
    keys with only rate-limited or keyed jobs are not walked at all, and a claim that
    found no due job in its walk makes the next start where the walk ended."""
    monkeypatch.setattr(fair, "MAX_FAIR_KEYS", 5)
    monkeypatch.setattr(fair, "MAX_FAIR_WALK", 20)
    for n in range(30):
        enqueue(f"a{n:02d}", 1, run_after=timedelta(hours=1))
    tasks.rated_tenant_job.enqueue_many([((f"b{n:02d}",), {}) for n in range(30)])
    enqueue("zz", 50)
    for n in range(5):
        enqueue(f"t{n:02d}", 2)
    # The first walk meets 20 scheduled keys: no due job in it, so the plain claim takes
    # three in claim order, and the next walk starts where this one ended.
    first, start = Job.objects.claim_fair_from(queue="tenants", limit=3, start="")
    assert [job.fair_key for job in first] == ["zz"] * 3 and start == "a19"
    second, start = Job.objects.claim_fair_from(queue="tenants", limit=3, start=start)
    assert sorted(job.fair_key for job in second) == ["t00", "t01", "t02"]
    third, _ = Job.objects.claim_fair_from(queue="tenants", limit=3, start=start)
    # zz runs three already: t03's second job comes before zz's fourth.
    assert sorted(job.fair_key for job in third) == ["t03", "t03", "t04"]
