"""The state-machine guard's two helpers (the trigger: tests/testapp migration 0005)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection

from tests.testapp.models import StateViolation


@contextmanager
def setting_up() -> Iterator[None]:
    """Writes made inside are not checked by the guard: a test putting rows by hand into
    a state the protocol would not produce (a finished job edited, say)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('skipqueue_test.setting_up', 'on', false)")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('skipqueue_test.setting_up', '', false)")


def violations() -> list[str]:
    """Every violation recorded since the last `clear()`, one line each."""
    return [f"{v}; statement: {v.statement[:300]}" for v in StateViolation.objects.order_by("id")]


def clear() -> None:
    StateViolation.objects.all().delete()
