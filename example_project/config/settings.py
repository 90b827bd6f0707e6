"""Example project settings: DATABASE_URL when set, else an embedded PostgreSQL.

The embedded server lives in example_project/.pgdata (ignored by git), is started on
demand and kept between runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import environ

from django_skipqueue.embedded import database_from_url

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env(DEBUG=(bool, False))

#: The embedded server's folder when DATABASE_URL is unset (the demo says where it runs).
EMBEDDED_POSTGRES_DIR = None
if "DATABASE_URL" not in os.environ:
    from django_skipqueue.embedded import embedded_database_url

    EMBEDDED_POSTGRES_DIR = BASE_DIR / ".pgdata"
    os.environ["DATABASE_URL"] = embedded_database_url(EMBEDDED_POSTGRES_DIR, database="example")

database = database_from_url(os.environ["DATABASE_URL"])
DATABASES = {"default": database}

SECRET_KEY = env("SECRET_KEY", default="example-project-not-secret")
DEBUG = env("DEBUG")
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "config.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_skipqueue",
    "shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
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
STATIC_URL = "static/"
EMAIL_BACKEND = env("EMAIL_BACKEND", default="django.core.mail.backends.locmem.EmailBackend")
DEFAULT_FROM_EMAIL = "hello@example.com"

SKIPQUEUE = {
    "LEASE_SECONDS": 5,
    "MAX_ATTEMPTS": 3,
    "RETRY_BASE_SECONDS": 0.05,
    "RETRY_CAP_SECONDS": 0.5,
}

try:  # Django >= 6.0: django.tasks, with our backend unless TASKS_BACKEND says otherwise
    import django.tasks  # noqa: F401
except ImportError:
    pass
else:
    TASKS = {
        "default": {
            "BACKEND": env("TASKS_BACKEND", default="django_skipqueue.backends.SkipQueueBackend"),
            "QUEUES": ["default", "webhooks", "reports"],
        }
    }
    SKIPQUEUE["TASK_MODULES"] = ["shop.django_tasks"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_skipqueue": {"handlers": ["console"], "level": "WARNING"}},
}
