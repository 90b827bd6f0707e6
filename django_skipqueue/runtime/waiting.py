"""Waiting: whether a worker wants a NOTIFY for its queues' new jobs, in its row.

PostgreSQL takes one lock for the whole cluster at the commit of every transaction that
sent a NOTIFY, and holds it until the commit is flushed to disk: such commits go one at
a time, however many cores the server has. With a NOTIFY on every enqueue, a site's
web processes could not enqueue faster than one commit flush allows (measured with
pgbench on the job table, 16 clients: 0.47x the inserts/s of the same INSERTs without
the trigger). So the job table's trigger notifies a queue only while a worker of that
queue *waits* (migration 0016): `WorkerProcess.waiting_since` is set.

A worker waits once a claim comes back short (the queue had nothing more for it) while
its LISTEN works; it stops waiting after two full claims in a row (the queue keeps it
busy: it claims again as soon as a thread is free, with no NOTIFY). Two, not one: a
worker that takes one job at a time as they trickle in would otherwise write its row
twice per job. The housekeeper's heartbeat writes the flag again (a row rewritten by an
operator, or a worker the reaper took for dead, is set right within a heartbeat), and
the reaper clears the flags of dead workers.

The one window: an enqueue whose INSERT ran before the worker's flag was committed,
and whose own commit comes after the worker's next claim, sends no NOTIFY and is not
seen by that claim. Right after it starts waiting the worker claims once more, which
leaves only the transactions that span that moment; their jobs are found by the next
NOTIFY or the worker's poll (POLL_INTERVAL_SECONDS, or the next job's due time).
"""

from __future__ import annotations

import logging
import threading
import uuid

from django.db import DatabaseError
from django.db.models import F
from django.db.models.functions import Coalesce, Now

from django_skipqueue.models import WorkerProcess
from django_skipqueue.queue.connections import discard_connection

logger = logging.getLogger(__name__)

#: Full claims in a row after which a waiting worker stops waiting.
BUSY_AFTER_FULL_CLAIMS = 2


class Waiting:
    """The dispatcher's side of a worker's `waiting_since` (one writer: its thread);
    `listening` is told by the notifier's thread, `columns` read by the housekeeper's."""

    def __init__(self, *, database: str) -> None:
        self.database = database
        self.worker_id: uuid.UUID | None = None
        self._listening = threading.Event()
        self.waiting = False
        self._full_claims = 0

    def listening(self, works: bool) -> None:
        """The notifier's LISTEN works now, or stopped working (then nobody would hear a
        NOTIFY: the next short claim does not wait for one, the poll finds the jobs)."""
        if works:
            self._listening.set()
        else:
            self._listening.clear()

    def claimed(self, *, full: bool) -> bool:
        """After each claim. True: the worker has just started waiting, and must claim
        once more before it sleeps (an enqueue committed meanwhile sent no NOTIFY)."""
        if full:
            self._full_claims += 1
            if self.waiting and self._full_claims >= BUSY_AFTER_FULL_CLAIMS:
                self._write(False)
            return False
        self._full_claims = 0
        if self.waiting or not self._listening.is_set():
            return False
        return self._write(True)

    def columns(self) -> dict[str, object]:
        """What the heartbeat writes of the flag: it as the dispatcher left it (and not
        set while LISTEN does not work)."""
        if self.waiting and self._listening.is_set():
            return {"waiting_since": Coalesce(F("waiting_since"), Now())}
        return {"waiting_since": None}

    def _write(self, waiting: bool) -> bool:
        if self.worker_id is None:
            return False
        try:
            WorkerProcess.objects.db_manager(self.database).set_waiting(self.worker_id, waiting)
        except DatabaseError as error:
            # Not written: the claims go on; the next short claim or heartbeat tries again.
            logger.warning("worker waiting flag not written: %s", error)
            discard_connection(self.database)
            return False
        self.waiting = waiting
        return waiting
