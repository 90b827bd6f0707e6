"""Settings for benchmarks/run.py: a clean database (no test triggers), DATABASE_URL or embedded."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from django_skipqueue.embedded import database_from_url

if "DATABASE_URL" not in os.environ:
    from django_skipqueue.embedded import embedded_database_url

    data_dir = Path(tempfile.gettempdir()) / f"skipqueue-bench-pg-{os.getuid()}"
    os.environ["DATABASE_URL"] = embedded_database_url(data_dir, database="skipqueue_bench")

database = database_from_url(os.environ["DATABASE_URL"])
DATABASES = {"default": database}
SECRET_KEY = "benchmarks-only"  # noqa: S105
USE_TZ = True
DEBUG = False
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django_skipqueue", "benchmarks.benchapp"]
SKIPQUEUE = {
    "LEASE_SECONDS": 30,
    "REAP_INTERVAL_SECONDS": 5,
    # The fairness part (issue 56): a fair queue.
    "FAIR_QUEUES": ["fair"],
    # The relay part (issue 18): one queue through RabbitMQ.
    "RELAY": {
        "QUEUES": [os.environ.get("SKIPQUEUE_BENCH_RELAY_QUEUE", "relayed")],
        "URL": os.environ.get("SKIPQUEUE_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"),
    },
}
LOGGING = {"version": 1, "disable_existing_loggers": False}
