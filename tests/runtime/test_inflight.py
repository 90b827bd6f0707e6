"""The worker's held jobs (InFlight) and its claim sizing, without threads or a database."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest

from django_skipqueue.runtime.inflight import (
    NEVER,
    PAST,
    STUCK,
    Buffer,
    ClaimSize,
    Finished,
    InFlight,
)


def job(job_id: int, lease: float = 3.0, attempts: int = 1) -> SimpleNamespace:
    return SimpleNamespace(id=job_id, lease=timedelta(seconds=lease), attempts=attempts)


@pytest.fixture
def held() -> InFlight:
    return InFlight()


def test_a_claimed_job_is_held_and_due_for_renewal_after_a_third_of_its_lease(held):
    flight = held.add(job(1, lease=3.0), now=100.0, timeout=None)
    assert (len(held), held.held(), flight.attempt) == (1, 1, 1)
    assert held.plan_pass() == 101.0
    assert held.due_renewals(100.9) == []
    assert held.due_renewals(101.0) == [flight]
    held.renewed(flight, now=101.0)
    assert held.plan_pass() == 102.0


def test_a_refused_renewal_is_never_tried_again(held):
    flight = held.add(job(1), now=0.0, timeout=None)
    held.renewal_refused(flight)
    assert held.due_renewals(1e9) == [] and held.plan_pass() == NEVER


def test_a_timeout_counts_from_the_start_not_the_claim(held):
    flight = held.add(job(1), now=0.0, timeout=5.0)
    assert held.timed_out(100.0) == []  # buffered: no timeout yet
    held.start(flight.job, threading.current_thread(), now=50.0)
    assert held.timed_out(54.9) == []
    assert held.timed_out(55.0) == [flight]


def test_the_housekeepers_pass_is_planned_for_renewals_time_limits_and_its_own_schedule(held):
    wake = threading.Event()
    held.wakes(wake)
    first = held.add(job(1, lease=30.0), now=0.0, timeout=5.0)
    assert held.plan_pass(20.0) == 10.0  # its renewal; buffered, its limit not counted yet
    wake.clear()
    held.start(first.job, threading.current_thread(), now=1.0)
    assert wake.is_set()  # its limit, 6.0, falls before the planned pass: woken
    wake.clear()
    assert held.plan_pass(20.0) == 6.0
    late = held.add(job(2, lease=30.0), now=1.0, timeout=60.0)
    held.start(late.job, threading.current_thread(), now=2.0)
    assert not wake.is_set()  # 62.0 falls after the planned pass: left asleep
    short = held.add(job(3, lease=30.0), now=2.0, timeout=0.5)
    held.start(short.job, threading.current_thread(), now=3.0)
    assert wake.is_set()  # 3.5
    assert held.plan_pass(20.0) == 3.5
    held.queue_ack(Finished(short.job, 1, None, 0.1))
    assert held.plan_pass(20.0) == 6.0  # a success waiting for its ack is never timed out
    assert held.plan_pass(1.5) == 1.5  # the housekeeper's own schedule first


def test_a_claim_whose_renewal_falls_before_the_planned_pass_wakes_the_housekeeper(held):
    wake = threading.Event()
    held.wakes(wake)
    assert held.plan_pass(1.0) == 1.0  # the housekeeper's own schedule: a pass at 1.0
    held.add(job(1, lease=30.0), now=0.0, timeout=None)  # renewal at 10.0
    assert not wake.is_set()  # after the planned pass: left asleep
    held.add(job(2, lease=1.5), now=0.0, timeout=None)  # renewal at 0.5
    assert wake.is_set()
    wake.clear()
    held.add(job(3, lease=1.8), now=0.0, timeout=None)  # 0.6: the pass is now planned at 0.5
    assert not wake.is_set()
    assert held.plan_pass(1.0) == 0.5


def test_a_success_waits_for_its_ack_and_is_not_counted_as_held_meanwhile(held):
    thread = threading.current_thread()
    flight = held.add(job(1), now=0.0, timeout=1.0)
    held.start(flight.job, thread, now=0.0)
    held.queue_ack(Finished(flight.job, 1, "result", 0.1))
    held.stop_running(thread)
    assert (len(held), held.held(), held.busy) == (1, 0, 0)
    assert held.timed_out(10.0) == []  # finished: never timed out
    [batch] = held.take_acks()
    assert batch.result == "result" and held.take_acks() == []
    held.acked(1)
    held.finish(1, 1)
    assert len(held) == 0


def test_a_job_past_its_limit_is_marked_then_found_stuck_and_renewed_throughout(held):
    """At its limit the attempt is marked (its task's flag says so) and given `grace`;
    still held at the end of it, it is stuck, and never looked at again. Its lease is
    renewed all along: the job and its slot stay this attempt's until its outcome."""
    flight = held.add(job(1, lease=3.0), now=0.0, timeout=1.0)
    held.start(flight.job, threading.current_thread(), now=0.0)
    [due] = held.timed_out(1.0)
    assert held.past_limit(due, now=1.0, grace=0.5) == PAST
    assert flight.cancel.exceeded == 1.0 and held.past_their_limit() == [flight]
    assert held.timed_out(1.4) == [] and held.timed_out(1.5) == [flight]
    assert held.due_renewals(1.5) == [flight]  # still renewed
    assert held.past_limit(flight, now=1.5, grace=0.5) == STUCK
    assert held.timed_out(1e9) == [] and held.due_renewals(1e9) == [flight]
    held.finish(1, 1)  # its outcome written (the worker's stop)
    assert held.past_limit(flight, now=2.0, grace=0.5) is None
    assert held.past_their_limit() == []


def test_a_job_that_finished_or_waits_for_its_ack_is_never_marked_past_its_limit(held):
    thread = threading.current_thread()
    acking = held.add(job(1), now=0.0, timeout=1.0)
    held.start(acking.job, thread, now=0.0)
    held.queue_ack(Finished(acking.job, 1, None, 0.9))
    assert held.past_limit(acking, now=1.0, grace=0.5) is None
    gone = held.add(job(2), now=0.0, timeout=1.0)
    held.start(gone.job, thread, now=0.0)
    held.finish(2, 1)
    assert held.past_limit(gone, now=1.0, grace=0.5) is None
    assert acking.cancel.exceeded is None and gone.cancel.exceeded is None


def test_a_dead_thread_gives_up_its_job(held):
    thread = threading.Thread(target=lambda: None)
    flight = held.add(job(7), now=0.0, timeout=None)
    held.start(flight.job, thread, now=0.0)
    assert held.thread_died(thread) == 7
    assert (len(held), held.busy) == (0, 0)
    assert held.thread_died(thread) is None


def test_unstarted_jobs_are_taken_back_and_the_rest_remain(held):
    a, b, c = (held.add(job(n), now=0.0, timeout=None) for n in (1, 2, 3))
    assert held.unstarted([1, 3, 99]) == [a, c]
    assert held.remaining() == [b]


def test_the_buffer_hands_jobs_over_in_order_and_gives_back_the_unstarted_ones():
    buffer = Buffer()
    for n in (1, 2, 3):
        buffer.put(job(n))
    assert buffer.get().id == 1
    assert (buffer.qsize(), buffer.drain(), buffer.qsize()) == (2, [2, 3], 0)


def test_closing_the_buffer_ends_each_thread_after_the_jobs_before_it():
    buffer = Buffer()
    buffer.put(job(1))
    buffer.close(2)
    assert [buffer.get().id, buffer.get(), buffer.get()] == [1, None, None]
    buffer.put(job(2))
    buffer.close(1)
    buffer.put(job(3))
    assert buffer.drain() == [2]  # stops at the end marker: the threads still need it


def test_claim_size_adapts_the_prefetch_to_the_jobs_run_time():
    sizing = ClaimSize(concurrency=4, fixed=None)
    assert sizing.prefetch() == 0  # nothing known yet
    sizing.observe(0.001)  # 1 ms jobs: 50 ms of work a thread
    assert sizing.prefetch() == 200
    for _ in range(200):
        sizing.observe(0.00001)  # no-op jobs: at most 64 a thread
    assert sizing.prefetch() == 256
    many = ClaimSize(concurrency=32, fixed=None)
    many.observe(0.00001)
    assert many.prefetch() == 1024  # and at most 1024 in all
    for _ in range(200):
        sizing.observe(2.0)
    assert sizing.prefetch() == 0  # long jobs stay in the table


def test_claim_size_waits_for_half_the_room_unless_a_thread_is_idle():
    sizing = ClaimSize(concurrency=4, fixed=4)
    assert sizing.free(held=0, idle_thread=True) == 8
    assert sizing.free(held=5, idle_thread=False) == 0  # 3 free < half of 8
    assert sizing.free(held=5, idle_thread=True) == 3
    assert sizing.free(held=8, idle_thread=True) == 0
    with pytest.raises(ValueError, match="prefetch must be zero or more"):
        ClaimSize(concurrency=1, fixed=-1)


def claimed(*tasks: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(id=n, task=task, attempts=1) for n, task in enumerate(tasks, 1)]


def test_a_claim_beyond_the_idle_threads_gives_back_what_it_cannot_start_soon():
    """Behind the idle threads, only jobs of tasks known to be short wait, and only while
    the known run times ahead keep the wait within the window; a job of an unknown or a
    long task is given back (the mix changed: a worker of two took 96 of 100)."""
    sizing = ClaimSize(concurrency=2, fixed=None)
    for _ in range(5):
        sizing.observe(0.001, "fast")
        sizing.observe(1.0, "slow")
    keep, back = sizing.split(claimed("slow", "slow", "slow", "new", "fast", "fast"), idle=2)
    assert [j.task for j in keep] == ["slow", "slow", "fast", "fast"]
    assert [j.task for j in back] == ["slow", "new"]
    assert sizing.cautious and sizing.prefetch() == 0  # no prefetch while the mix is long
    keep, back = sizing.split(claimed("slow"), idle=1)
    assert (len(keep), back, sizing.cautious) == (1, [], True)
    keep, back = sizing.split(claimed("fast", "fast"), idle=2)  # known short again
    assert not sizing.cautious
    for _ in range(60):
        sizing.observe(0.001, "fast")
    assert sizing.prefetch() > 0


def test_short_jobs_wait_only_while_their_known_run_times_fit_the_window():
    sizing = ClaimSize(concurrency=1, fixed=None)
    sizing.observe(0.02, "twenty_ms")
    keep, back = sizing.split(claimed(*["twenty_ms"] * 6), idle=1)
    # waits 0, 0.02, 0.04 fit the 0.05 s window; 0.06 does not
    assert (len(keep), len(back)) == (4, 2)


def test_a_fixed_prefetch_is_kept_as_asked():
    sizing = ClaimSize(concurrency=1, fixed=8)
    keep, back = sizing.split(claimed("unknown", "unknown", "unknown"), idle=0)
    assert (len(keep), back) == (3, [])
