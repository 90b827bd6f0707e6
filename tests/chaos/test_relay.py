"""Relayed queues under faults (docs/explanation/failure-model.md, "Relayed queues"):
the relay SIGKILLed while it publishes, RabbitMQ restarted under load, consumers
SIGKILLed, a poison message. Real processes, the real broker; 0 lost every time, and
duplicates counted against what the design allows."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections import Counter

import pytest

from django_skipqueue.broker import broker_queue, dead_queue
from django_skipqueue.models import Job
from tests.processes import wait_until
from tests.rabbitmq import (
    broker_or_skip,
    delete_broker_queues,
    depth,
    drain,
    fresh_queue_name,
    relay_settings,
)
from tests.testapp import tasks
from tests.testapp.models import DuplicateEffect, Effect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def broker_queue_name():
    broker_or_skip()
    name = fresh_queue_name()
    yield name
    delete_broker_queues(name)


@pytest.mark.timeout(240)
def test_sigkilling_the_relay_while_it_publishes_5000_jobs_loses_none(
    supervisor, broker_queue_name
):
    """T48."""
    queue, batch, total = broker_queue_name, 100, 5000
    settings = relay_settings(queue, BATCH_SIZE=batch)
    tasks.record.using(queue_name=queue).enqueue_many([((), {})] * total)
    rng = random.Random(18)
    kills = 0
    deadline = time.monotonic() + 180
    while Job.objects.filter(queue_name=queue).exists():
        assert time.monotonic() < deadline, "the relays did not publish everything"
        relay = supervisor.start(settings=settings, command="relayjobs")
        relay.wait_for_output("relay started")
        time.sleep(rng.uniform(0.05, 0.6))
        if not Job.objects.filter(queue_name=queue).exists():
            break
        supervisor.kill_random(rng)
        kills += 1
    published = Counter(int(p.message_id) for _, p, _ in drain(broker_queue(queue)))
    duplicates = sum(published.values()) - len(published)
    print(f"\nrelay kills={kills} published={sum(published.values())} duplicates={duplicates}")
    assert len(published) == total  # 0 lost
    assert kills >= 3
    assert duplicates <= kills * batch


def rabbitmqctl() -> list[str]:
    """rabbitmqctl for the broker the tests use: the local default node, or the node
    SKIPQUEUE_TEST_RABBITMQ_NODE names (with SKIPQUEUE_TEST_AMQP_URL pointing at it)."""
    node = os.environ.get("SKIPQUEUE_TEST_RABBITMQ_NODE")
    return ["rabbitmqctl", *(["-n", node] if node else [])]


def restarted(supervisor, consumer, settings, concurrency: str):
    """A new consumer in place of one that exited, as its supervisor would start one."""
    supervisor.workers.remove(consumer)
    supervisor.retired.append(consumer)
    return supervisor.start("--broker", "--concurrency", concurrency, settings=settings)


def wait_for_effects(ids: list[int], timeout: float) -> None:
    wait_until(
        lambda: Effect.objects.filter(job_id__in=ids).count() == len(ids),
        timeout=timeout,
        interval=0.2,
        message=f"{len(ids) - Effect.objects.filter(job_id__in=ids).count()} jobs never ran",
    )


@pytest.mark.timeout(240)
def test_restarting_rabbitmq_mid_run_loses_nothing_and_everyone_reconnects(
    supervisor, broker_queue_name
):
    """T49: `rabbitmqctl stop_app` / `start_app`, the broker's own restart of its
    application (every connection dropped, the quorum queues recovered from disk)."""
    queue = broker_queue_name
    settings = relay_settings(queue)
    supervisor.start(settings=settings, command="relayjobs")
    consumers = [
        supervisor.start("--broker", "--concurrency", "4", settings=settings) for _ in range(2)
    ]
    for consumer in consumers:
        consumer.wait_for_output("broker consumer connected")
    first = tasks.probe.using(queue_name=queue).enqueue_many([((), {"ms": 5})] * 1000)
    wait_until(lambda: Effect.objects.filter(job_id__in=[j.id for j in first]).count() > 200)
    subprocess.run([*rabbitmqctl(), "-q", "stop_app"], check=True, timeout=60)
    second = tasks.probe.using(queue_name=queue).enqueue_many([((), {"ms": 5})] * 1000)
    time.sleep(2)
    subprocess.run([*rabbitmqctl(), "-q", "start_app"], check=True, timeout=120)
    ids = [job.id for job in [*first, *second]]
    wait_for_effects(ids, timeout=150)
    duplicates = DuplicateEffect.objects.filter(job_id__in=ids).count()
    print(f"\nbroker restart jobs={len(ids)} duplicates={duplicates}")
    assert not Job.objects.filter(queue_name=queue).exists()
    assert supervisor.count_in_logs("relay failed, retrying") >= 1
    assert supervisor.count_in_logs("broker consumer lost, retrying") >= 2
    assert supervisor.count_in_logs("relay connected to the broker") >= 2
    # At most what was unacked when the broker went away (two consumers' prefetch of 8),
    # and the relay's batch that the broker had stored before the relay's transaction
    # rolled back (it publishes that batch again).
    assert duplicates <= 2 * 8 + 200


@pytest.mark.timeout(240)
def test_sigkilled_consumers_messages_are_redelivered_and_none_is_lost(
    supervisor, broker_queue_name
):
    """T50."""
    queue = broker_queue_name
    settings = relay_settings(queue)
    supervisor.start(settings=settings, command="relayjobs")
    jobs = tasks.probe.using(queue_name=queue).enqueue_many([((), {"ms": 20})] * 1500)
    ids = [job.id for job in jobs]
    for _ in range(2):
        supervisor.start("--broker", "--concurrency", "4", settings=settings)
    rng = random.Random(7)
    kills = 0
    while kills < 4 and Effect.objects.filter(job_id__in=ids).count() < len(ids) * 0.8:
        time.sleep(rng.uniform(0.8, 1.5))
        victim = rng.choice([h for h in supervisor.workers if "--broker" in h.process.args])
        victim.signal(9)
        victim.wait(timeout=10)
        supervisor.workers.remove(victim)
        supervisor.retired.append(victim)
        kills += 1
        supervisor.start("--broker", "--concurrency", "4", settings=settings)
    wait_for_effects(ids, timeout=150)
    duplicates = DuplicateEffect.objects.filter(job_id__in=ids).count()
    print(f"\nconsumer kills={kills} jobs={len(ids)} duplicates={duplicates}")
    assert kills >= 3
    assert duplicates <= kills * 8  # each kill: at most its prefetch (2 x concurrency)


@pytest.mark.timeout(180)
def test_a_poison_message_that_kills_its_consumers_is_dead_lettered_by_the_delivery_limit(
    supervisor, broker_queue_name
):
    """T51: the poison's first delivery kills its consumer; its second runs in a process
    of its own (as every redelivered message does), whose death the replacement counts
    against the poison alone: dead-lettered at the limit, the consumer alive."""
    queue = broker_queue_name
    settings = relay_settings(queue, DELIVERY_LIMIT=2)
    poison = tasks.probe.using(queue_name=queue).enqueue(mode="exit")
    healthy = tasks.probe.using(queue_name=queue).enqueue_many([((), {})] * 20)
    supervisor.start(settings=settings, command="relayjobs")
    deaths = 0
    deadline = time.monotonic() + 120
    while depth(dead_queue(queue)) == 0:
        assert time.monotonic() < deadline, "the poison message was never dead-lettered"
        consumer = supervisor.start("--broker", "--concurrency", "1", settings=settings)
        try:
            consumer.wait(timeout=10)
            deaths += 1
        except subprocess.TimeoutExpired:
            pass
    supervisor.start("--broker", "--concurrency", "1", settings=settings)
    try:
        wait_for_effects([job.id for job in healthy], timeout=60)
    except AssertionError:
        print(supervisor.logs()[-6000:])
        raise
    [(_, properties, body)] = drain(dead_queue(queue))
    print(f"\npoison consumer deaths={deaths}")
    assert int(properties.message_id) == poison.id
    assert json.loads(body)["id"] == poison.id
    assert "the process running it died" in properties.headers["x-skipqueue-error"]
    assert deaths == 1  # its second delivery killed only the process it ran in


@pytest.mark.timeout(200)
def test_under_steady_load_a_poison_is_dead_lettered_and_no_innocent_is(
    supervisor, broker_queue_name
):
    """T53 (trial finding 15): redelivered messages run in processes of their own at
    once, however many fresh ones arrive, and a fresh copy of one keeps its count."""
    queue = broker_queue_name
    settings = relay_settings(queue, DELIVERY_LIMIT=3)
    probe = tasks.probe.using(queue_name=queue)
    supervisor.start(settings=settings, command="relayjobs")
    consumer = supervisor.start("--broker", "--concurrency", "4", settings=settings)
    healthy: list[int] = []
    poison = None
    deaths = 0
    ends = time.monotonic() + 20
    while time.monotonic() < ends:  # 10 jobs every 0.2 s, and the poison among them
        healthy += [job.id for job in probe.enqueue_many([((), {"ms": 20})] * 10)]
        if poison is None and len(healthy) >= 100:
            poison = probe.enqueue(mode="exit")
        if consumer.process.poll() is not None:  # the poison killed it: a new one
            deaths += 1
            supervisor.workers.remove(consumer)
            supervisor.retired.append(consumer)
            consumer = supervisor.start("--broker", "--concurrency", "4", settings=settings)
        time.sleep(0.2)
    deadline = time.monotonic() + 120
    while Effect.objects.filter(job_id__in=healthy).count() < len(healthy) or not depth(
        dead_queue(queue)
    ):
        if time.monotonic() > deadline:
            print(supervisor.logs()[-6000:])
            pytest.fail(
                f"{len(healthy) - Effect.objects.filter(job_id__in=healthy).count()} "
                f"innocent jobs never ran; dead queue depth {depth(dead_queue(queue))}"
            )
        if consumer.process.poll() is not None:
            deaths += 1
            supervisor.workers.remove(consumer)
            supervisor.retired.append(consumer)
            consumer = supervisor.start("--broker", "--concurrency", "4", settings=settings)
        time.sleep(0.2)
    dead = drain(dead_queue(queue))
    print(f"\nsteady load: jobs={len(healthy)} poison deaths={deaths} dead={len(dead)}")
    assert [int(properties.message_id) for _, properties, _ in dead] == [poison.id]
    assert deaths == 1  # its first delivery; the next ones killed their own process only


@pytest.fixture
def consumer_timeout_4s():
    """The broker's consumer_timeout at 4 s, checked every second, for this test, then
    as it was (RabbitMQ 3.10: settings of the whole broker, read as a channel opens; the
    fault tests run one at a time, and no other suite's test holds a delivery 4 s)."""

    def ctl(expression: str) -> str:
        return subprocess.run(
            [*rabbitmqctl(), "-q", "eval", expression],
            check=True,
            timeout=60,
            capture_output=True,
            text=True,
        ).stdout.strip()

    names = ("consumer_timeout", "channel_tick_interval")
    before = {name: ctl(f"application:get_env(rabbit, {name}).") for name in names}
    ctl("application:set_env(rabbit, consumer_timeout, 4000).")
    ctl("application:set_env(rabbit, channel_tick_interval, 1000).")
    yield 4
    for name, value in before.items():
        if value.startswith("{ok,"):
            ctl(f"application:set_env(rabbit, {name}, {value[4:-1]}).")
        else:
            ctl(f"application:unset_env(rabbit, {name}).")


@pytest.mark.timeout(240)
def test_near_the_consumer_timeout_no_innocent_delivery_is_counted(
    supervisor, broker_queue_name, consumer_timeout_4s
):
    """T55 (issue 52): two jobs that run 9 s, at concurrency 2, past a broker consumer
    timeout of 4 s, with ten short jobs behind them. Before: the broker closed the
    channel, counting a delivery against every unacked message, the short jobs waiting
    for a thread among them; redelivered, they waited again behind the long jobs' threads
    (still running) and the next close dead-lettered them at DELIVERY_LIMIT 2. Now the
    consumer acts before the broker: the long jobs' attempts time out (retried, then
    dead-lettered after their last), the waiting ones are handed back uncounted, and no
    channel is closed. A task given up on that still runs a second later stops its
    consumer (exit code 3), which its supervisor replaces, as here."""
    queue = broker_queue_name
    settings = relay_settings(queue, DELIVERY_LIMIT=2, CONSUMER_TIMEOUT=consumer_timeout_4s)
    probe = tasks.probe.using(queue_name=queue)
    slow = [job.id for job in probe.using(max_attempts=2).enqueue_many([((), {"ms": 9000})] * 2)]
    healthy = [job.id for job in probe.enqueue_many([((), {"ms": 300})] * 10)]
    supervisor.start(settings=settings, command="relayjobs")
    consumer = supervisor.start("--broker", "--concurrency", "2", settings=settings)
    deadline = time.monotonic() + 150
    stuck_exits = 0
    while Effect.objects.filter(job_id__in=healthy).count() < len(healthy) or depth(
        dead_queue(queue)
    ) < len(slow):
        if time.monotonic() > deadline:
            print(supervisor.logs()[-8000:])
            pytest.fail("the short jobs did not all run, or the long ones were not dead-lettered")
        if consumer.process.poll() is not None:  # stopped for a task it gave up on
            assert consumer.process.returncode == 3
            stuck_exits += 1
            consumer = restarted(supervisor, consumer, settings, "2")
        time.sleep(0.2)
    dead = drain(dead_queue(queue))
    errors = [properties.headers.get("x-skipqueue-error", "") for _, properties, _ in dead]
    handed_back = supervisor.logs().count("handed back")
    print(f"\nconsumer timeout: dead={len(dead)} handed back={handed_back} exits={stuck_exits}")
    assert sorted(int(properties.message_id) for _, properties, _ in dead) == sorted(slow)
    assert all("of the broker's consumer timeout" in error for error in errors), errors
    assert "closed by RabbitMQ's consumer timeout" not in supervisor.logs()
    assert DuplicateEffect.objects.filter(job_id__in=healthy).count() == 0


@pytest.mark.timeout(240)
def test_jobs_that_wait_for_a_thread_are_handed_back_not_started_late(
    supervisor, broker_queue_name, consumer_timeout_4s
):
    """T56 (the outside trial of T55): at `--concurrency 1` with a prefetch of 4, 1 s
    jobs of a single attempt waited for the thread; one started just before the
    give-up time was timed out a moment later ("the job ran 4s") and dead-lettered,
    though its task finished. Now a delivery still waiting at half the consumer timeout
    is handed back, never started late: every job runs once, none is dead-lettered."""
    queue = broker_queue_name
    settings = relay_settings(
        queue, DELIVERY_LIMIT=2, CONSUMER_TIMEOUT=consumer_timeout_4s, PREFETCH=4
    )
    jobs = tasks.probe.using(queue_name=queue, max_attempts=1).enqueue_many(
        [((), {"ms": 1000})] * 8
    )
    ids = [job.id for job in jobs]
    supervisor.start(settings=settings, command="relayjobs")
    consumer = supervisor.start("--broker", "--concurrency", "1", settings=settings)
    wait_for_effects(ids, timeout=120)
    time.sleep(1)
    print(f"\nwaiting jobs: handed back={consumer.output().count('handed back')}")
    assert depth(dead_queue(queue)) == 0
    assert DuplicateEffect.objects.filter(job_id__in=ids).count() == 0
    assert "closed by RabbitMQ's consumer timeout" not in supervisor.logs()


@pytest.mark.timeout(240)
def test_a_poison_that_kills_only_after_the_timeout_takes_no_innocent_with_it(
    supervisor, broker_queue_name, consumer_timeout_4s
):
    """T57 (the same trial): a task that kills its process 5 s in, past the 3.6 s at
    which its attempt is timed out: acked as a failed attempt, its retry was a fresh
    message, run beside others, and each of its kills counted a delivery against the
    innocent jobs then unacked (3 of 60 dead-lettered at DELIVERY_LIMIT 2). Now a
    consumer whose thread still runs a task it gave up on a second later stops (to be
    replaced), giving back what it did not start: the kill, 5 s in, finds the process
    gone or holding little, each held job counted once at most. Its next
    attempts run in processes of their own, killed at their give-up: no consumer stops
    for them."""
    queue = broker_queue_name
    settings = relay_settings(
        queue, DELIVERY_LIMIT=2, CONSUMER_TIMEOUT=consumer_timeout_4s, PREFETCH=10
    )
    probe = tasks.probe.using(queue_name=queue)
    poison = probe.using(max_attempts=3).enqueue(ms=5000, mode="late-exit")
    healthy = [job.id for job in probe.enqueue_many([((), {"ms": 300})] * 40)]
    supervisor.start(settings=settings, command="relayjobs")
    consumer = supervisor.start("--broker", "--concurrency", "2", settings=settings)
    deaths = 0
    deadline = time.monotonic() + 180
    while Effect.objects.filter(job_id__in=healthy).count() < len(healthy) or not depth(
        dead_queue(queue)
    ):
        if time.monotonic() > deadline:
            print(supervisor.logs()[-8000:])
            pytest.fail("the innocent jobs did not all run, or the poison never ended dead")
        if consumer.process.poll() is not None:
            deaths += 1
            consumer = restarted(supervisor, consumer, settings, "2")
        time.sleep(0.2)
    dead = drain(dead_queue(queue))
    print(f"\nlate poison: deaths={deaths} dead={len(dead)}")
    assert [int(properties.message_id) for _, properties, _ in dead] == [poison.id]
    # Its first attempt ran in a thread: given up on, it stopped that consumer (exit
    # code 3). The next ran in processes of their own, killed at their give-up.
    assert deaths == 1


@pytest.mark.timeout(180)
def test_one_sigkill_dead_letters_no_innocent_at_a_delivery_limit_of_2(
    supervisor, broker_queue_name
):
    """T58: one SIGKILL of a consumer, no poison, 300 short jobs, DELIVERY_LIMIT 2. Each
    redelivered job was counted once by the kill; it must not be counted again while it
    is run (in a process of its own) or handed back. Cancelling the consumers to run
    them alone had pika return what arrived during a cancel, counted: 6 of 300
    dead-lettered at once; with a take-in first, under load 1 run in 20 to 40 still
    cascaded into an innocent dead-lettered and 268 of 300 left unrun."""
    queue = broker_queue_name
    settings = relay_settings(queue, DELIVERY_LIMIT=2)
    ids = [
        job.id for job in tasks.probe.using(queue_name=queue).enqueue_many([((), {"ms": 50})] * 300)
    ]
    supervisor.start(settings=settings, command="relayjobs")
    consumer = supervisor.start("--broker", "--concurrency", "4", settings=settings)
    wait_until(lambda: Effect.objects.filter(job_id__in=ids).count() >= 30, timeout=60)
    consumer.signal(signal.SIGKILL)
    consumer.wait(timeout=10)
    supervisor.start("--broker", "--concurrency", "4", settings=settings)
    wait_for_effects(ids, timeout=120)
    print(f"\none sigkill: dead={depth(dead_queue(queue))}")
    assert depth(dead_queue(queue)) == 0


def run_with_replacements(supervisor, settings, concurrency, done, *, timeout=150):
    """Consumers replaced as they exit until `done()`; their exit codes."""
    consumer = supervisor.start("--broker", "--concurrency", concurrency, settings=settings)
    exits: list[int] = []
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            print(supervisor.logs()[-8000:])
            pytest.fail("the scenario did not end")
        if consumer.process.poll() is not None:
            exits.append(consumer.process.returncode)
            consumer = restarted(supervisor, consumer, settings, concurrency)
        time.sleep(0.2)
    return exits


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["exit", "late-exit"])
def test_a_poison_among_a_full_prefetch_takes_no_innocent_with_it(
    supervisor, broker_queue_name, consumer_timeout_4s, mode
):
    """T60 (the outside trial of T55-T59): `--concurrency 4`, PREFETCH 50, DELIVERY_LIMIT
    2, 100 short jobs and a poison that kills its process at once, or 5 s in (past its
    give-up at 3.6 s). Before: the channel-wide prefetch meant to run redelivered jobs
    alone is ignored on quorum queues, fresh jobs ran beside them, and the poison's
    retry after a given-up attempt came as a fresh message: 44 of 110 innocent jobs
    dead-lettered. Now the consumers are cancelled (after taking in what was sent, so
    that nothing returned is counted) while redelivered jobs, or a given-up attempt's
    retry, run alone."""
    queue = broker_queue_name
    settings = relay_settings(
        queue, DELIVERY_LIMIT=2, CONSUMER_TIMEOUT=consumer_timeout_4s, PREFETCH=50
    )
    probe = tasks.probe.using(queue_name=queue)
    healthy = [job.id for job in probe.enqueue_many([((), {"ms": 300})] * 20)]
    poison = probe.using(max_attempts=3).enqueue(ms=5000 if mode == "late-exit" else 0, mode=mode)
    healthy += [job.id for job in probe.enqueue_many([((), {"ms": 300})] * 80)]
    supervisor.start(settings=settings, command="relayjobs")
    exits = run_with_replacements(
        supervisor,
        settings,
        "4",
        lambda: (
            Effect.objects.filter(job_id__in=healthy).count() == len(healthy)
            and depth(dead_queue(queue)) > 0
        ),
    )
    dead = drain(dead_queue(queue))
    print(f"\nfull prefetch, poison {mode}: exits={exits} dead={len(dead)}")
    assert [int(properties.message_id) for _, properties, _ in dead] == [poison.id]
    assert len(exits) == 1  # its first attempt only: then a process of its own each time
    assert "closed by RabbitMQ's consumer timeout" not in supervisor.logs()


@pytest.mark.timeout(120)
def test_a_sigterm_while_a_long_job_runs_ends_within_the_consumer_timeout(
    supervisor, broker_queue_name, consumer_timeout_4s
):
    """T61 (the same trial): SIGTERM 1 s after a consumer at `--concurrency 2`, PREFETCH
    4, took an 8 s job and 10 short ones. Before: the stop waited for the long job
    without serving the connection or the timeout's rules; RabbitMQ closed the channel
    (2 of 2 runs) and one stop hung in the connection's close. Now the stop gives back
    what it did not start and keeps serving: the long job is timed out at 3.6 s, its
    consumer exits with code 3 a second later, and no channel is closed."""
    queue = broker_queue_name
    settings = relay_settings(
        queue, DELIVERY_LIMIT=2, CONSUMER_TIMEOUT=consumer_timeout_4s, PREFETCH=4
    )
    probe = tasks.probe.using(queue_name=queue, max_attempts=1)
    probe.enqueue(ms=8000)
    healthy = [job.id for job in probe.enqueue_many([((), {"ms": 300})] * 10)]
    supervisor.start(settings=settings, command="relayjobs")
    consumer = supervisor.start("--broker", "--concurrency", "2", settings=settings)
    wait_until(lambda: Effect.objects.filter(job_id__in=healthy).exists(), timeout=30)
    time.sleep(0.5)
    began = time.monotonic()
    consumer.signal(signal.SIGTERM)
    code = consumer.wait(timeout=20)
    took = time.monotonic() - began
    supervisor.workers.remove(consumer)
    supervisor.retired.append(consumer)
    supervisor.start("--broker", "--concurrency", "2", settings=settings)
    wait_for_effects(healthy, timeout=60)
    print(f"\nsigterm during a long job: exit={code} stop took {took:.1f}s")
    assert code == 3
    assert took < 6
    assert "closed by RabbitMQ's consumer timeout" not in supervisor.logs()
    assert depth(dead_queue(queue)) == 1
