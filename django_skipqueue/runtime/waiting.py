"""Waiting: whether a worker wants a NOTIFY for its queues' new jobs, in its row.

PostgreSQL takes one lock for the whole cluster at the commit of every transaction that
sent a NOTIFY, and holds it until the commit is flushed to disk: such commits go one at
a time, however many cores the server has. With a NOTIFY on every enqueue, a site's
web processes could not enqueue faster than one commit flush allows (measured with
pgbench on the job table, 16 clients: 0.47x the inserts/s of the same INSERTs without
the trigger). So the job table's trigger notifies a queue only while a worker of that
queue *waits* (migration 0016): `WorkerProcess.waiting_since` is set.

A worker waits once its claims have found nothing for LINGER_SECONDS; until then it
claims again every LINGER_TICK_SECONDS, unflagged. It stops waiting once two claims in a
row find jobs (not at the first: a job now and then, each announced by its NOTIFY, would
otherwise cost two writes of the row, one of them beside the job's start). So a worker
that keeps up with a stream of enqueues never waits, and the stream sends no NOTIFY
(measured with 16 pgbench clients inserting jobs while a worker of 4 threads takes them,
on 2 cores: 0.71x the inserts/s of the trigger disabled, where the worker, never
woken, did half the work; 0.28x-0.30x with a NOTIFY on every enqueue; 0.23x when the
worker waited after every short claim); a job that comes after a quiet spell is
announced by one NOTIFY. The lingering claims cost at most 1 / LINGER_TICK_SECONDS empty
claims a second, for LINGER_SECONDS after the last job found, and a job found then
waited at most a tick, about what a NOTIFY takes to arrive. The housekeeper's heartbeat
writes the flag again (a row rewritten by an operator, or a worker the reaper took for
dead, is set right within a heartbeat), and the reaper clears the flags of dead workers.

The one window: an enqueue whose INSERT ran before the worker's flag was committed,
and whose own commit comes after the worker's next claim, sends no NOTIFY and is not
seen by that claim. Right after it starts waiting the worker claims once more, which
leaves only the transactions that span that moment; their jobs are found by the next
NOTIFY or the worker's poll (POLL_INTERVAL_SECONDS, or the next job's due time).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable

from django.db import DatabaseError
from django.db.models import F
from django.db.models.functions import Coalesce, Now

from django_skipqueue.models import WorkerProcess
from django_skipqueue.queue.connections import discard_connection

logger = logging.getLogger(__name__)

#: How long a worker's claims find nothing before it waits for a NOTIFY.
LINGER_SECONDS = 0.05
#: How often it claims meanwhile.
LINGER_TICK_SECONDS = 0.005


class Waiting:
    """The dispatcher's side of a worker's `waiting_since` (one writer: its thread);
    `listening` is told by the notifier's thread, `columns` read by the housekeeper's."""

    def __init__(self, *, database: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.database = database
        self.worker_id: uuid.UUID | None = None
        self._listening = threading.Event()
        self._clock = clock
        self.waiting = False
        self._found_at = -math.inf
        self._found_last = False  # whether the last claim found jobs

    def listening(self, works: bool) -> None:
        """The notifier's LISTEN works now, or stopped working (then nobody would hear a
        NOTIFY: the worker does not wait for one, its poll finds the jobs)."""
        if works:
            self._listening.set()
        else:
            self._listening.clear()

    def after_claim(self, found: int) -> float | None:
        """After each claim that found `found` jobs: how to wait before the next one.

        None: as usual (for a NOTIFY, a finished job or the poll); a delay: claim again
        after it at the latest (lingering, see above); 0: the worker has just started
        waiting and must claim once more at once (an enqueue committed meanwhile sent
        no NOTIFY)."""
        now = self._clock()
        stream, self._found_last = self._found_last, bool(found)
        if found:
            self._found_at = now
            if self.waiting and stream:
                self._write(False)
        if self.waiting or not self._listening.is_set():
            return None
        if now - self._found_at < LINGER_SECONDS:
            return LINGER_TICK_SECONDS
        return 0.0 if self._write(True) else None

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
