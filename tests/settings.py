"""Settings for the test suite: a real PostgreSQL, from DATABASE_URL or embedded."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import django

from django_skipqueue.embedded import database_from_url

#: The embedded server's folder when DATABASE_URL is unset (conftest reports it).
EMBEDDED_POSTGRES_DIR: Path | None = None
if "DATABASE_URL" not in os.environ:
    from django_skipqueue.embedded import embedded_database_url, test_data_dir

    # Kept between runs, so the suite starts in about a second. One server per checkout
    # (and, inside it, per set of binaries), one database per Django version, so two
    # checkouts or two virtualenvs on one machine never share a server or a schema.
    EMBEDDED_POSTGRES_DIR = test_data_dir(Path(__file__).resolve().parent)
    os.environ["DATABASE_URL"] = embedded_database_url(
        EMBEDDED_POSTGRES_DIR, database=f"skipqueue_dj{django.VERSION[0]}{django.VERSION[1]}"
    )

database = database_from_url(os.environ["DATABASE_URL"])
if os.environ.get("SKIPQUEUE_TEST_PG_OPTIONS"):  # server settings for one child's sessions
    database.setdefault("OPTIONS", {})["options"] = os.environ["SKIPQUEUE_TEST_PG_OPTIONS"]
if os.environ.get("SKIPQUEUE_TEST_SERVER_SIDE_BINDING"):  # Django's psycopg option
    database.setdefault("OPTIONS", {})["server_side_binding"] = True
DATABASES = {"default": database}

SECRET_KEY = "tests-only-not-secret"  # noqa: S105
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.urls"
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_skipqueue",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

SKIPQUEUE = {
    "LEASE_SECONDS": 30,
    "RETRY_BASE_SECONDS": 0.05,
    "RETRY_CAP_SECONDS": 1.0,
    # Fair share (tests/queue/test_fair_share.py): the tenants' queue.
    "FAIR_QUEUES": ["tenants"],
    # Tests hand worker subprocesses their own values (a short heartbeat, say).
    **json.loads(os.environ.get("SKIPQUEUE_TEST_SETTINGS", "{}")),
}

# django.tasks, or the django-tasks backport: the backend tests
# (tests/integration/test_backends.py).
try:
    from django_skipqueue.core.tasks_api import API as TASKS_API
except ImportError:
    pass
else:
    if TASKS_API == "django_tasks":  # the backport's checks (and so our backend's) need it
        INSTALLED_APPS.append("django_tasks")
    TASKS = {
        "default": {
            "BACKEND": "django_skipqueue.backends.SkipQueueBackend",
            "QUEUES": ["default", "other"],
        }
    }
    if importlib.util.find_spec("modelsearch") is not None:  # tests/integration/test_modelsearch.py
        # modelsearch on PostgreSQL stores SearchVectorFields: contrib.postgres (postgres.E005)
        INSTALLED_APPS += ["django.contrib.postgres", "modelsearch", "tests.searchapp"]
    SKIPQUEUE["TASK_MODULES"] = [
        *SKIPQUEUE.get("TASK_MODULES", []),
        "tests.testapp.django_tasks",
        "tests.testapp.backport_tasks",  # tests/integration/test_backport_conformance.py
    ]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_skipqueue": {"handlers": ["console"], "level": "WARNING"}},
}

if os.environ.get("SKIPQUEUE_TEST_CLOCK_SKEW_SECONDS"):  # fault 6: this process's clock is off
    import datetime as _datetime
    import time as _time

    from django.utils import timezone as _timezone

    _skew = float(os.environ["SKIPQUEUE_TEST_CLOCK_SKEW_SECONDS"])
    _real_time, _real_now = _time.time, _timezone.now
    _time.time = lambda: _real_time() + _skew
    _timezone.now = lambda: _real_now() + _datetime.timedelta(seconds=_skew)

# A worker subprocess of tests/runtime/test_tracing.py exports its spans, one JSON a line, to
# this file (the OpenTelemetry SDK, as an application configures it at start-up).
if os.environ.get("SKIPQUEUE_TEST_SPANS_FILE"):
    from opentelemetry import trace as _trace
    from opentelemetry.sdk.trace import TracerProvider as _TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter as _Console
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor as _Simple

    _provider = _TracerProvider()
    _spans_file = open(os.environ["SKIPQUEUE_TEST_SPANS_FILE"], "a", buffering=1)  # noqa: SIM115
    _provider.add_span_processor(
        _Simple(_Console(out=_spans_file, formatter=lambda span: span.to_json(indent=None) + "\n"))
    )
    _trace.set_tracer_provider(_provider)
