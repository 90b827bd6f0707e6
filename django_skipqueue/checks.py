"""System checks for the SKIPQUEUE setting and the queue database.

Ids are never reused: E001 unknown key, E002 bad value, E003 SKIPQUEUE not a dict,
E004 unknown database alias, E005 database cannot SKIP LOCKED, E006 SkipQueueBackend
in TASKS on a Django without django.tasks.
"""

from __future__ import annotations

import difflib
from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, register
from django.db import connections

from django_skipqueue.conf import KNOWN_KEYS, get_settings


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


@register(Tags.database)
def check_database(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[Error]:
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
                hint="django-skipqueue needs PostgreSQL; point DATABASE_ALIAS at one.",
                id="skipqueue.E005",
            )
        ]
    return []


@register()
def check_tasks_backend(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    backends = getattr(settings, "TASKS", {}) or {}
    uses_ours = any(
        isinstance(entry, dict)
        and entry.get("BACKEND") == "django_skipqueue.backends.SkipQueueBackend"
        for entry in backends.values()
    )
    try:
        import django.tasks  # noqa: F401
    except ImportError:
        if uses_ours:
            return [
                Error(
                    "SkipQueueBackend needs Django 6.0+ (django.tasks).",
                    hint="Upgrade Django, or use django_skipqueue's own @task on 5.2.",
                    id="skipqueue.E006",
                )
            ]
    return []
