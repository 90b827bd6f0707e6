"""The broker consumer's shared state (broker/handoff.py), driven by real threads.

No broker is needed: the handoff is what the consuming thread and the pool's threads
share, and these tests play both sides.
"""

from __future__ import annotations

import threading

from django_skipqueue.broker.handoff import Done, Handoff


def done(tag: int, generation: int = 1) -> Done:
    return Done(generation, tag, message=f"message {tag}", verdict="ok")  # type: ignore[arg-type]


def test_every_verdict_is_drained_once_and_none_waits_without_a_wake_up():
    """Eight pool threads finish 2,000 deliveries while the consuming thread drains
    whenever it is woken: each verdict arrives once, and the last one is never left
    waiting with no wake-up on its way (a lost wake-up would stall acks)."""
    handoff = Handoff()
    woken = threading.Semaphore(0)
    handoff.connected(woken.release)
    threads, per_thread = 8, 250
    start = threading.Barrier(threads + 1)
    drained: list[int] = []

    def pool_thread(first: int) -> None:
        start.wait(timeout=10)
        for tag in range(first, first + per_thread):
            assert handoff.finish(done(tag), timed=False)

    workers = [threading.Thread(target=pool_thread, args=(n * per_thread,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    start.wait(timeout=10)
    while len(drained) < threads * per_thread:
        assert woken.acquire(timeout=10), f"no wake-up with {handoff.waiting()} waiting"
        drained.extend(d.tag for d in handoff.drain())
    for worker in workers:
        worker.join(timeout=10)
    assert sorted(drained) == list(range(threads * per_thread))
    assert handoff.waiting() == 0


def test_one_wake_up_is_asked_for_however_many_finish_before_the_drain():
    handoff = Handoff()
    wakes = []
    handoff.connected(lambda: wakes.append(1))
    for tag in range(5):
        handoff.finish(done(tag), timed=False)
    assert len(wakes) == 1
    assert [d.tag for d in handoff.drain()] == [0, 1, 2, 3, 4]
    handoff.finish(done(5), timed=False)
    assert len(wakes) == 2  # after a drain, the next verdict wakes again


def test_a_delivery_past_its_deadline_is_given_up_once_and_its_late_verdict_dropped():
    handoff = Handoff()
    handoff.connected(lambda: None)
    handoff.timed((1, 7), deadline=10.0, message="slow")  # type: ignore[arg-type]
    handoff.timed((1, 8), deadline=50.0, message="fast")  # type: ignore[arg-type]
    assert handoff.expired(1, now=5.0) == []
    assert handoff.expired(1, now=20.0) == [(7, "slow")]
    assert handoff.expired(1, now=30.0) == []  # once only
    assert handoff.finish(done(7), timed=True) is False  # settled already
    assert handoff.finish(done(8), timed=True) is True  # in time: settled by its verdict
    assert handoff.expired(1, now=99.0) == []  # and no longer timed
    assert [d.tag for d in handoff.drain()] == [8]


def test_a_timeout_and_a_late_verdict_racing_settle_the_delivery_exactly_once():
    """The consuming thread gives up on deliveries while their threads return: each
    delivery ends settled once, by one side or the other."""
    handoff = Handoff()
    handoff.connected(lambda: None)
    count = 3000
    for tag in range(count):
        handoff.timed((1, tag), deadline=0.0, message=tag)  # type: ignore[arg-type]
    start = threading.Barrier(2)
    by_verdict: list[int] = []
    by_timeout: list[int] = []

    finished = threading.Event()

    def pool_thread() -> None:
        start.wait(timeout=10)
        for tag in range(count):
            if handoff.finish(done(tag), timed=True):
                by_verdict.append(tag)
        finished.set()

    def consuming_thread() -> None:
        start.wait(timeout=10)
        while not finished.is_set():
            by_timeout.extend(tag for tag, _ in handoff.expired(1, now=1.0))
        by_timeout.extend(tag for tag, _ in handoff.expired(1, now=1.0))

    threads = [threading.Thread(target=pool_thread), threading.Thread(target=consuming_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(by_verdict + by_timeout) == list(range(count))
    assert set(by_verdict).isdisjoint(by_timeout)


def test_a_new_connection_forgets_what_the_old_one_held():
    handoff = Handoff()
    old_wakes, new_wakes = [], []
    handoff.connected(lambda: old_wakes.append(1))
    handoff.timed((1, 1), deadline=0.0, message="old")  # type: ignore[arg-type]
    handoff.finish(done(2), timed=False)
    handoff.connected(lambda: new_wakes.append(1))
    assert handoff.drain() == []
    assert handoff.finish(done(1), timed=True) is False  # its tag died with the channel
    handoff.finish(done(3, generation=2), timed=False)
    assert (len(old_wakes), len(new_wakes)) == (1, 1)


def test_a_wake_up_that_fails_leaves_the_verdict_to_the_next_turn():
    handoff = Handoff()

    def closed() -> None:
        raise RuntimeError("connection closed")

    handoff.connected(closed)
    assert handoff.finish(done(1), timed=False) is True
    assert [d.tag for d in handoff.drain()] == [1]
