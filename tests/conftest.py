from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_skipqueue.models import WorkerProcess
from tests.processes import WorkerHandle
from tests.rabbitmq import broker_or_skip, delete_broker_queues, fresh_queue_name, relay_settings


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Where the tests' database runs, and, for the embedded one, how to stop it."""
    from tests import settings as test_settings

    if test_settings.EMBEDDED_POSTGRES_DIR is None:
        database = connection.settings_dict
        return [f"database: DATABASE_URL, {database['HOST'] or 'localhost'}/{database['NAME']}"]
    from django_skipqueue.embedded import describe

    return [
        "database: an embedded PostgreSQL, kept running between runs",
        *describe(test_settings.EMBEDDED_POSTGRES_DIR).splitlines(),
    ]


_DATABASE_FIXTURES = {"db", "transactional_db", "django_db_reset_sequences", "live_server"}


@pytest.fixture(autouse=True)
def _state_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that uses the database: no change of a job that the protocol
    never makes (tests/testapp migration 0005; django_skipqueue.core.states.TRANSITIONS)."""
    uses_database = request.node.get_closest_marker("django_db") is not None or bool(
        _DATABASE_FIXTURES & set(request.fixturenames)
    )
    if not uses_database:
        yield
        return
    request.getfixturevalue("_django_db_helper")  # so that this is torn down before it
    yield
    from tests import guard

    if connection.closed_in_transaction:  # the test's transaction is gone, and its writes
        return
    found = guard.violations()
    if found:
        guard.clear()
        pytest.fail("state guard: " + "\n".join(found), pytrace=False)


@pytest.fixture
def worker_process(db: None) -> WorkerProcess:
    return WorkerProcess.objects.create(hostname="test", pid=1, queues=["default"])


def set_lease(job_id: int, seconds: float) -> None:
    """Move a job's lease end to now + `seconds` on the database clock (negative: expired)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE skipqueue_job SET leased_until = now() + %s * interval '1 second' "
            "WHERE id = %s",
            [seconds, job_id],
        )


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerHandle]]:
    """Start real runworker processes; every one is killed at teardown.

    start_worker("--concurrency", "2", settings={"HEARTBEAT_SECONDS": 0.2})
    """
    handles: list[WorkerHandle] = []

    def start(*args: str, settings: dict | None = None) -> WorkerHandle:
        log = tmp_path / f"worker-{len(handles)}.log"
        env = {"SKIPQUEUE_TEST_SETTINGS": json.dumps(settings or {})}
        handle = WorkerHandle(["-v", "2", *args], log, **env)
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop()


@contextmanager
def refusing(transition: str) -> Iterator[None]:
    """A trigger on the job table that refuses one `transition` of the jobs whose kwargs
    hold the key "poison", with a CHECK violation: what a project's own trigger or a
    constraint added by another service does. Transitions: "claim", "ack", "reap", "prune"."""
    condition = {
        "claim": "OLD.state = 'pending' AND NEW.state = 'running'",
        "ack": "OLD.state = 'running' AND NEW.state = 'done'",
        "reap": "OLD.state = 'running' AND NEW.expirations > OLD.expirations",
        "prune": "TRUE",
    }[transition]
    row, when = ("OLD", "DELETE") if transition == "prune" else ("NEW", "UPDATE")
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            CREATE FUNCTION skipqueue_test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF {row}.kwargs ? 'poison' AND {condition} THEN
                    RAISE EXCEPTION 'job % is poison to this {transition}', {row}.id
                        USING ERRCODE = 'check_violation';
                END IF;
                RETURN {row};
            END $$;
            CREATE TRIGGER skipqueue_test_refuse BEFORE {when} ON skipqueue_job
                FOR EACH ROW EXECUTE FUNCTION skipqueue_test_refuse();
            """
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER skipqueue_test_refuse ON skipqueue_job; "
                "DROP FUNCTION skipqueue_test_refuse()"
            )


@pytest.fixture
def empty_database_url() -> Iterator[str]:
    """A URL for a new, empty database on the test server (a project before `migrate`),
    dropped afterwards. Needs a test marked django_db(transaction=True)."""
    import uuid

    from tests.processes import database_url

    name = f"skipqueue_empty_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f'CREATE DATABASE "{name}"')
    current = connection.settings_dict["NAME"]
    yield database_url().replace(f"/{current}", f"/{name}")
    with connection.cursor() as cursor:
        cursor.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture
def relayed(settings: Any) -> Iterator[str]:
    """A relayed queue of its own on the real RabbitMQ (tests/rabbitmq.py); its broker
    queues are deleted after the test."""
    broker_or_skip()
    name = fresh_queue_name()
    settings.SKIPQUEUE = {**settings.SKIPQUEUE, **relay_settings(name)}
    yield name
    delete_broker_queues(name)
