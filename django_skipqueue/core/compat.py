"""Uses of Django's, pika's and the interpreter's internals that are not about the
database (those are the `db` package's), each with a test of its own in
`tests/db/test_compat.py`.

These are not public API. Each names what it relies on, so that an upgrade that changes
it fails that test first, not a worker in production.
"""

from __future__ import annotations

import atexit
from typing import Any, TypeVar

T = TypeVar("T")


def build_unvalidated(cls: type[T], **values: object) -> T:
    """An instance of a frozen, slotted dataclass of Django's (`django.tasks.Task`) with
    these field values, without its `__post_init__` (the backend's `validate_task`):
    a result describes a row that exists, valid for this process's settings or not."""
    instance = cls.__new__(cls)
    for name, value in values.items():
        object.__setattr__(instance, name, value)
    return instance


def set_on_frozen(instance: object, name: str, value: object) -> None:
    """Set an attribute of a frozen dataclass of Django's (`django.tasks.TaskResult`'s
    `status` and `_return_value`, which only Django's own backends otherwise write)."""
    object.__setattr__(instance, name, value)


# -- pika's internals (the broker layer's; pika itself is imported there only) --------


def pika_channel_impl(channel: Any) -> Any:
    """The asynchronous `pika.channel.Channel` under a `BlockingChannel`.

    Relied on: `BlockingChannel._impl` (pika 1.x). The broker layer calls it for what
    the blocking channel does not offer or does too eagerly: queueing publishes and acks
    without a socket flush each, confirm and return callbacks, and the close callback
    that carries the broker's reason.
    """
    return channel._impl


# -- the interpreter's --------------------------------------------------------------


def run_exit_handlers() -> None:
    """Run the `atexit` handlers now (yours, logging's), before a command ends its
    process with `os._exit`, which skips the interpreter's teardown (about 80 ms of
    freeing objects after an idle worker's stop) and with it those handlers.

    Relied on: `atexit._run_exitfuncs` (CPython 3.10 to 3.13), which runs and clears
    them, so that none runs twice.
    """
    atexit._run_exitfuncs()
