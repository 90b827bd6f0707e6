from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.db import connection

from django_skipqueue.models import WorkerProcess
from tests.processes import WorkerHandle


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
