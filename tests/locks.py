"""A migration held up by a long transaction (the lock_timeout of migrations 0018, 0020)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.core.management import call_command
from django.db import connections
from django.db.migrations.recorder import MigrationRecorder
from django.db.utils import OperationalError


@contextmanager
def migration_held_up_by_a_long_transaction(target: str) -> Iterator[None]:
    """`migrate skipqueue <target>` while another session's transaction holds a lock on
    the job table (a report's, a backup's): it must fail with a lock timeout within 10 s
    instead of stalling every write queued behind it. The block checks, the lock still
    held, that the failed migration changed nothing; then that transaction ends and the
    same migration, run again, must go through."""
    # First, with nothing held, back to before the migrations that build or drop an
    # index CONCURRENTLY (0027 on): such a step waits for every older transaction
    # however long (it blocks no write meanwhile, so it needs no lock_timeout), and
    # would wait here for the transaction below to end.
    wrapper = connections["default"]
    if ("skipqueue", "0027_fair_share") in MigrationRecorder(wrapper).applied_migrations():
        call_command("migrate", "skipqueue", "0026", verbosity=0)
    other = wrapper.get_new_connection(wrapper.get_connection_params())
    try:
        other.execute("BEGIN")
        other.execute("SELECT 1 FROM skipqueue_job LIMIT 1")
        started = time.monotonic()
        with pytest.raises(OperationalError, match="lock timeout"):
            call_command("migrate", "skipqueue", target, verbosity=0)
        assert time.monotonic() - started < 10
        yield
    finally:
        other.close()
    call_command("migrate", "skipqueue", target, verbosity=0)
