"""The registry row of a process that has no housekeeper: a broker consumer or a relay.

A worker's row is written by the worker (`Worker._register`), kept alive by its
housekeeper thread and marked stopped by its shutdown. A broker consumer
(`runworker --broker`) and a relay (`relayjobs`, or `runworker --relay`'s thread) have no
housekeeper: each holds a `Presence` and calls `beat()` from its own loop, which turns at
least every few seconds whether or not the broker answers. So the admin and
`queuestats` count them as live workers of their queues, and tell a clean stop (the row's
`stopped_at`) from a lost process (a heartbeat silent past WORKER_DEAD_AFTER_SECONDS).

No thread and no connection of its own: the beat is one UPDATE on the caller's thread's
connection, at most once per HEARTBEAT_SECONDS, and a database error is logged and left
to the next beat (the caller's loop must not die of it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from django.db import DatabaseError
from django.db.models.functions import Now

from django_skipqueue.conf import get_settings
from django_skipqueue.models import WorkerProcess
from django_skipqueue.queue.connections import discard_connection, retry_transient
from django_skipqueue.runtime.waiting import Waiting

logger = logging.getLogger(__name__)


class Presence:
    """One process's row: `register()` at start, `beat()` from its loop, `stopped()` at a
    clean stop. Each method is a no-op before registration went through."""

    def __init__(
        self, *, kind: str, queues: Sequence[str], concurrency: int, database: str
    ) -> None:
        self.kind = kind
        self.queues = list(queues)
        self.concurrency = concurrency
        self.database = database
        self.process: WorkerProcess | None = None
        self._next_beat = 0.0
        #: Whether the process waits for its queues' NOTIFY (a relay's): the heartbeat
        #: writes it again (runtime/waiting.py).
        self.waiting: Waiting | None = None

    def register(self, stopping: threading.Event) -> None:
        """Insert the row; a passing error is retried with backoff until it goes through
        or `stopping` is set (then there is no row, and nothing else is written). Any
        other database error (a table not migrated, say) is logged: the process runs
        on unseen, since its jobs need no row of its own."""
        workers = WorkerProcess.objects.db_manager(self.database)
        try:
            self.process = retry_transient(
                lambda: workers.register(
                    queues=self.queues, concurrency=self.concurrency, kind=self.kind
                ),
                what=f"{self.kind} registration",
                alias=self.database,
                stopping=stopping,
            )
        except DatabaseError as error:
            logger.warning(
                "%s not registered: the admin and queuestats will not count it: %s",
                self.kind,
                error,
            )
            discard_connection(self.database)
        self._next_beat = time.monotonic() + get_settings().HEARTBEAT_SECONDS
        if self.process is not None:
            logger.debug("registered kind=%s id=%s", self.kind, self.process.id)

    def beat(self, *, force: bool = False) -> None:
        """Write the heartbeat if HEARTBEAT_SECONDS have passed since the last (or now, with
        `force`). A row pruned meanwhile (the process was silent for a day) is inserted
        again, as a worker's housekeeper does."""
        now = time.monotonic()
        if self.process is None or (now < self._next_beat and not force):
            return
        self._next_beat = now + get_settings().HEARTBEAT_SECONDS
        try:
            rows = WorkerProcess.objects.using(self.database).filter(id=self.process.id)
            flag = self.waiting.columns() if self.waiting is not None else {}
            if not rows.update(heartbeat_at=Now(), **flag):
                self.process.save(using=self.database, force_insert=True)
        except DatabaseError as error:
            logger.warning("heartbeat failed kind=%s: %s", self.kind, error)
            discard_connection(self.database)

    def stopped(self) -> None:
        """A clean stop: the row says so (`stopped_at`), and no longer counts as alive."""
        if self.process is None:
            return
        try:
            WorkerProcess.objects.db_manager(self.database).mark_stopped(self.process.id)
        except DatabaseError as error:
            logger.warning("could not mark the %s stopped: %s", self.kind, error)
