"""Prometheus metrics (the `[metrics]` extra, `prometheus_client`): the series a worker
serves on `runworker --metrics-port`, and the queue gauges the web view serves too.

Imported only when metrics are asked for: a worker without `--metrics-port` never
imports prometheus_client, and its claim and ack paths do not change.

The series (docs/howto/monitoring.md lists them with their labels):

- Counted by the workers, as jobs run: `skipqueue_jobs_finished_total{queue,task,outcome}`,
  `skipqueue_job_duration_seconds{queue,task}` and `skipqueue_pickup_delay_seconds{queue}`
  (histograms), `skipqueue_lease_expirations_total{queue}`.
- Read from the database every SKIPQUEUE["METRICS_SAMPLE_SECONDS"] (15) by a thread of
  the process that serves them (never per scrape, so a scrape costs the same at any table size):
  `skipqueue_queue_jobs{queue,state}`, `skipqueue_queue_oldest_due_seconds{queue}`,
  `skipqueue_queue_workers{queue}`, `skipqueue_queue_paused{queue}`,
  `skipqueue_queue_limit_saturation{queue}` (running jobs over QUEUE_LIMITS'
  concurrency) and `skipqueue_relay_backlog_jobs{queue}` (a relayed queue's jobs the
  relay has yet to publish).

With `--processes N`, the parent points prometheus_client's multiprocess mode at a
directory of its own before it forks: each child writes its counters there, and one
more child, the metrics server, adds them up on each scrape. One port for the pool.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import django
from django.db import DatabaseError, connections
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, values
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from django_skipqueue import signals
from django_skipqueue.conf import get_settings
from django_skipqueue.conf.limits import queue_limits
from django_skipqueue.conf.relay import relayed_queues
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.models import PICKUP_BUCKETS, Job, Queue, WorkerProcess, queue_names_of
from django_skipqueue.queue.base import GAUGE_NAMES
from django_skipqueue.queue.connections import discard_connection
from django_skipqueue.runtime.runner import Outcome

logger = logging.getLogger(__name__)

#: The environment variable prometheus_client's multiprocess mode reads.
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
    float("inf"),
)  # fmt: skip
#: The `outcome` label's values: the names the logs, the counts and `run_jobs` use too.
OUTCOMES = tuple(outcome.value for outcome in Outcome)
#: The `state` label of skipqueue_queue_jobs, and the gauge each comes from.
JOB_STATES = tuple(name for name in GAUGE_NAMES if name != "oldest_due_seconds")


class PrometheusSeries:
    """The series a worker counts (see the module doc), in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.finished_total = Counter(
            "skipqueue_jobs_finished",
            "Attempts ended, by outcome: succeeded, retried, released (Retry), failed, "
            "cancelled, lost (the fence refused the outcome: the attempt had lost the "
            "job), unknown.",
            ["queue", "task", "outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "skipqueue_job_duration_seconds",
            "How long attempts ran.",
            ["queue", "task"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.pickup = Histogram(
            "skipqueue_pickup_delay_seconds",
            "From a job's due time to the start of its attempt (database clock).",
            ["queue"],
            buckets=PICKUP_BUCKETS,
            registry=registry,
        )
        self.lease_expirations = Counter(
            "skipqueue_lease_expirations",
            "Expired leases the reaper took back.",
            ["queue"],
            registry=registry,
        )
        self.steps = Counter(
            "skipqueue_steps",
            "Durable steps: recorded (run, and its record written) or replayed (a later "
            "attempt got the recorded result), by kind: plain, atomic, sleep, signal (a wait).",
            ["task", "kind", "how"],
            registry=registry,
        )
        # Sent from the task's thread (tasks/durable.py); a counter's inc is thread-safe.
        signals.step_recorded.connect(self._step_recorded, weak=False)
        signals.step_replayed.connect(self._step_replayed, weak=False)

    def _step_recorded(self, sender: Any, task: str, kind: str, **_: Any) -> None:
        self.steps.labels(task, kind, "recorded").inc()

    def _step_replayed(self, sender: Any, task: str, kind: str, **_: Any) -> None:
        self.steps.labels(task, kind, "replayed").inc()

    def prime(self, queues: Sequence[str], tasks: Mapping[str, str]) -> None:
        """Each label set this worker may count, at 0: a series that appears only at its
        first event leaves `rate(...)` alerts without data until then (the documented
        failed-jobs and expired-leases alerts had none). `tasks`: name -> its queue."""
        for queue in queues:
            self.lease_expirations.labels(queue)
            self.pickup.labels(queue)
        for task, queue in tasks.items():
            if queue not in queues:
                continue
            self.duration.labels(queue, task)
            for outcome in OUTCOMES:
                self.finished_total.labels(queue, task, outcome)

    def finished(self, queue: str, task: str, outcome: str, duration: float) -> None:
        self.finished_total.labels(queue, task, outcome).inc()
        self.duration.labels(queue, task).observe(duration)

    def picked_up(self, queue: str, seconds: float) -> None:
        self.pickup.labels(queue).observe(seconds)

    def lease_expired(self, queue: str, count: int) -> None:
        self.lease_expirations.labels(queue).inc(count)


@dataclass
class QueueSample:
    """The queue gauges as last read (`read_queue_sample`)."""

    gauges: dict[str, dict[str, float]] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)
    saturation: dict[str, float] = field(default_factory=dict)
    relayed: set[str] = field(default_factory=set)


def read_queue_sample(database: str) -> QueueSample:
    """Read the queue gauges: four short queries, each served by a partial index or a
    small table (never the finished jobs)."""
    sample = QueueSample(gauges=Job.objects.db_manager(database).queue_gauges())
    for queues in WorkerProcess.objects.using(database).alive().values_list("queues", flat=True):
        for name in set(queue_names_of(queues)):
            sample.workers[name] = sample.workers.get(name, 0) + 1
    sample.paused = set(Queue.objects.using(database).paused().values_list("name", flat=True))
    try:
        limits = queue_limits()
        sample.relayed = set(relayed_queues())
    except ConfigurationError:  # reported by the system checks
        limits = {}
    for name, limit in limits.items():
        if limit.concurrency:
            running = sample.gauges.get(name, {}).get("running", 0)
            sample.saturation[name] = running / limit.concurrency
    return sample


def gauge_families(sample: QueueSample) -> Iterator[Metric]:
    """The gauges of a sample, as Prometheus metric families. Every queue the sample
    knows (jobs, live processes, a pause, a limit, a relay) has every per-queue series,
    0 where nothing is counted: a queue whose workers all died reads 0 workers, not no
    series (an alert on `== 0` must be able to fire)."""
    names = sorted(
        set(sample.gauges) | set(sample.workers) | sample.paused | set(sample.saturation)
        | sample.relayed
    )  # fmt: skip
    jobs = GaugeMetricFamily(
        "skipqueue_queue_jobs",
        "Unfinished jobs per queue: pending_due (due, waiting for a worker), scheduled "
        "(due later), waiting (on a workflow parent), sleeping and awaiting_signal (a "
        "durable job parked until its time or its signal), running, stuck (lease expired).",
        labels=["queue", "state"],
    )
    oldest = GaugeMetricFamily(
        "skipqueue_queue_oldest_due_seconds",
        "Age of the oldest due job not yet started (0: none).",
        labels=["queue"],
    )
    backlog = GaugeMetricFamily(
        "skipqueue_relay_backlog_jobs",
        "A relayed queue's due jobs the relay has not yet published to RabbitMQ.",
        labels=["queue"],
    )
    workers = GaugeMetricFamily(
        "skipqueue_queue_workers",
        "Live processes serving each queue: workers, broker consumers and relays.",
        labels=["queue"],
    )
    paused = GaugeMetricFamily(
        "skipqueue_queue_paused", "1 while an operator has paused the queue.", labels=["queue"]
    )
    saturation = GaugeMetricFamily(
        "skipqueue_queue_limit_saturation",
        "Running jobs over the queue's concurrency limit (SKIPQUEUE['QUEUE_LIMITS']).",
        labels=["queue"],
    )
    for name in names:
        numbers = sample.gauges.get(name, {})
        for state in JOB_STATES:
            jobs.add_metric([name, state], numbers.get(state, 0))
        oldest.add_metric([name], numbers.get("oldest_due_seconds", 0.0))
        workers.add_metric([name], sample.workers.get(name, 0))
        paused.add_metric([name], 1 if name in sample.paused else 0)
        if name in sample.relayed:
            backlog.add_metric([name], numbers.get("pending_due", 0))
        if name in sample.saturation:
            saturation.add_metric([name], sample.saturation[name])
    yield from (jobs, oldest, backlog, workers, paused, saturation)


class QueueGauges(Collector):
    """A collector of the queue gauges, read from the database at most every
    `interval` seconds: by a thread of its own once `start()`ed (a worker), or on the
    first scrape past the interval (the web view)."""

    def __init__(self, database: str | None = None, interval: float | None = None) -> None:
        conf = get_settings()
        self.database = database or conf.DATABASE_ALIAS
        self.interval = conf.METRICS_SAMPLE_SECONDS if interval is None else interval
        self.sample = QueueSample()
        self.sampled_at = -float("inf")
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def refresh(self) -> None:
        try:
            sample = read_queue_sample(self.database)
        except DatabaseError as error:
            logger.warning("metrics: queue gauges not read: %s", error)
            discard_connection(self.database)
            return
        with self._lock:
            self.sample, self.sampled_at = sample, time.monotonic()

    def refresh_if_stale(self) -> None:
        if time.monotonic() - self.sampled_at >= self.interval:
            self.refresh()

    def start(self) -> None:
        threading.Thread(target=self._run, name="skipqueue-metrics-sampler", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self.refresh()
                self._stopped.wait(self.interval)
        finally:
            connections.close_all()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sample = self.sample
        yield from gauge_families(sample)


_series: PrometheusSeries | None = None


def worker_series() -> PrometheusSeries:
    """This process's series (made once: a registry refuses a second of each name). In
    multiprocess mode their values go to the shared directory whatever the registry."""
    global _series
    if _series is None:
        _series = PrometheusSeries(_worker_registry)
    return _series


_worker_registry = CollectorRegistry()


def serve_worker(port: int, address: str, database: str) -> Any:
    """One worker process: its series, the queue gauges, the build's and the process's
    (prometheus_client's `process_*`) on http://address:port/metrics. Returns the server
    (its `shutdown()` stops it)."""
    gauges = QueueGauges(database)
    gauges.start()
    registry = CollectorRegistry()
    registry.register(_Forward(_worker_registry))
    registry.register(gauges)
    registry.register(BuildInfo())
    ProcessCollector(registry=registry)
    server, _thread = start_http_server(port, addr=address, registry=registry)
    return server


class BuildInfo(Collector):
    """`skipqueue_build_info{version,python,django} 1`: what a process runs. Yielded by
    a collector of its own, not an Info metric: prometheus_client's multiprocess mode
    has no Info, and the build is the same in every child of a pool."""

    def collect(self) -> Iterator[Metric]:
        try:
            version = importlib.metadata.version("django-skipqueue")
        except importlib.metadata.PackageNotFoundError:  # run from a tree, not installed
            version = "unknown"
        info = InfoMetricFamily("skipqueue_build", "The running django-skipqueue build.")
        info.add_metric(
            [],
            {
                "version": version,
                "python": platform.python_version(),
                "django": django.get_version(),
            },
        )
        yield info


class _Forward(Collector):
    """Another registry's metrics, collected on each scrape."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from self.source.collect()


def prepare_multiprocess(directory: str) -> None:
    """In the parent of `--processes`, before it forks: every series made from now on,
    in any child, writes to `directory` (emptied first)."""
    for name in os.listdir(directory):
        if name.endswith(".db"):
            os.remove(os.path.join(directory, name))
    os.environ[MULTIPROCESS_ENV] = directory
    values.ValueClass = values.get_value_class()


#: The prefix of a pool's metrics directory under the system's temporary directory,
#: followed by the pool's pid (`pool_directory`).
POOL_DIRECTORY_PREFIX = "skipqueue-metrics-"


def pool_directory() -> str:
    """A new metrics directory for this pool, named after its pid. First, those of pools
    that died without cleaning up (a SIGKILL) are removed: each pool's files stayed in
    the temporary directory for good."""
    import re
    import shutil
    import tempfile

    root = tempfile.gettempdir()
    for name in os.listdir(root):
        found = re.fullmatch(rf"{POOL_DIRECTORY_PREFIX}(\d+)-\w+", name)
        if found and not _alive(int(found[1])):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{POOL_DIRECTORY_PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to clean
        return True
    return True


def count_as_slot(slot: int) -> None:
    """In a pool's child: its series' files are named after its slot, not its pid
    (prometheus_client's `process_identifier`). A child that replaces another reopens
    the same files and counts on from their values, so the directory holds one set of
    files per slot however many children were replaced (it grew by one set per child:
    200 files and a scrape 6 -> 26 ms after 2,000 jobs at --max-jobs 20)."""
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: f"slot{slot}")


def serve_pool(port: int, address: str, database: str, directory: str) -> int:
    """The metrics server child of `--processes`: the children's series added up from
    `directory`, and the queue gauges, until it is signalled to stop."""
    gauges = QueueGauges(database)
    gauges.start()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    registry.register(gauges)
    registry.register(BuildInfo())
    server, _thread = start_http_server(port, addr=address, registry=registry)
    logger.info("metrics served on http://%s:%d/metrics for the pool", address, port)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()
