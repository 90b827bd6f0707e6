"""Fault 3, T14, T16: workers through PgBouncer in transaction-pooling mode.

Debian's pgbouncer (1.18: no prepared-statement tracking, the strict case) is started by
the test on a free loopback port, in front of the test database, with 4 server
connections for 4 worker processes x 4 threads.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from django.db import connection

from django_skipqueue.models import Job
from tests.chaos.harness import check
from tests.processes import wait_until
from tests.testapp import tasks

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(PGBOUNCER).exists(), reason="apt-get install pgbouncer"),
]
POOL_SIZE = 4


@pytest.fixture
def pgbouncer(request):
    """PgBouncer in front of the test database: its URL and port. Extra lines of its
    [pgbouncer] section come as the fixture's indirect parameter."""
    extra = getattr(request, "param", "")
    settings = connection.settings_dict
    tmp_path = Path(tempfile.mkdtemp(prefix="skipqueue-pgbouncer-"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    host = settings["HOST"] or "127.0.0.1"
    server_port = settings["PORT"] or 5432
    tmp_path.chmod(0o777)
    config = tmp_path / "pgbouncer.ini"
    config.write_text(
        f"[databases]\n"
        f"queue = host={host} port={server_port} dbname={settings['NAME']} "
        f"user={settings['USER'] or 'postgres'} pool_size={POOL_SIZE}\n"
        f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n"
        f"unix_socket_dir =\nauth_type = any\npool_mode = transaction\n"
        f"default_pool_size = {POOL_SIZE}\nmax_client_conn = 200\n"
        f"admin_users = {settings['USER'] or 'postgres'}\n"
        f"logfile = {tmp_path}/pgbouncer.log\npidfile = {tmp_path}/pgbouncer.pid\n{extra}"
    )
    config.chmod(0o644)
    # As root, pgbouncer must switch user: to the socket's owner (embedded server), or nobody.
    owner = os.stat(host).st_uid if host.startswith("/") else pwd.getpwnam("nobody").pw_uid
    user = pwd.getpwuid(owner).pw_name
    args = [PGBOUNCER, str(config)] + (["-u", user] if os.geteuid() == 0 else [])
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def listening() -> bool:
        with socket.socket() as client:
            return client.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_until(listening, timeout=15, interval=0.05)
        user_name = settings["USER"] or "postgres"
        yield f"postgresql://{user_name}:@127.0.0.1:{port}/queue", port
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.timeout(240)
def test_fault3_sixteen_threads_through_four_server_connections(supervisor, pgbouncer):
    url, port = pgbouncer
    ids = [j.id for j in tasks.probe.enqueue_many([((), {"ms": 5})] * 2000)]
    pooled = [_start_pooled(supervisor, url) for _ in range(4)]  # 16 threads

    peak = 0
    deadline = time.monotonic() + 180
    while Job.objects.filter(id__in=ids, state="done").count() < 2000:
        assert time.monotonic() < deadline, "jobs did not finish through PgBouncer"
        peak = max(peak, server_connections(port))
        time.sleep(0.1)

    report = check(ids, supervisor.deadlocks_at_start)
    # T16: each worker finds that LISTEN receives nothing through the pooler, after its
    # self-test's 2 s wait; the jobs may all be done before that (they are polled for).
    wait_until(
        lambda: all("LISTEN does not receive" in handle.output() for handle in pooled),
        timeout=15,
    )
    logs = "".join(handle.output() for handle in pooled)
    print(f"\nfault3 server_connections_peak={peak} {report}")
    assert report.violations() == []
    assert peak <= POOL_SIZE
    assert not re.search(r"prepared statement .* (does not|already) exist", logs)
    assert not re.search(r"cursor .* does not exist", logs)
    assert "LISTEN does not receive notifications" in logs  # T16: detected, then polling
    assert "Traceback" not in logs


def server_connections(port: int) -> int:
    """PgBouncer's own count of its server connections to the queue database.

    Asked on its admin console (simple query protocol only, hence libpq's exec_).
    """
    import psycopg

    user = connection.settings_dict["USER"] or "postgres"
    with psycopg.connect(
        f"host=127.0.0.1 port={port} dbname=pgbouncer user={user}", autocommit=True
    ) as admin:
        result = admin.pgconn.exec_(b"SHOW POOLS")
        columns = [result.fname(i).decode() for i in range(result.nfields)]
        total = 0
        for row in range(result.ntuples):
            values = dict(
                zip(columns, (result.get_value(row, i) for i in range(result.nfields)), strict=True)
            )
            if values["database"] == b"queue":
                total += sum(
                    int(values[name] or 0)
                    for name in ("sv_active", "sv_idle", "sv_used", "sv_tested", "sv_login")
                )
        return total


def _start_pooled(supervisor, url: str):
    from tests.processes import WorkerHandle

    index = len(supervisor.workers) + len(supervisor.retired) + len(supervisor.others)
    handle = WorkerHandle(
        ["-v", "1", "--concurrency", "4", "--poll-interval", "0.2", "--reap-interval", "1"],
        supervisor.log_dir / f"pooled-{index}.log",
        DATABASE_URL=url,
    )
    supervisor.others.append(handle)
    return handle


ENQUEUE_THROUGH_POOLER = """
import json
from django.db import transaction
from django_skipqueue.db import direct
from tests.processes import run_in_threads
from tests.testapp import tasks
ids, errors = [], []

def enqueue_many_times():
    try:
        for n in range(60):
            ids.append(tasks.add.enqueue(n, n).id)  # autocommit: named from its second run
            if n % 20 == 0:
                with transaction.atomic():  # in a transaction: unnamed
                    ids.append(tasks.add.enqueue(n, 0).id)
    except Exception as exc:
        errors.append(repr(exc))

# Rounds until the pooler has been found (at most five): on a loaded machine the six
# threads may take turns on one server session, where nothing goes missing.
for rounds in range(1, 6):
    run_in_threads(enqueue_many_times, 6)
    if "default" in direct._UNNAMED_ONLY:
        break
print(json.dumps({"ids": ids, "errors": errors, "rounds": rounds}))
"""


@pytest.mark.timeout(120)
def test_enqueues_through_a_transaction_pooler_that_loses_named_statements(pgbouncer):
    """PgBouncer 1.18 in transaction mode, the database entry without
    DISABLE_SERVER_SIDE_CURSORS: six threads share four server sessions, so a statement
    prepared on one session is run on another (or prepared again on one that holds it).
    Every enqueue succeeds; at the first statement gone missing, the process finds
    another server session than its connection's (PgBouncer reports a pid of its own),
    logs it once and sends unnamed statements."""
    import json

    from tests.processes import start_python

    url, _ = pgbouncer
    child = start_python(ENQUEUE_THROUGH_POOLER, DATABASE_URL=url)
    out, err = child.communicate(timeout=90)
    assert child.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["errors"] == []
    enqueued = 6 * 63 * report["rounds"]
    assert len(report["ids"]) == enqueued == len(set(report["ids"]))
    assert Job.objects.filter(id__in=report["ids"], state="pending").count() == enqueued
    assert err.count("another server session") == 1, err  # the pooler, found once
    print(f"\nthe pooler found in round {report['rounds']} of at most 5")


CLAIM_THROUGH_A_RESETTING_POOLER = """
import json
from django_skipqueue.models import Job, WorkerProcess
from tests.testapp import tasks
worker = WorkerProcess.objects.create(hostname="pooled", pid=1, queues=["default"])
enqueued = [tasks.add.enqueue(n, n).id for n in range(10)]  # the named INSERT, dropped
done = []
for n in range(35):
    for job in Job.objects.claim(queues=["default"], limit=2, worker=worker):
        done += Job.objects.ack_many([(job.pk, job.attempts, n)])
print(json.dumps({"done": done, "enqueued": enqueued}))
"""


@pytest.mark.parametrize("pgbouncer", ["server_reset_query_always = 1\n"], indirect=True)
@pytest.mark.timeout(120)
def test_claims_through_a_pooler_that_drops_statements_after_each_transaction(pgbouncer):
    """PgBouncer in transaction mode with `server_reset_query_always`: its DISCARD ALL
    after every transaction drops each statement right after its PREPARE, on the same
    server session (so the pid tells nothing). Every enqueue, claim and ack succeeds;
    after three such losses in a row of the enqueue's named INSERT (claims and acks are
    never named), the connection names no more statements, with one warning (before,
    each run paid a PREPARE and a failed run, for good: an outside trial)."""
    import json

    from tests.processes import start_python

    url, _ = pgbouncer
    ids = [job.id for job in tasks.add.enqueue_many([((n, n), {}) for n in range(60)])]
    child = start_python(CLAIM_THROUGH_A_RESETTING_POOLER, DATABASE_URL=url)
    out, err = child.communicate(timeout=90)
    assert child.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    ids += report["enqueued"]
    assert sorted(report["done"]) == sorted(ids)
    assert err.count("dropped 3 times in a row") == 1, err
    assert "Traceback" not in err
    assert Job.objects.filter(id__in=ids, state="done").count() == 70
