"""What a command checks before it starts: the job table is migrated, the queues exist.

A worker started before `migrate`, or on a queue that nothing uses, should say so in
one line, not fail with a ProgrammingError traceback or idle without a word.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import pkgutil
from collections.abc import Sequence

from django.core.management.base import CommandError
from django.db import DatabaseError, connections

from django_skipqueue.conf import task_backends_of_ours
from django_skipqueue.faults import is_transient, sqlstate
from django_skipqueue.models import Job, Queue
from django_skipqueue.tasks.registry import registry

logger = logging.getLogger("django_skipqueue")


def require_migrated(alias: str) -> None:
    """CommandError unless every migration of django_skipqueue is applied on `alias`,
    and `alias` commits in autocommit (system check E013, here for a command run with
    its checks skipped or E013 silenced).

    A database that cannot be reached for a passing reason (not up yet, restarting) is
    not checked here: the worker waits for it with backoff, as it does for any outage.
    """
    connection = connections[alias]
    if not connection.settings_dict.get("AUTOCOMMIT", True):  # also with checks skipped
        raise CommandError(
            f"database {alias!r} has AUTOCOMMIT off: claims and outcomes would never "
            f"commit (skipqueue.E013); leave AUTOCOMMIT at Django's default"
        )
    try:
        if _all_applied(alias):
            return
        from django.db.migrations.loader import MigrationLoader  # the long way only

        loader = MigrationLoader(connection, ignore_no_migrations=True)
    except DatabaseError as error:
        if is_transient(error):
            logger.warning("could not check the migrations of database %r: %s", alias, error)
            return
        if sqlstate(error) == INSUFFICIENT_PRIVILEGE:
            # A least-privilege worker role (docs/explanation/security-and-guarantees.md)
            # cannot read django_migrations: check the job table it uses instead.
            return _require_job_table(alias)
        raise CommandError(f"cannot read the migrations of database {alias!r}: {error}") from error
    label = Job._meta.app_label
    missing = sorted(
        name
        for app, name in loader.graph.nodes
        if app == label and (app, name) not in loader.applied_migrations
    )
    if missing:
        raise CommandError(
            f"database {alias!r} lacks {len(missing)} migration(s) of django_skipqueue "
            f"({', '.join(missing)}): run `python manage.py migrate` first"
            + (f" (or `migrate --database {alias}`)" if alias != "default" else "")
        )


INSUFFICIENT_PRIVILEGE = "42501"


def _all_applied(alias: str) -> bool:
    """Whether every migration module of ours is recorded as applied: one small query,
    without importing the migrations of every installed app as MigrationLoader does
    (measured: a tenth of a worker's start-up in a small project). False sends the
    caller to MigrationLoader, which also knows squashed migrations. Names are counted
    once each: django_migrations has no unique key, and a row recorded twice (two
    `migrate` runs at once) hid a missing one from a count of rows
    (tests/integration/test_setup_errors.py).

    Raw SQL on Django's own table (its name is fixed in `MigrationRecorder`): the ORM's
    way, `MigrationRecorder`, imports `django.db.migrations` and its operations, 3-5 ms
    of a worker's start-up that the worker never needs otherwise."""
    package = importlib.import_module(f"{Job.__module__.rpartition('.')[0]}.migrations")
    ours = sorted(info.name for info in pkgutil.iter_modules(package.__path__))
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "SELECT COUNT(DISTINCT name) FROM django_migrations "
                "WHERE app = %s AND name = ANY(%s)",
                [Job._meta.app_label, ours],
            )
            (applied,) = cursor.fetchone()
    except DatabaseError:  # no django_migrations table, no right to read it: the long way
        return False
    return len(ours) == applied


def _require_job_table(alias: str) -> None:
    """CommandError unless the job table has every column of the Job model."""
    connection = connections[alias]
    table = Job._meta.db_table
    with connection.cursor() as cursor:
        if table not in connection.introspection.table_names(cursor):
            raise CommandError(
                f"database {alias!r} has no {table} table: run `python manage.py migrate` first"
            )
        present = {column.name for column in connection.introspection.get_table_description(
            cursor, table)}  # fmt: skip
    missing = [str(f.column) for f in Job._meta.concrete_fields if f.column not in present]
    if missing:
        raise CommandError(
            f"the {table} table of database {alias!r} lacks {', '.join(missing)}: run "
            f"`python manage.py migrate` first"
        )


def queue_warnings(queues: Sequence[str], alias: str) -> list[str]:
    """Each queue that no registered task uses and no job row names, with the nearest
    known queue: a typo (`--queue defualt`) would otherwise idle without a word."""
    known = {task.queue_name for task in map(registry.get, registry.names())}
    known |= _backend_queues()
    warnings = []
    for name in queues:
        if name in known or Job.objects.using(alias).filter(queue_name=name).exists():
            continue
        nearest = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
        warnings.append(
            f"no registered task uses queue {name!r} and no job is in it{hint} "
            f"(known queues: {', '.join(sorted(known)) or 'none'})"
        )
    paused = Queue.objects.using(alias).paused().filter(name__in=list(queues))
    for name, by in paused.values_list("name", "paused_by"):
        warnings.append(
            f"queue {name!r} is paused{f' by {by}' if by else ''}: no job of it runs until "
            f"`manage.py resumequeue {name}`"
        )
    return warnings


def _backend_queues() -> set[str]:
    """The QUEUES of each SkipQueueBackend in TASKS (django.tasks' queue allow-lists)."""
    names: set[str] = set()
    for entry in task_backends_of_ours():
        names.update(entry.get("QUEUES", []) or [])
    return names
