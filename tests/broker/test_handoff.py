"""The broker consumer's shared state (broker/handoff.py), driven by real threads.

No broker is needed: the handoff is what the consuming thread and the pool's threads
share, and these tests play both sides.
"""

from __future__ import annotations

import threading

from django_skipqueue.broker.handoff import Done, Handoff, Held


def done(tag: int, generation: int = 1) -> Done:
    return Done(generation, tag, message=f"message {tag}", verdict="ok")  # type: ignore[arg-type]


def held(tag: int, give_up_at: float = 1e9, deliveries: int = 0, hand_back_at: float = 1e9) -> Held:
    return Held(
        message=f"message {tag}",  # type: ignore[arg-type]
        deliveries=deliveries,
        came=0.0,
        hand_back_at=hand_back_at,
        give_up_at=give_up_at,
    )


def started(
    handoff: Handoff,
    tag: int,
    *,
    timeout: float | None = None,
    generation: int = 1,
    give_up_at: float = 1e9,
) -> None:
    handoff.hold((generation, tag), held(tag, give_up_at))
    assert handoff.start((generation, tag), timeout, now=0.0)


def test_every_verdict_is_drained_once_and_none_waits_without_a_wake_up():
    """Eight pool threads finish 2,000 deliveries while the consuming thread drains
    whenever it is woken: each verdict arrives once, and the last one is never left
    waiting with no wake-up on its way (a lost wake-up would stall acks)."""
    handoff = Handoff()
    woken = threading.Semaphore(0)
    handoff.connected(woken.release)
    threads, per_thread = 8, 250
    for tag in range(threads * per_thread):
        handoff.hold((1, tag), held(tag))
    start = threading.Barrier(threads + 1)
    drained: list[int] = []

    def pool_thread(first: int) -> None:
        start.wait(timeout=10)
        for tag in range(first, first + per_thread):
            assert handoff.start((1, tag), None, now=0.0)
            assert handoff.finish(done(tag))

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
    assert handoff.waiting() == 0 and handoff.busy() == 0


def test_one_wake_up_is_asked_for_however_many_finish_before_the_drain():
    handoff = Handoff()
    wakes = []
    handoff.connected(lambda: wakes.append(1))
    for tag in range(6):
        started(handoff, tag)
    for tag in range(5):
        handoff.finish(done(tag))
    assert len(wakes) == 1
    assert [d.tag for d in handoff.drain()] == [0, 1, 2, 3, 4]
    handoff.finish(done(5))
    assert len(wakes) == 2  # after a drain, the next verdict wakes again


def test_a_delivery_past_its_deadline_is_given_up_once_and_its_late_verdict_dropped():
    handoff = Handoff()
    handoff.connected(lambda: None)
    started(handoff, 7, timeout=10.0)
    started(handoff, 8, timeout=50.0)
    assert handoff.overdue(1, now=5.0).running == []
    [(tag, slow, by_broker)] = handoff.overdue(1, now=20.0).running
    assert (tag, slow.message, by_broker) == (7, "message 7", False)  # its task's timeout
    assert handoff.overdue(1, now=30.0).running == []  # once only
    assert handoff.finish(done(7)) is False  # settled already
    assert handoff.finish(done(8)) is True  # in time: settled by its verdict
    assert handoff.overdue(1, now=99.0).running == []  # and no longer held
    assert [d.tag for d in handoff.drain()] == [8]
    assert handoff.busy() == 0  # both threads returned, the late one too


def test_near_the_brokers_timeout_a_waiting_delivery_is_handed_back_and_a_running_one_timed_out():
    """An outside trial: deliveries that waited for a thread behind long tasks stayed
    unacked past the broker's consumer timeout, which closed the channel and counted a
    delivery against each; innocent jobs reached DELIVERY_LIMIT. Now one still waiting
    at half that timeout is handed back, and one running at nine tenths is timed out, by
    the broker's timeout and not its task's (a later one)."""
    handoff = Handoff()
    handoff.connected(lambda: None)
    started(handoff, 1, timeout=60.0, give_up_at=9.0)
    handoff.hold((1, 2), held(2, give_up_at=9.0, hand_back_at=5.0, deliveries=1))
    assert handoff.busy() == 1
    found = handoff.overdue(1, now=5.5)
    assert [(tag, h.deliveries) for tag, h in found.unstarted] == [(2, 1)]
    assert found.running == []
    assert handoff.start((1, 2), None, now=6.0) is False  # handed back: never run
    [(tag, _, by_broker)] = handoff.overdue(1, now=9.5).running
    assert (tag, by_broker) == (1, True)
    assert handoff.finish(done(1)) is False
    assert handoff.busy() == 0


def test_a_delivery_that_waited_half_the_timeout_is_not_started_late():
    """The same trial: a 2 s job that waited for a thread started just before the give-up
    time and was timed out a moment later, its attempt lost, dead-lettered on its last
    one ("the job ran 4s"). A thread that reaches a delivery past its hand-back time
    skips it, and the consuming thread hands it back."""
    handoff = Handoff()
    handoff.connected(lambda: None)
    handoff.hold((1, 3), held(3, give_up_at=9.0, hand_back_at=5.0))
    assert handoff.start((1, 3), None, now=5.2) is False
    assert handoff.busy() == 0
    [(tag, _)] = handoff.overdue(1, now=5.3).unstarted
    assert tag == 3


def test_a_timeout_and_a_late_verdict_racing_settle_the_delivery_exactly_once():
    """The consuming thread gives up on deliveries while their threads return: each
    delivery ends settled once, by one side or the other."""
    handoff = Handoff()
    handoff.connected(lambda: None)
    count = 3000
    for tag in range(count):
        started(handoff, tag, timeout=0.5)
    start = threading.Barrier(2)
    by_verdict: list[int] = []
    by_timeout: list[int] = []

    finished = threading.Event()

    def pool_thread() -> None:
        start.wait(timeout=10)
        for tag in range(count):
            if handoff.finish(done(tag)):
                by_verdict.append(tag)
        finished.set()

    def consuming_thread() -> None:
        start.wait(timeout=10)
        while not finished.is_set():
            by_timeout.extend(tag for tag, _, _ in handoff.overdue(1, now=1.0).running)
        by_timeout.extend(tag for tag, _, _ in handoff.overdue(1, now=1.0).running)

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
    started(handoff, 1, timeout=0.0)
    started(handoff, 2)
    handoff.hold((1, 4), held(4))
    handoff.finish(done(2))
    handoff.connected(lambda: new_wakes.append(1))
    assert handoff.drain() == []
    assert handoff.finish(done(1)) is False  # its tag died with the channel
    assert handoff.start((1, 4), None, now=0.0) is False  # redelivered: not run here
    started(handoff, 3, generation=2)
    handoff.finish(done(3, generation=2))
    assert (len(old_wakes), len(new_wakes)) == (1, 1)
    assert handoff.busy() == 0


def test_a_wake_up_that_fails_leaves_the_verdict_to_the_next_turn():
    handoff = Handoff()

    def closed() -> None:
        raise RuntimeError("connection closed")

    handoff.connected(closed)
    started(handoff, 1)
    assert handoff.finish(done(1)) is True
    assert [d.tag for d in handoff.drain()] == [1]
