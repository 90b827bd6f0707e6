"""Validators shared by the settings and the values above them: the queue-name rule."""

from __future__ import annotations

import re

from django_skipqueue.exceptions import InvalidJobError

#: Longest queue name, in bytes: room for RabbitMQ's 255-byte names of a relayed queue
#: ("skipqueue.<queue>.retry.65536"). A queue's NOTIFY channel is "skipqueue_<queue>" up
#: to CHANNEL_NAME_MAX_LENGTH bytes, and a hash of the name past it (queue/sql.py,
#: channel_name; migration 0023): PostgreSQL ends identifiers at 63 bytes.
QUEUE_NAME_MAX_LENGTH = 200
CHANNEL_NAME_MAX_LENGTH = 48
#: Any text Django's Tasks API takes as a queue name (`emails:high`, `emails high`, `é`)
#: but control characters (newlines, tabs, NUL: log lines and jsonb). Channel names are
#: quoted identifiers (psycopg's sql.Identifier) and pg_notify() parameters, never SQL.
QUEUE_NAME_PATTERN = re.compile(r"[^\x00-\x1f\x7f-\x9f]+")


def validate_queue_name(name: object) -> str:
    """`name` if it is a valid queue name, else InvalidJobError saying why."""
    if not isinstance(name, str) or not QUEUE_NAME_PATTERN.fullmatch(name):
        raise InvalidJobError(
            f"queue name {name!r} is invalid: use text without control characters "
            f"(newlines, tabs, NUL), at least one character"
        )
    try:
        size = len(name.encode())
    except UnicodeEncodeError:  # a lone surrogate
        raise InvalidJobError(f"queue name {name!r} is invalid: not valid Unicode") from None
    if size > QUEUE_NAME_MAX_LENGTH:
        raise InvalidJobError(
            f"queue name {name!r} is {size} bytes; at most {QUEUE_NAME_MAX_LENGTH} are "
            f"allowed (a relayed queue's names must fit RabbitMQ's 255 bytes)"
        )
    return name
