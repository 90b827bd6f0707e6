"""Signals to durable jobs (docs/howto/durable-jobs.md): `send_signal`.

A signal is a row of skipqueue_signal, written in the sender's transaction (rolled
back, it was never sent), kept until the job's `context.wait_for()` of its name takes
it (tasks/durable.py; queue/steps.sql, TAKE_SIGNAL). The same statement counts it on
the job's row (`signals_sent`) and makes a job parked on a wait for that name due now;
that write also keeps the row locked until the sender commits, which is how a wait
that looked a moment before the commit does not park the job until its timeout.
"""

from __future__ import annotations

from typing import Any

from django.db import connections

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
