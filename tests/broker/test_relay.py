"""Relayed queues: the job table as a transactional outbox for RabbitMQ (issue 18).

Against the real broker on this machine (tests/rabbitmq.py says what happens when it is
down). The relay runs in this process; the consumer runs as a real `runworker --broker`.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from django.core.management import CommandError, call_command
from django.db import transaction
from django.urls import reverse

from django_skipqueue.broker import (
    ATTEMPT_HEADER,
    ERROR_HEADER,
    RelayConfig,
    broker_queue,
    dead_queue,
    relay_config,
    retry_exponent,
    retry_queue,
)
from django_skipqueue.broker.relay import Relay
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.models import Job, JobState, WorkerProcess
from django_skipqueue.runtime.worker import Worker
from tests.processes import wait_until
from tests.rabbitmq import AMQP_URL, depth, drain, relay_settings
from tests.testapp.models import Run
from tests.testapp.tasks import always_fails, record

pytestmark = [pytest.mark.django_db(transaction=True)]


def relay_everything() -> int:
    """Publish every due job of the relayed queues, here and now; how many."""
    return Relay(relay_config(), listen=False).relay_due()


def test_committed_jobs_are_published_persistent_with_the_job_id_and_their_rows_deleted(
    relayed,
):
    jobs = [record.using(queue_name=relayed).enqueue() for _ in range(5)]
    plain = record.enqueue()  # the default queue is not relayed
    relay = Relay(relay_config(), listen=False)
    try:
        assert relay.relay_once() == 5
        assert relay.relay_once() == 0
    finally:
        relay.close()
    messages = drain(broker_queue(relayed))
    assert sorted(int(properties.message_id) for _, properties, _ in messages) == sorted(
        job.id for job in jobs
    )
    for _, properties, body in messages:
        assert properties.delivery_mode == 2
        assert properties.headers[ATTEMPT_HEADER] == 1
        data = json.loads(body)
        assert data["task"] == record.name
        assert data["queue"] == relayed
        assert data["id"] == int(properties.message_id)
    assert not Job.objects.filter(queue_name=relayed).exists()
    assert Job.objects.get(id=plain.id).state == JobState.PENDING


def test_a_job_enqueued_in_a_rolled_back_transaction_is_never_published(relayed):
    """T47."""
    with pytest.raises(RuntimeError), transaction.atomic():
        record.using(queue_name=relayed).enqueue()
        raise RuntimeError("the business write failed")
    kept = record.using(queue_name=relayed).enqueue()
    relay_everything()
    assert [int(p.message_id) for _, p, _ in drain(broker_queue(relayed))] == [kept.id]


def test_an_uncommitted_job_is_not_published_until_its_transaction_commits(relayed):
    """The relay only sees committed rows: a job inserted in an open transaction waits."""
    enqueued = threading.Event()
    commit = threading.Event()

    def business_transaction() -> None:
        from django.db import connection

        try:
            with transaction.atomic():
                record.using(queue_name=relayed).enqueue()
                enqueued.set()
                commit.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=business_transaction)
    thread.start()
    relay = Relay(relay_config(), listen=False)
    try:
        assert enqueued.wait(10)
        assert relay.relay_once() == 0
        commit.set()
        thread.join(10)
        assert relay.relay_once() == 1
    finally:
        commit.set()
        relay.close()


def test_results_keep_the_rows_relayed_until_the_consumer_writes_the_outcome_back(
    relayed, settings, start_worker
):
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, **relay_settings(relayed, RESULTS=True)}
    jobs = [record.using(queue_name=relayed).enqueue() for _ in range(3)]
    failing = always_fails.using(queue_name=relayed, max_attempts=1).enqueue("no luck")
    assert relay_everything() == 4
    assert set(Job.objects.filter(queue_name=relayed).values_list("state", flat=True)) == {
        JobState.RELAYED
    }
    consumer = start_worker("--broker", "--concurrency", "2", settings=settings.SKIPQUEUE)
    wait_until(
        lambda: not Job.objects.filter(queue_name=relayed, state=JobState.RELAYED).exists(),
        timeout=30,
        message="outcomes were not written back",
    )
    for job in jobs:
        job.refresh_from_db()
        assert job.state == JobState.DONE
        assert job.result == {
            "job_id": job.id,
            "attempt": 1,
            "key": f"skipqueue-job-{job.id}",
        }
        assert job.finished_at is not None
    failing.refresh_from_db()
    assert failing.state == JobState.FAILED
    assert "no luck" in failing.last_error
    consumer.signal(signal.SIGTERM)
    assert consumer.wait(20) == 0
    [(_, properties, _)] = drain(dead_queue(relayed))
    assert int(properties.message_id) == failing.id
    assert "no luck" in properties.headers[ERROR_HEADER]


def test_with_results_a_message_at_the_delivery_limit_ends_its_row_failed(
    relayed, settings, start_worker
):
    """An outside trial: a message the consumer dead-letters at DELIVERY_LIMIT (a copy
    whose count says its consumers died holding it) left its row `relayed` for ever.
    Now the row ends failed with DeliveryLimitError, as any dead-lettered job's does."""
    import pika

    from django_skipqueue.broker import DELIVERIES_HEADER, Message

    settings.SKIPQUEUE = {**settings.SKIPQUEUE, **relay_settings(relayed, RESULTS=True)}
    job = record.using(queue_name=relayed).enqueue()
    assert relay_everything() == 1
    [(_, properties, body)] = drain(broker_queue(relayed))
    message = Message.decode(body, properties.headers)
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        connection.channel().basic_publish(
            "",
            broker_queue(relayed),
            message.body(),
            message.properties(**{DELIVERIES_HEADER: 5}),
        )
    finally:
        connection.close()
    consumer = start_worker("--broker", settings=settings.SKIPQUEUE)
    wait_until(
        lambda: Job.objects.filter(id=job.id, state=JobState.FAILED).exists(),
        timeout=30,
        message="the row stayed relayed",
    )
    consumer.signal(signal.SIGTERM)
    assert consumer.wait(20) == 0
    job.refresh_from_db()
    assert "DeliveryLimitError: delivered 5 times" in job.last_error
    assert not Run.objects.filter(job_id=job.id).exists()
    [(_, properties, _)] = drain(dead_queue(relayed))
    assert int(properties.message_id) == job.id


def test_the_consumer_runs_the_tasks_with_context_and_stops_on_sigterm(
    relayed, settings, start_worker
):
    consumer = start_worker("--broker", "--concurrency", "4", settings=settings.SKIPQUEUE)
    consumer.wait_for_output("broker consumer connected")
    jobs = [record.using(queue_name=relayed).enqueue() for _ in range(20)]
    assert relay_everything() == 20
    wait_until(lambda: Run.objects.count() >= 20, timeout=30, message="jobs did not run")
    runs = list(Run.objects.values_list("job_id", "attempt", "pid"))
    assert sorted(job_id for job_id, _, _ in runs) == sorted(job.id for job in jobs)
    assert {attempt for _, attempt, _ in runs} == {1}
    assert {pid for _, _, pid in runs} == {consumer.pid}
    consumer.signal(signal.SIGTERM)
    assert consumer.wait(20) == 0
    assert "20 succeeded" in consumer.output()
    assert depth(broker_queue(relayed)) == 0


def test_a_stopping_consumer_gives_back_what_it_did_not_start_without_counting_it(
    relayed, settings, start_worker
):
    """T59: at `--concurrency 1` and a prefetch of 5, SIGTERM while the first of 5 jobs runs:
    it finishes; the 4 the consumer held unstarted are back in the queue as they were,
    not counted as deliveries. Before, the connection's close returned them, and the
    quorum queue counted one delivery against each at every restart: a few deploys, and
    innocent jobs met DELIVERY_LIMIT."""
    from tests.testapp.tasks import probe

    settings.SKIPQUEUE["RELAY"]["PREFETCH"] = 5
    jobs = probe.using(queue_name=relayed).enqueue_many([((), {"ms": 1500})] * 5)
    relay_everything()
    consumer = start_worker("--broker", "--concurrency", "1", settings=settings.SKIPQUEUE)
    wait_until(lambda: Run.objects.exists(), timeout=30, message="no job started")
    consumer.signal(signal.SIGTERM)
    assert consumer.wait(20) == 0
    assert "1 succeeded" in consumer.output()
    left = drain(broker_queue(relayed))
    assert sorted(int(p.message_id) for _, p, _ in left) == sorted(j.id for j in jobs[1:])
    assert [
        (p.headers or {}).get(key, 0)
        for _, p, _ in left
        for key in ("x-delivery-count", "x-skipqueue-deliveries")
    ] == [0] * 8
    assert all(not method.redelivered for method, _, _ in left)


def test_retries_go_through_the_broker_then_the_dead_letter_queue_and_can_be_redriven(
    relayed, settings, start_worker
):
    """T52."""
    job = always_fails.using(queue_name=relayed).enqueue("every time")  # 3 attempts
    relay_everything()
    consumer = start_worker("--broker", settings=settings.SKIPQUEUE)
    # Attempt 1 fails, waits 1 s in the retry queue, attempt 2, 1 s, attempt 3: dead.
    wait_until(lambda: depth(dead_queue(relayed)) == 1, timeout=30, message="not dead-lettered")
    consumer.signal(signal.SIGTERM)
    assert consumer.wait(20) == 0
    assert "1 dead-lettered" in consumer.output()
    assert "2 retried" in consumer.output()
    assert consumer.output().count(f"job raised id={job.id}") == 3
    call_command("relayjobs", "--redrive", relayed)
    [(_, properties, _)] = drain(broker_queue(relayed))
    assert int(properties.message_id) == job.id
    assert properties.headers[ATTEMPT_HEADER] == 1  # a fresh attempt budget


def test_the_relay_wakes_on_notify_and_keeps_going_after_the_broker_drops_it(relayed):
    relay = Relay(relay_config(), listen=True)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        wait_until(lambda: relay._publishing is not None, timeout=10)
        time.sleep(0.3)  # LISTEN is set up
        started = time.monotonic()
        record.using(queue_name=relayed).enqueue()
        wait_until(lambda: depth(broker_queue(relayed)) == 1, timeout=5)
        assert time.monotonic() - started < 2  # not the 5-s poll
        # The broker closes the relay's connection (as a restart would): it reconnects.
        relay._connection.add_callback_threadsafe(lambda: relay._connection.close())
        time.sleep(0.5)
        record.using(queue_name=relayed).enqueue()
        wait_until(lambda: depth(broker_queue(relayed)) == 2, timeout=20)
    finally:
        relay.stop.set()
        relay.wake.set()
        thread.join(20)
    assert not thread.is_alive()


def test_a_plain_worker_refuses_a_relayed_queue(relayed):
    with pytest.raises(ConfigurationError, match=rf"queue {relayed} is relayed to RabbitMQ"):
        Worker(queues=[relayed])


def test_runworker_broker_refuses_a_queue_that_is_not_relayed(relayed):
    with pytest.raises(CommandError, match="not relayed: default"):
        call_command("runworker", "--broker", "-q", "default")


@pytest.mark.parametrize(
    ("relay", "message"),
    [
        ({"QUEUES": []}, "non-empty list of queue names"),
        ({"QUEUES": [""], "URL": AMQP_URL}, "queue name '' is invalid"),
        ({"QUEUES": ["x"], "URL": "http://broker"}, "amqp:// or amqps:// URL"),
        ({"QUEUES": ["x"], "URL": AMQP_URL, "BATCH_SIZE": 0}, "BATCH_SIZE'] must be a positive"),
        ({"QUEUES": ["x"], "URL": AMQP_URL, "RESULTS": "yes"}, "RESULTS'] must be True or False"),
        ({"QUEUES": ["x"], "URL": AMQP_URL, "QUEUE": ["y"]}, "unknown keys QUEUE"),
        (
            {"QUEUES": ["x"], "URL": AMQP_URL, "CONSUMER_TIMEOUT": "30m"},
            "CONSUMER_TIMEOUT'] must be a positive number of seconds, got '30m'",
        ),
    ],
)
def test_bad_relay_settings_are_named(settings, relay, message):
    settings.SKIPQUEUE = {"RELAY": relay}
    with pytest.raises(ConfigurationError, match=message):
        relay_config()
    from django_skipqueue.checks import check_relay

    [error] = check_relay()
    assert error.id == "skipqueue.E012"
    assert message.split("'")[0] in error.hint


def test_retry_delays_round_up_to_a_power_of_two_seconds():
    from datetime import timedelta

    assert [retry_exponent(timedelta(seconds=s)) for s in (0.01, 1, 1.5, 2, 3, 60)] == [
        0,
        0,
        1,
        1,
        2,
        6,
    ]
    assert retry_exponent(timedelta(days=30)) == 16
    assert retry_queue("webhooks", 6) == "skipqueue.webhooks.retry.64"


def test_relay_config_defaults(settings):
    settings.SKIPQUEUE = relay_settings("webhooks")
    assert relay_config() == RelayConfig(queues=("webhooks",), url=AMQP_URL)
    settings.SKIPQUEUE = {}
    assert not relay_config().enabled


def test_queuestats_shows_the_relay_backlog_and_the_broker_depths(relayed, settings):
    from io import StringIO

    record.using(queue_name=relayed).enqueue_many([((), {})] * 3)
    relay_everything()
    record.using(queue_name=relayed).enqueue_many([((), {})] * 2)  # not published yet
    out = StringIO()
    call_command("queuestats", "--json", stdout=out)
    [row] = [row for row in json.loads(out.getvalue())["queues"] if row["queue"] == relayed]
    assert (row["relayed"], row["pending_due"], row["broker_ready"], row["broker_dead"]) == (
        True,
        2,
        3,
        0,
    )
    settings.SKIPQUEUE = {
        **settings.SKIPQUEUE,
        **relay_settings(relayed, URL="amqp://guest:guest@127.0.0.1:1/%2F"),
    }
    out = StringIO()
    call_command("queuestats", stdout=out)
    [line] = [line for line in out.getvalue().splitlines() if line.startswith(relayed)]
    assert line.split()[-2:] == ["?", "?"]  # the broker did not answer


def test_the_overview_flags_a_relayed_queue_whose_due_rows_no_live_relay_publishes(
    relayed, admin_client
):
    record.using(queue_name=relayed).enqueue()
    consumer = WorkerProcess.objects.register(queues=[relayed], concurrency=4, kind="consumer")
    page = admin_client.get(reverse("admin:skipqueue_overview")).content.decode()
    assert "relayed to RabbitMQ" in page
    assert "0 in the broker, 0 dead" in page
    assert "no live worker" not in page
    assert "1: no live relay" in page  # a consumer runs, but nobody publishes the rows
    WorkerProcess.objects.register(queues=[relayed], concurrency=1, kind="relay")
    page = admin_client.get(reverse("admin:skipqueue_overview")).content.decode()
    assert "no live relay" not in page
    consumer.delete()


def test_a_retry_request_goes_back_through_the_broker_without_spending_an_attempt(
    relayed, settings, start_worker
):
    from tests.testapp.tasks import retry_once

    job = retry_once.using(queue_name=relayed, max_attempts=1).enqueue()
    relay_everything()
    consumer = start_worker("--broker", settings=settings.SKIPQUEUE)
    wait_until(
        lambda: "job succeeded id=" in consumer.output(), timeout=30, message="never retried"
    )
    consumer.signal(signal.SIGTERM)
    assert consumer.wait(20) == 0
    assert "1 succeeded, 1 retried, 0 dead-lettered" in consumer.output()
    assert list(Run.objects.filter(job_id=job.id).values_list("attempt", flat=True)) == [1]
    assert f"job succeeded id={job.id} task={retry_once.name} attempt=2" in consumer.output()


def test_relayjobs_once_publishes_and_says_how_many(relayed):
    from io import StringIO

    record.using(queue_name=relayed).enqueue_many([((), {})] * 3)
    out = StringIO()
    call_command("relayjobs", "--once", stdout=out)
    assert out.getvalue().strip() == "3 jobs published"
    assert depth(broker_queue(relayed)) == 3


def test_relayjobs_without_a_relayed_queue_says_what_to_set(settings):
    settings.SKIPQUEUE = {}
    with pytest.raises(CommandError, match=r"no relayed queue: set SKIPQUEUE\['RELAY'\]"):
        call_command("relayjobs", "--once")


def test_redrive_refuses_a_queue_that_is_not_relayed(relayed):
    with pytest.raises(CommandError, match="queue 'default' is not relayed"):
        call_command("relayjobs", "--redrive", "default")


def test_runworker_relay_publishes_from_a_thread_beside_the_worker(relayed, settings, start_worker):
    worker = start_worker("--relay", settings=settings.SKIPQUEUE)
    consumer = start_worker("--broker", settings=settings.SKIPQUEUE)
    worker.wait_for_output("relay connected to the broker")
    relayed_job = record.using(queue_name=relayed).enqueue()
    plain_job = record.enqueue()  # the worker's own queue, claimed from the table
    wait_until(lambda: Run.objects.count() == 2, timeout=30, message="a job did not run")
    runs = dict(Run.objects.values_list("job_id", "pid"))
    assert runs == {relayed_job.id: consumer.pid, plain_job.id: worker.pid}
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert "relay stopped published=1" in worker.output()


def test_a_job_past_its_timeout_is_given_up_on_and_its_late_success_dropped(
    relayed, settings, start_worker
):
    from tests.testapp.tasks import outlives_its_timeout  # timeout 0.3 s, 1 attempt, 0.9 s

    job = outlives_its_timeout.using(queue_name=relayed).enqueue()
    relay_everything()
    consumer = start_worker("--broker", settings=settings.SKIPQUEUE)
    wait_until(lambda: depth(dead_queue(relayed)) == 1, timeout=30, message="not given up on")
    time.sleep(1.0)  # the task returns meanwhile: its success must not count
    consumer.signal(signal.SIGTERM)
    assert consumer.wait(20) == 0
    assert f"job timed out id={job.id}" in consumer.output()
    assert "0 succeeded, 0 retried, 1 dead-lettered" in consumer.output()
    [(_, properties, _)] = drain(dead_queue(relayed))
    assert "TimeoutError: the task ran past its timeout of 0.3s" in properties.headers[ERROR_HEADER]


def test_a_row_python_cannot_load_fails_in_the_table_and_does_not_stop_the_relay(relayed):
    """Another client wrote a number Python's json refuses (over 4,300 digits)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,"
            " lease, attempts, max_attempts, expirations, releases, last_error, errors,"
            " created_at) VALUES ('tests.testapp.tasks.add', '[1e4400]', '{}', %s, 0,"
            " 'pending', now(), '30 s', 0, 5, 0, 0, '', '[]', now()) RETURNING id",
            [relayed],
        )
        bad_id = cursor.fetchone()[0]
    good = record.using(queue_name=relayed).enqueue()
    assert relay_everything() == 2
    bad = Job.objects.get(id=bad_id)
    assert bad.state == JobState.FAILED
    assert "cannot be relayed" in bad.last_error
    assert "4300" in bad.last_error
    assert [int(p.message_id) for _, p, _ in drain(broker_queue(relayed))] == [good.id]


def test_run_jobs_runs_relayed_jobs_in_the_test_process_without_a_broker(settings):
    from django_skipqueue.testing import run_jobs

    settings.SKIPQUEUE = {"RELAY": {"QUEUES": ["events"], "URL": "amqp://nobody@127.0.0.1:1/"}}
    job = record.using(queue_name="events").enqueue()
    [execution] = run_jobs()
    assert execution.job_id == job.id
    job.refresh_from_db()
    assert job.state == JobState.DONE


@pytest.mark.django_db
@pytest.mark.parametrize("option", ["unique_key", "concurrency_key"])
def test_a_unique_or_concurrency_key_on_a_relayed_queue_is_refused_at_enqueue(settings, option):
    from django_skipqueue.exceptions import InvalidJobError
    from tests.testapp.tasks import add

    settings.SKIPQUEUE = {**settings.SKIPQUEUE, **relay_settings("relayed-keys")}
    keyed = add.using(queue_name="relayed-keys", **{option: "k"})
    with transaction.atomic():
        with pytest.raises(InvalidJobError, match="relayed to RabbitMQ"):
            keyed.enqueue(1, 2)
        add.using(queue_name="relayed-keys").enqueue(1, 2)  # the transaction goes on
    assert Job.objects.filter(queue_name="relayed-keys").count() == 1


def test_a_brokered_message_whose_args_are_an_object_is_dead_lettered_not_run(
    relayed, settings, start_worker
):
    """T54."""
    import pika

    good = record.using(queue_name=relayed).enqueue()
    assert relay_everything() == 1  # declares the queues too
    body = {
        "id": good.id + 1000,
        "task": record.name,
        "queue": relayed,
        "args": {"sleep": 0},  # another publisher's mistake: its keys must not be arguments
        "kwargs": {},
        "max_attempts": 3,
        "lease_seconds": 30,
    }
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        connection.channel().basic_publish("", broker_queue(relayed), json.dumps(body).encode())
    finally:
        connection.close()
    consumer = start_worker("--broker", settings=settings.SKIPQUEUE)
    wait_until(lambda: depth(dead_queue(relayed)) == 1, timeout=30, message="not dead-lettered")
    wait_until(lambda: Run.objects.filter(job_id=good.id).exists(), timeout=30)
    consumer.signal(signal.SIGTERM)
    assert consumer.wait(20) == 0
    assert not Run.objects.filter(job_id=body["id"]).exists()
    [(_, properties, _)] = drain(dead_queue(relayed))
    assert "'args' is a JSON object, not an array" in properties.headers[ERROR_HEADER]
