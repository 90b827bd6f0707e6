"""flow.FlowView, the worker's view of paused and limited queues: no database, no threads."""

from __future__ import annotations

from django_skipqueue.conf.limits import QueueLimit
from django_skipqueue.runtime.flow import KEYED_CHECK_SECONDS, REFRESH_SECONDS, FlowView


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def view(paused: set[str], clock: Clock, reads: list[int]) -> FlowView:
    def read(names):
        reads.append(1)
        return paused & set(names)

    return FlowView(
        queues=["default", "reports", "emails"],
        limits={"reports": QueueLimit(concurrency=3), "elsewhere": QueueLimit(rate=1)},
        read_paused=read,
        clock=clock,
    )


def test_the_plan_leaves_paused_queues_out_and_splits_limited_ones():
    clock, reads, paused = Clock(), [], {"emails"}
    flow = view(paused, clock, reads)
    assert flow.plan() == (["default"], ["reports"])
    assert set(flow.limits) == {"reports"}  # only this worker's queues


def test_the_queue_table_is_read_at_most_once_a_refresh_unless_notified():
    clock, reads, paused = Clock(), [], set()
    flow = view(paused, clock, reads)
    flow.plan()
    paused.add("default")
    clock.now += REFRESH_SECONDS / 3
    assert flow.plan() == (["default", "emails"], ["reports"])  # not read again yet
    assert len(reads) == 1
    flow.changed()  # a NOTIFY on the control channel
    assert flow.plan() == (["emails"], ["reports"])
    assert len(reads) == 2
    paused.clear()
    clock.now += REFRESH_SECONDS  # no NOTIFY (a pooler): polling finds it
    assert flow.plan() == (["default", "emails"], ["reports"])
    assert len(reads) == 3


def test_keyed_jobs_go_first_only_while_busy_and_at_most_once_a_period():
    clock, reads = Clock(), []
    flow = view(set(), clock, reads)
    assert not flow.keyed_check_due(busy=False)
    assert flow.keyed_check_due(busy=True)
    assert not flow.keyed_check_due(busy=True)
    clock.now += KEYED_CHECK_SECONDS
    assert flow.keyed_check_due(busy=True)


def test_a_busy_worker_reads_after_its_claim_so_that_claims_rarely_wait():
    clock, reads, paused = Clock(), [], set()
    flow = view(paused, clock, reads)
    flow.plan()
    clock.now += REFRESH_SECONDS / 3
    flow.refresh_soon()
    assert len(reads) == 1  # read a third of a refresh ago: not yet
    clock.now += REFRESH_SECONDS / 3
    flow.refresh_soon()
    assert len(reads) == 2
    clock.now += REFRESH_SECONDS * 0.9
    flow.plan()
    assert len(reads) == 2  # the claim itself did not wait for a reading


def test_a_worker_whose_listen_works_trusts_notify_and_reads_rarely():
    from django_skipqueue.runtime.flow import LISTENING_REFRESH_SECONDS

    clock, reads, paused = Clock(), [], set()
    flow = view(paused, clock, reads)
    flow.listening(True)
    flow.plan()
    clock.now += REFRESH_SECONDS * 5
    flow.plan()
    assert len(reads) == 1
    flow.changed()  # a pause's NOTIFY
    flow.plan()
    assert len(reads) == 2
    clock.now += LISTENING_REFRESH_SECONDS
    flow.plan()
    assert len(reads) == 3  # the safety net
    flow.listening(False)  # the listener lost its connection: read now, then poll
    flow.plan()
    assert len(reads) == 4


def test_keyed_jobs_are_looked_for_when_announced_and_probed_for_once_a_period():
    from django_skipqueue.runtime.flow import KEYED_PROBE_SECONDS

    clock, reads = Clock(), []
    flow = view(set(), clock, reads)
    assert flow.keyed_waiting()  # unknown at start: the first claim looks
    flow.note_keyed(False)  # the keyed claim found none
    assert not flow.keyed_waiting()
    flow.keyed_arrived()  # a NOTIFY on the keyed channel
    assert flow.keyed_waiting()
    flow.note_keyed(False)
    assert flow.keyed_probe_due()  # the housekeeper's probe, once a period
    assert not flow.keyed_probe_due()
    clock.now += KEYED_PROBE_SECONDS
    assert flow.keyed_probe_due()
