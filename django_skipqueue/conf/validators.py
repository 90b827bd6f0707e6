"""Validators shared by the settings and the values above them: the queue-name rule."""

from __future__ import annotations

import re

from django_skipqueue.exceptions import InvalidJobError

#: Longest queue name: LISTEN/NOTIFY channels are "skipqueue_<queue>" within 63 bytes.
QUEUE_NAME_MAX_LENGTH = 48
QUEUE_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def validate_queue_name(name: object) -> str:
    """`name` if it is a valid queue name, else InvalidJobError saying why."""
    if not isinstance(name, str) or not QUEUE_NAME_PATTERN.fullmatch(name):
        raise InvalidJobError(
            f"queue name {name!r} is invalid: use letters, digits, '_', '-' and '.', "
            f"starting with a letter or digit"
        )
    if len(name.encode()) > QUEUE_NAME_MAX_LENGTH:
        raise InvalidJobError(
            f"queue name {name!r} is {len(name.encode())} bytes; at most "
            f"{QUEUE_NAME_MAX_LENGTH} are allowed"
        )
    return name
