from __future__ import annotations

import pytest
from django.db import connection

from django_skipqueue.models import WorkerProcess


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
