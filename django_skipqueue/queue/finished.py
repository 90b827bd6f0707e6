"""One LISTEN connection per process and database for every thread that waits for a
workflow or a job to finish (`Workflow.wait()`, `Job.wait()`, their `await_result()`).

Each waiting thread opened a connection of its own: 20 waiters held 40 backends, and at
50 other clients were refused with "too many clients". Now the waiters share one
connection. No thread is started for it: whichever waiter finds nobody reading the
socket reads it (for at most its own wait), and a notification read wakes every waiter
through one condition, each then reading its own workflow's row again. A waiter that
finds another reading waits on the condition. The connection is open while anyone
waits (`waiting()`), and closed when the last waiter leaves. Notifications are counted
(`generation`): a waiter that read the count before it looked at its row is woken by
any notification that came after, even one another waiter read.

A job's waiter first marks its row `awaited` (only such a row notifies when it finishes:
queue/awaiting.py). That write goes through a second connection of the listener, in
autocommit, never the LISTEN one (which a waiter may be reading at that moment) nor the
caller's (which may be inside a transaction). It is opened and closed with the first.

A job's waiter also says which job it waits on (`watching`). Whoever reads
notifications then asks, in one query on that side connection, which of the watched
jobs are finished (`finished_jobs()`), before it wakes the others: a waiter reads its
row again only if its job is among them (or its poll is due). Before, each waiter read
its own row at every notification: 24 waiters made 249 reads in 3.8 s (trial finding
3). The order keeps every finish seen: the socket is read, then the watched ids are
taken, then asked about; a job watched after that was read by its waiter after it
started watching, and a finish its waiter did not see then notifies later, in a read
whose question includes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Iterator
from typing import Any

from django.db import connections

from django_skipqueue.queue import sql

logger = logging.getLogger(__name__)

#: The channel a finished workflow's transaction notifies (workflows.FINISHED_CHANNEL).
FINISHED_CHANNEL = "skipqueue!workflow"
#: The channel a finished job notifies if a waiter marked it (migration 0022).
JOB_FINISHED_CHANNEL = "skipqueue!job"


class FinishedListener:
    """The shared LISTEN connection of one database alias (see the module doc)."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._changed = threading.Condition()
        self._generation = 0  # notifications read so far
        self._reading = False  # a waiter is reading the socket
        self._connection: Any = None
        self._pid = os.getpid()
        self._waiters = 0
        self._marking = threading.Lock()
        self._marker: Any = None  # the connection that marks rows awaited
        self._watched: dict[int, int] = {}  # job id: its waiters in this process
        self._finished: set[int] = set()  # watched jobs a read found finished

    @contextlib.contextmanager
    def waiting(self) -> Iterator[FinishedListener]:
        """Around one wait: the connection is opened and LISTENs before the block's first
        look at a row (no notification after it is missed), and is closed when the last
        waiter of the process leaves."""
        with self._changed:
            self._waiters += 1
            self._ensure()
        try:
            yield self
        finally:
            with self._changed:
                self._waiters -= 1
                if not self._waiters and self._connection is not None:
                    self._drop(self._connection)
                if not self._waiters:
                    with self._marking:
                        if self._marker is not None:
                            _close(self._marker)
                            self._marker = None

    @contextlib.contextmanager
    def watching(self, job_id: int) -> Iterator[None]:
        """Around one job's wait, inside `waiting()`: reads of notifications ask about
        this job (see `finished_jobs`)."""
        with self._changed:
            self._watched[job_id] = self._watched.get(job_id, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                left = self._watched.pop(job_id) - 1
                if left:
                    self._watched[job_id] = left
                else:
                    self._finished.discard(job_id)

    def finished_jobs(self) -> set[int]:
        """The watched jobs a read of notifications found finished: their waiters read
        their rows again; the others wait on."""
        with self._changed:
            return set(self._finished)

    @property
    def generation(self) -> int:
        """Read it before looking at the row you wait on; hand it to `wait`."""
        with self._changed:
            return self._generation

    def wait(self, seen: int, seconds: float) -> int:
        """Until a notification newer than `seen` was read, or `seconds` passed; returns
        the generation now."""
        deadline = time.monotonic() + max(seconds, 0.0)
        with self._changed:
            while self._generation == seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                connection = None if self._reading else self._ensure()
                if connection is None:  # another waiter reads, or no LISTEN: wait
                    self._changed.wait(left)
                    continue
                self._reading = True
                self._changed.release()
                finished: set[int] = set()
                try:
                    read = _read(connection, left)
                    if read:
                        finished = self._finished_among()
                except Exception as error:  # noqa: BLE001  (a broken connection: reopened)
                    logger.debug("wait: the LISTEN connection failed: %r", error)
                    read = 0
                    self._drop(connection)
                finally:
                    self._changed.acquire()
                    self._reading = False
                self._finished |= finished
                self._generation += read
                self._changed.notify_all()
            return self._generation

    def mark_awaited(self, job_id: int) -> bool | None:
        """Mark job `job_id` awaited, unless finished (then it notifies when it
        finishes), in a transaction of its own: True if another session can see the
        row, False if not (not committed yet, or gone), None if the mark failed (the
        waiter polls)."""
        row = self._on_side(sql.MARK_AWAITED, [job_id, job_id])
        return None if row is None else bool(row and row[0][0])

    def _finished_among(self) -> set[int]:
        """Which watched jobs are finished, in one query (the condition not held); all
        of them if the query fails (each waiter then reads its own row)."""
        with self._changed:
            watched = list(self._watched)
        if not watched:
            return set()
        rows = self._on_side(sql.FINISHED_AMONG, [watched])
        return set(watched) if rows is None else {row[0] for row in rows}

    def _on_side(self, statement: str, params: list[Any]) -> list[Any] | None:
        """The rows of `statement` run on the side connection (opened if need be, in
        autocommit); None if it failed (the connection is closed, to be opened again)."""
        with self._marking:
            if self._pid != os.getpid():
                self._marker = None
            try:
                if self._marker is None:
                    self._marker = self._connect()
                return list(self._marker.execute(statement, params).fetchall())
            except Exception as error:  # noqa: BLE001  (the waiters poll their rows)
                logger.debug("job wait: the side connection failed: %r", error)
                if self._marker is not None:
                    _close(self._marker)
                    self._marker = None
                return None

    def _connect(self) -> Any:
        wrapper = connections[self.alias]
        connection = wrapper.get_new_connection(wrapper.get_connection_params())
        connection.autocommit = True
        return connection

    def _ensure(self) -> Any:
        """The connection, opened and listening if need be (the condition held)."""
        if self._pid != os.getpid():  # forked: the parent's socket is not ours to use
            self._connection, self._pid = None, os.getpid()
        if self._connection is None:
            try:
                connection = self._connect()
                for channel in (FINISHED_CHANNEL, JOB_FINISHED_CHANNEL):
                    sql.listen_channel(connection, channel)
            except Exception as error:  # noqa: BLE001  (waiting falls back to polling)
                logger.debug("wait: no LISTEN, polling: %r", error)
                return None
            self._connection = connection
        return self._connection

    def _drop(self, connection: Any) -> None:
        _close(connection)
        if self._connection is connection:
            self._connection = None


def _close(connection: Any) -> None:
    try:
        connection.close()
    except Exception:  # noqa: BLE001,S110  (it failed already)
        pass


def _read(connection: Any, seconds: float) -> int:
    """How many notifications arrive on `connection` within `seconds` (at least one
    ends the wait; those already there are taken at once)."""
    found = len(list(connection.notifies(timeout=0)))
    if found:
        return found
    select.select([connection.fileno()], [], [], seconds)
    return len(list(connection.notifies(timeout=0)))


_listeners: dict[str, FinishedListener] = {}
_listeners_lock = threading.Lock()


def finished_listener(alias: str) -> FinishedListener:
    """This process's listener for `alias` (made once)."""
    with _listeners_lock:
        listener = _listeners.get(alias)
        if listener is None:
            listener = _listeners[alias] = FinishedListener(alias)
        return listener
