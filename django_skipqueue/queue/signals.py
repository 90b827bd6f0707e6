"""Signals to durable jobs (docs/howto/durable-jobs.md): `send_signal`.

A signal is a row of skipqueue_signal, written in the sender's transaction (rolled
back, it was never sent), kept until the job's `context.wait_for()` of its name takes
it (tasks/durable.py; queue/steps.sql, TAKE_SIGNAL). The sender writes nothing of the
job's row, so a long transaction of the sender holds up no lease renewal or ack of it.

No wake-up is lost between a wait's look for the signal and its park (the job given
back until the signal or its timeout):
- the sender committed before the look: the look takes the signal;
- between the look and the park: the park's UPDATE sees the signal (its own snapshot)
  and makes the job due at once (queue/outcomes.py, `give_back`);
- after the park: the sender, once committed, makes the parked job due
  (WAKE_SIGNALLED, a `transaction.on_commit` hook; an UPDATE of a park not yet
  committed waits for it, then sees it parked).
A sender that dies between its commit and its hook leaves the job to the reaper, whose
every pass wakes the jobs parked on a signal that is there (`wake_signalled`).
"""

from __future__ import annotations

from typing import Any

from django.db import connections, transaction

from django_skipqueue.core.payload import check_stored_size, encode, normalize
from django_skipqueue.core.states import FINISHED_STATES, JobState, check_step_name
from django_skipqueue.exceptions import SignalNotSentError
from django_skipqueue.queue import sql
from django_skipqueue.queue.awaiting import AwaitVerbs


class SignalVerbs(AwaitVerbs):
    """Sending a signal to a job."""

    def send_signal(self, job_id: int, name: str, payload: Any = None) -> int:
        """Send the signal `name` to the job `job_id`, with `payload` (JSON data, under
        the payload size limit): its `context.wait_for(name)` returns the payload. In
        the caller's transaction, if any: the signal exists once that commits, and never
        if it rolls back. Kept until a wait of the job takes it, the oldest first, one
        each. Returns the signal's id.

        Refused with SignalNotSentError (and nothing written: the caller's transaction
        stays usable) when the job is finished, relayed to RabbitMQ or not there; with
        InvalidJobError when the name or the payload is not one a signal can carry."""
        check_step_name(name, "signal")
        if isinstance(job_id, bool) or not isinstance(job_id, int):
            raise TypeError(f"send_signal(): job_id must be an int, got {job_id!r}")
        data = normalize(payload, f"the payload of signal {name!r}")
        check_stored_size(data, f"the payload of signal {name!r}")
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.SEND_SIGNAL, {"job": job_id, "name": name, "payload": encode(data)})
            row = cursor.fetchone()
        if row is not None:
            # robust: the signal is sent once committed; a failed wake-up is the
            # reaper's to make, not an error the caller would take for a failed send.
            transaction.on_commit(
                lambda: self.wake_signalled(job_id, name), using=self.db, robust=True
            )
            return int(row[0])
        state = self.filter(id=job_id).values_list("state", flat=True).first()
        if state is None:
            why = "there is no such job (pruned, or never enqueued here)"
        elif state in FINISHED_STATES:
            why = f"it is finished ({state}): no wait of it will ever run"
        elif state == JobState.RELAYED:
            why = "its queue is relayed to RabbitMQ, where a job has no row to wait in"
        else:
            why = f"its state is {state}"
        raise SignalNotSentError(f"signal {name!r} was not sent to job {job_id}: {why}")

    def wake_signalled(self, job_id: int | None = None, name: str | None = None) -> int:
        """Make due the jobs parked on a wait for a signal that is there to take (of
        `job_id` and `name`, or every one); how many. In autocommit, one statement."""
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.WAKE_SIGNALLED, {"job": job_id, "name": name})
            return len(cursor.fetchall())
