"""Prometheus metrics (issue 28): `runworker --metrics-port`, one endpoint for a
`--processes` pool, counters that match what the jobs did, and the queue gauges read
from the database. Real worker processes; the endpoint is scraped over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import urllib.request
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from prometheus_client.parser import text_string_to_metric_families

from django_skipqueue.models import Job, JobState, QueueMinute
from django_skipqueue.runtime.prometheus import QueueGauges, gauge_families
from tests.processes import wait_until
from tests.testapp import tasks

pytestmark = [pytest.mark.django_db(transaction=True)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def finished(samples, outcome: str, task: str) -> float:
    return value(
        samples, "skipqueue_jobs_finished_total", queue="default", task=task, outcome=outcome
    )


@pytest.mark.slow
def test_a_pool_serves_one_endpoint_whose_counters_match_what_the_jobs_did(start_worker):
    tasks.add.enqueue_many([((1, 2), {})] * 30)
    tasks.always_fails.enqueue_many([((), {})] * 2)  # 3 attempts each: 2 retried, 1 failed
    tasks.rejects_input.enqueue("x")  # not retryable: failed at once
    port = free_port()
    worker = start_worker(
        "--processes", "2", "--metrics-port", str(port), settings={"METRICS_SAMPLE_SECONDS": 0.2}
    )
    done = [JobState.DONE, JobState.FAILED]
    wait_until(lambda: Job.objects.filter(state__in=done).count() == 33, timeout=60)

    def counted() -> bool:
        try:
            samples = scrape(port)
        except OSError:
            return False
        return (
            finished(samples, "succeeded", tasks.add.name) == 30
            and finished(samples, "failed", tasks.always_fails.name) == 2
            and value(samples, "skipqueue_queue_workers", queue="default") == 2
        )

    wait_until(counted, timeout=20, message="the pool's endpoint never counted the jobs")
    samples = scrape(port)
    assert finished(samples, "retried", tasks.always_fails.name) == 4
    assert finished(samples, "failed", tasks.rejects_input.name) == 1
    assert (
        value(samples, "skipqueue_job_duration_seconds_count", queue="default", task=tasks.add.name)
        == 30
    )
    pickups = value(samples, "skipqueue_pickup_delay_seconds_count", queue="default")
    assert pickups == 30 + 2 * 3 + 1  # one per attempt started
    assert value(samples, "skipqueue_queue_workers", queue="default") == 2
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0
    # The same counts reached the overview's per-minute rows.
    rows = QueueMinute.objects.filter(queue_name="default")
    assert sum(row.succeeded for row in rows) == 30
    assert sum(row.failed for row in rows) == 3 and sum(row.retried for row in rows) == 4
    assert sum(row.pickups for row in rows) == pickups
    assert sum(sum(row.pickup_buckets) for row in rows) == pickups


def test_queue_gauges_are_read_from_the_database_not_per_scrape():
    tasks.add.enqueue_many([((1, 2), {})] * 3)
    tasks.add.using(run_after=timedelta(hours=1)).enqueue(1, 2)
    gauges = QueueGauges(interval=3600)
    gauges.refresh_if_stale()
    families = {family.name: family for family in gauge_families(gauges.sample)}
    jobs = {
        sample.labels["state"]: sample.value
        for sample in families["skipqueue_queue_jobs"].samples
        if sample.labels["queue"] == "default"
    }
    assert jobs == {
        "pending_due": 3,
        "scheduled": 1,
        "waiting": 0,
        "sleeping": 0,
        "awaiting_signal": 0,
        "running": 0,
        "stuck": 0,
    }
    tasks.add.enqueue(1, 2)
    gauges.refresh_if_stale()  # within its interval: the sample stays as it was
    families = {family.name: family for family in gauges.collect()}
    due = [
        s.value
        for s in families["skipqueue_queue_jobs"].samples
        if s.labels == {"queue": "default", "state": "pending_due"}
    ]
    assert due == [3]


def test_the_metrics_port_must_be_a_port():
    with pytest.raises(CommandError, match="not a TCP port"):
        call_command("runworker", "--metrics-port", "70000")


def test_the_web_view_needs_the_permission_or_an_allowed_network(client, admin_client, settings):
    tasks.add.enqueue(1, 2)
    assert client.get("/skipqueue/metrics").status_code == 403
    page = admin_client.get("/skipqueue/metrics")
    assert page.status_code == 200
    assert 'skipqueue_queue_jobs{queue="default",state="pending_due"} 1.0' in page.content.decode()
    settings.SKIPQUEUE = {"METRICS_ALLOWED_NETWORKS": ["127.0.0.0/8"]}
    assert client.get("/skipqueue/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200
    assert client.get("/skipqueue/metrics", REMOTE_ADDR="10.1.2.3").status_code == 403
    mapped = client.get("/skipqueue/metrics", REMOTE_ADDR="::ffff:127.0.0.1")  # bound to [::]
    assert mapped.status_code == 200


@pytest.mark.slow
def test_a_broker_consumer_counts_what_it_ran_on_its_endpoint_and_in_the_minute_rows(
    relayed, settings, start_worker
):
    from django_skipqueue.broker.relay import Relay
    from django_skipqueue.conf.relay import relay_config

    port = free_port()
    consumer = start_worker("--broker", "--metrics-port", str(port), settings=settings.SKIPQUEUE)
    consumer.wait_for_output("broker consumer connected")
    for _ in range(5):
        tasks.add.using(queue_name=relayed).enqueue(1, 2)
    tasks.rejects_input.using(queue_name=relayed).enqueue("x")
    assert Relay(relay_config(), listen=False).relay_due() == 6

    def counted() -> bool:
        try:
            samples = scrape(port)
        except OSError:
            return False
        labels = {"queue": relayed, "task": tasks.add.name, "outcome": "succeeded"}
        failed = {"queue": relayed, "task": tasks.rejects_input.name, "outcome": "failed"}
        return (
            value(samples, "skipqueue_jobs_finished_total", **labels) == 5
            and value(samples, "skipqueue_jobs_finished_total", **failed) == 1
        )

    wait_until(counted, timeout=30, message="the consumer's endpoint never counted the jobs")
    consumer.signal(signal.SIGTERM)
    assert consumer.wait(20) == 0
    rows = QueueMinute.objects.filter(queue_name=relayed)
    assert (sum(r.succeeded for r in rows), sum(r.failed for r in rows)) == (5, 1)


@pytest.mark.slow
def test_a_pool_refuses_a_metrics_port_in_use_at_once(start_worker):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = start_worker("--processes", "2", "--metrics-port", str(port))
        assert worker.wait(timeout=20) != 0
    assert "cannot listen on 127.0.0.1" in worker.output()


@pytest.mark.slow
def test_a_pools_endpoint_serves_until_its_children_have_drained(start_worker):
    tasks.record.enqueue_many([((), {"sleep": 2.0})] * 2)
    port = free_port()
    worker = start_worker("--processes", "2", "--metrics-port", str(port), "--grace", "20")
    wait_until(lambda: Job.objects.filter(state=JobState.RUNNING).count() == 2, timeout=30)
    wait_until(lambda: _answers(port), timeout=10)
    worker.signal(signal.SIGTERM)
    scraped_while_draining = 0
    while Job.objects.filter(state=JobState.RUNNING).exists():
        scraped_while_draining += _answers(port)
    assert scraped_while_draining > 0  # the endpoint outlived the first signal
    assert worker.wait(timeout=30) == 0
    samples = scrape_or_none(port)
    assert samples is None  # and it stopped with the pool


def _answers(port: int) -> int:
    return 1 if scrape_or_none(port) is not None else 0


def scrape_or_none(port: int):
    try:
        return scrape(port)
    except OSError:
        return None


def test_every_known_queue_has_every_gauge_even_at_zero():
    from django_skipqueue.models import WorkerProcess

    tasks.add.using(queue_name="reports").enqueue(1, 2)  # due, and nobody serves it
    WorkerProcess.objects.register(queues=["default"], concurrency=1)  # serves no job
    gauges = QueueGauges(interval=0)
    gauges.refresh_if_stale()
    families = {family.name: family for family in gauges.collect()}
    workers = {s.labels["queue"]: s.value for s in families["skipqueue_queue_workers"].samples}
    assert workers == {"default": 1, "reports": 0}  # `== 0` can fire for reports
    oldest = {
        s.labels["queue"]: s.value for s in families["skipqueue_queue_oldest_due_seconds"].samples
    }
    assert oldest["default"] == 0 and oldest["reports"] >= 0
    paused = {s.labels["queue"]: s.value for s in families["skipqueue_queue_paused"].samples}
    assert paused == {"default": 0, "reports": 0}


@pytest.mark.slow
def test_attempts_ended_by_a_time_limit_are_counted():
    import threading

    from django_skipqueue.runtime.worker import Worker

    job = tasks.loops_forever.enqueue()  # time_limit 0.5 s, 2 attempts
    worker = Worker(concurrency=1, listen=False, poll_interval=0.05, reap_interval=0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: Job.objects.get(id=job.id).state == JobState.FAILED, timeout=20)
    finally:
        worker.stop()
        thread.join(timeout=20)
    rows = QueueMinute.objects.filter(queue_name="default")
    assert (sum(r.retried for r in rows), sum(r.failed for r in rows)) == (1, 1)


@pytest.mark.parametrize("processes", ["1", "2"])
def test_every_series_a_worker_may_count_is_there_at_zero_before_its_first_job(
    start_worker, processes
):
    """Counters appeared at their first increment: no `outcome="failed"` series and no
    lease expirations until one happened, so the documented rate() alerts had no data.
    A worker (and each child of a pool) makes them at 0 as it starts; the build's series
    is there too, and a single process's `process_*` ones."""
    port = free_port()
    start_worker("--processes", processes, "--metrics-port", str(port))
    expected = [("skipqueue_lease_expirations_total", (("queue", "default"),))] + [
        (
            "skipqueue_jobs_finished_total",
            (("outcome", outcome), ("queue", "default"), ("task", tasks.always_fails.name)),
        )
        for outcome in ("succeeded", "retried", "failed", "lost")
    ]

    def primed() -> bool:
        # A pool's child writes its series one by one into its metrics file: a scrape
        # between two of them saw the first (the CI once failed there), so wait for all.
        try:
            samples = scrape(port)
        except OSError:
            return False
        return all(key in samples for key in expected)

    wait_until(primed, timeout=30, message="a series was missing before any job")
    samples = scrape(port)
    for key in expected:
        assert samples[key] == 0.0, key
    assert not any(
        labels and dict(labels).get("outcome") in ("retrying", "refused") for _, labels in samples
    )
    [build] = [labels for name, labels in samples if name == "skipqueue_build_info"]
    assert dict(build)["version"]
    has_process = any(name.startswith("process_") for name, _ in samples)
    assert has_process == (processes == "1")


@pytest.mark.timeout(120)
def test_a_pools_metrics_files_stay_one_set_per_slot_and_a_killed_pools_are_removed(
    start_worker,
):
    """`--max-jobs` replaces children again and again: each left its own files, so the
    directory grew with every child (200 files, a scrape 6 -> 26 ms) and stayed in the
    temporary directory after a SIGKILL of the parent. Files are now the slot's, reused
    by the child that replaces another, with the counts carried on; the next pool
    removes the directory of one that died."""
    import glob
    import tempfile

    tasks.add.enqueue_many([((n, n), {}) for n in range(60)])
    port = free_port()
    pool = start_worker(
        "--processes", "2", "--concurrency", "1", "--max-jobs", "5", "--metrics-port", str(port)
    )
    wait_until(lambda: Job.objects.filter(state=JobState.DONE).count() == 60, timeout=60)
    wait_until(
        lambda: finished(scrape(port), "succeeded", tasks.add.name) == 60,
        timeout=20,
        message="the replaced children's counts were not carried on",
    )
    assert pool.output().count("replacing it") >= 8
    [directory] = glob.glob(f"{tempfile.gettempdir()}/skipqueue-metrics-{pool.pid}-*")
    files = os.listdir(directory)
    assert len(files) <= 2 * 2, files  # counters and histograms of two slots
    pool.signal(signal.SIGKILL)
    pool.wait(timeout=10)
    assert os.path.isdir(directory)  # a SIGKILL cleans nothing up
    again = start_worker("--processes", "2", "--metrics-port", str(free_port()))
    again.wait_for_output("worker pool started", timeout=20)
    assert not os.path.exists(directory)
