"""System checks for the SKIPQUEUE setting and the queue database.

Ids are never reused: E001 unknown key, E002 bad value, E003 SKIPQUEUE not a dict,
E004 unknown database alias, E005 database cannot SKIP LOCKED, E006 SkipQueueBackend
in TASKS with neither django.tasks nor the django-tasks backport, E007 a task asks for
more attempts than MAX_ATTEMPTS_LIMIT, E008 SkipQueueBackend without django_skipqueue in
INSTALLED_APPS (from the backend's own check(): without the app, these checks are not
registered), E009 a TASK_MODULES entry that cannot be imported. Warnings about the connection
(docs/explanation/failure-model.md S15), for a DATABASES entry that marks itself as
behind a transaction pooler with DISABLE_SERVER_SIDE_CURSORS = True, as Django's docs
ask: W001 prepared statements (psycopg's prepare_threshold) and W002 LISTEN through it;
W003 (deploy) DEBUG on.
"""

from __future__ import annotations

import difflib
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register  # noqa: A004
from django.db import connections
from django.utils import timezone

from django_skipqueue.conf import (
    KNOWN_KEYS,
    get_settings,
    task_backends_of_ours,
    tasks_api_installed,
)
from django_skipqueue.conf.limits import fair_queue_problems, queue_limits
from django_skipqueue.conf.relay import relay_config
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.maintenance.scheduler import default_zone, read_schedules
from django_skipqueue.tasks.registry import registry


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    raw = getattr(settings, "SKIPQUEUE", {})
    if not isinstance(raw, dict):
        return [
            Error(
                f"SKIPQUEUE must be a dict, not {type(raw).__name__}.",
                hint="Set SKIPQUEUE = {'LEASE_SECONDS': 300, ...} or leave it out.",
                id="skipqueue.E003",
            )
        ]
    errors = []
    for key in sorted(set(raw) - KNOWN_KEYS):
        nearest = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1)
        hint = f"Did you mean {nearest[0]!r}?" if nearest else "See the settings reference."
        errors.append(
            Error(f"SKIPQUEUE has an unknown key {key!r}.", hint=hint, id="skipqueue.E001")
        )
    for key, problem in get_settings().problems():
        errors.append(
            Error(
                f"SKIPQUEUE[{key!r}] {problem}"[:79],
                hint=f"Fix or remove SKIPQUEUE[{key!r}]; see the settings reference.",
                id="skipqueue.E002",
            )
        )
    return errors


@register()
def check_database(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[Error]:
    """The queue's database alias exists, is PostgreSQL and commits in autocommit (E013:
    with AUTOCOMMIT = False every claim and outcome would wait in a transaction nobody
    commits; the worker would report successes while every job stayed pending;
    tests/integration/test_checks.py). Not tagged `database`: the
    vendor is known from settings without connecting, so plain `check` (and every
    command) catches SQLite before `migrate` does."""
    alias = get_settings().DATABASE_ALIAS
    if not isinstance(alias, str) or alias not in connections.databases:
        return [
            Error(
                f"SKIPQUEUE['DATABASE_ALIAS'] {alias!r} is not in DATABASES.",
                hint=f"Use one of {sorted(connections.databases)}.",
                id="skipqueue.E004",
            )
        ]
    connection = connections[alias]
    if (
        connection.vendor != "postgresql"
        or not connection.features.has_select_for_update_skip_locked
    ):
        return [
            Error(
                f"Database {alias!r} ({connection.vendor}) cannot SELECT ... SKIP LOCKED.",
                hint="django-skipqueue needs PostgreSQL: point SKIPQUEUE['DATABASE_ALIAS'] "
                "at a PostgreSQL entry of DATABASES (the job table lives there).",
                id="skipqueue.E005",
            )
        ]
    if not connection.settings_dict.get("AUTOCOMMIT", True):  # Django reads it as a bool
        return [
            Error(
                f"Database {alias!r} has AUTOCOMMIT off: a worker's claims and "
                f"outcomes would never commit.",
                hint=f"Remove AUTOCOMMIT from DATABASES[{alias!r}] (Django's default, True, "
                "with atomic() for your own transactions), or give django-skipqueue its "
                "own entry through SKIPQUEUE['DATABASE_ALIAS'].",
                id="skipqueue.E013",
            )
        ]
    return []


@register()
def check_task_modules(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    return [
        Error(
            f"SKIPQUEUE['TASK_MODULES'] names {module!r}, which cannot be imported."[:79],
            hint=f"{error}. Fix the dotted path, or remove it from TASK_MODULES.",
            id="skipqueue.E009",
        )
        for module, error in sorted(registry.import_errors.items())
    ]


@register()
def check_schedules(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """skipqueue.E010: every periodic schedule can run (workers would refuse to start).
    skipqueue.W004: a six-field expression that fires every second of some minutes (the
    seconds field is last, and `*/10 * * * * *` is a common slip)."""
    if get_settings().problems():
        return []  # E002 says what is wrong with the settings first
    found, problems = read_schedules()
    messages: list[CheckMessage] = [
        Error("A periodic schedule cannot run.", hint=f"{problem}.", id="skipqueue.E010")
        for problem in problems
    ]
    zone = default_zone()
    now = timezone.now()
    for name, cron in sorted(found.items()):
        if cron.fires_in_bursts:
            messages.append(
                Warning(
                    f"Schedule {name!r} ({cron.expression}) runs every second of the "
                    f"minutes it matches, then not until the next such minute: "
                    f"{cron.describe_upcoming(now, cron.zone(zone), count=4)}.",
                    hint="Seconds are the last of six fields: every ten seconds is "
                    "'* * * * * */10'. If bursts are meant, set the seconds field to a "
                    "list or a range to keep this check quiet.",
                    id="skipqueue.W004",
                )
            )
    return messages


@register()
def check_queue_limits(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """skipqueue.E011: every SKIPQUEUE['QUEUE_LIMITS'] entry can be read."""
    if get_settings().problems():
        return []  # E002 says what is wrong with the settings first
    try:
        queue_limits()
    except ConfigurationError as error:
        return [Error("A queue limit cannot be read.", hint=f"{error}.", id="skipqueue.E011")]
    return []


@register()
def check_fair_queues(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """skipqueue.E014: every fair queue can be claimed by fair share, and every task with
    a fair key or weight is on a fair queue."""
    conf = get_settings()
    if conf.problems():
        return []  # E002 says what is wrong with the settings first
    problems = fair_queue_problems()
    for name in registry.names():
        declared = registry.get(name)
        fair_key = getattr(declared, "fair_key", None)
        weight = getattr(declared, "fair_weight", 1)
        queue = getattr(declared, "queue_name", None)
        if (fair_key is not None or weight != 1) and queue not in conf.FAIR_QUEUES:
            problems.append(
                f"task {name} has a fair key or weight, but its queue {queue!r} is not in "
                f"SKIPQUEUE['FAIR_QUEUES']"
            )
    return [
        Error("A fair queue cannot be claimed by share.", hint=f"{problem}.", id="skipqueue.E014")
        for problem in problems
    ]


@register()
def check_relay(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """skipqueue.E012: SKIPQUEUE['RELAY'] can be read, and the AMQP client is installed."""
    if get_settings().problems():
        return []  # E002 says what is wrong with the settings first
    try:
        if relay_config().enabled:
            # Imported here: a project without relayed queues (and each of its web
            # processes, which run no checks) does not import the broker layer.
            from django_skipqueue.broker.topology import pika_module

            pika_module()
    except ConfigurationError as error:
        return [Error("The relay to RabbitMQ cannot run.", hint=f"{error}.", id="skipqueue.E012")]
    return []


@register()
def check_tasks_backend(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    uses_ours = bool(task_backends_of_ours())
    if not tasks_api_installed():
        if uses_ours:
            return [
                Error(
                    "SkipQueueBackend needs django.tasks or the django-tasks backport.",
                    hint="On Django 5.2: pip install 'django-skipqueue[django-tasks]' and "
                    "add 'django_tasks' to INSTALLED_APPS.",
                    id="skipqueue.E006",
                )
            ]
    return []


@register()
def check_task_limits(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    conf = get_settings()
    if conf.problems():
        return []  # E002 says what is wrong with the settings first
    errors = []
    for name in registry.names():
        wanted = registry.get(name).max_attempts
        if wanted is not None and wanted > conf.MAX_ATTEMPTS_LIMIT:
            errors.append(
                Error(
                    f"Task {name!r} asks for max_attempts={wanted}, over MAX_ATTEMPTS_LIMIT."[:79],
                    hint=f"Lower it, or raise SKIPQUEUE['MAX_ATTEMPTS_LIMIT'] "
                    f"({conf.MAX_ATTEMPTS_LIMIT}).",
                    id="skipqueue.E007",
                )
            )
    return errors


@register(Tags.database)
def check_pooled_connection(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    conf = get_settings()
    alias = conf.DATABASE_ALIAS
    entry = settings.DATABASES.get(alias) if isinstance(alias, str) else None
    if not entry or not entry.get("DISABLE_SERVER_SIDE_CURSORS"):
        return []
    warnings = []
    options = entry.get("OPTIONS")
    if not isinstance(options, dict):
        options = {}
    if options.get("prepare_threshold") is not None:
        warnings.append(
            Warning(
                f"Database {alias!r} is behind a transaction pooler with prepared statements.",
                hint="DISABLE_SERVER_SIDE_CURSORS marks a transaction pooler; there a "
                "prepared statement may run on another server session. Remove "
                "OPTIONS['prepare_threshold'] (PgBouncer < 1.21 cannot track them).",
                id="skipqueue.W001",
            )
        )
    if conf.LISTEN:
        warnings.append(
            Warning(
                f"Workers LISTEN through {alias!r}, which is behind a transaction pooler.",
                hint="Notifications do not reach a pooled session: workers detect it and "
                "poll. Set SKIPQUEUE['LISTEN'] = False, or give workers a direct connection.",
                id="skipqueue.W002",
            )
        )
    return warnings


@register(Tags.security, deploy=True)
def check_debug(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    if not settings.DEBUG:
        return []
    return [
        Warning(
            "DEBUG is on: every worker keeps each query it runs in memory.",
            hint="Run workers (and production) with DEBUG = False.",
            id="skipqueue.W003",
        )
    ]
