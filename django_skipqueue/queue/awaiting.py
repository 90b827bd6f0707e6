"""Waiting on one job: `Job.wait()` and `Job.await_result()` (Celery's
`AsyncResult.get(timeout=)`).

The waiter shares this process's LISTEN connection with every other waiter
(`finished.py`). Before its first look at the row it marks the row `awaited` on the
listener's side connection, never the caller's (which may be inside a transaction: the
mark would hold the row's lock until that commit, and the worker's ack would wait on
it). A job marked so notifies 'skipqueue!job' when a statement finishes it (the trigger
of migration 0022), in that statement's transaction; the others never do, so a job
nobody waits on costs nothing. At a notification, the listener asks once which of the
jobs its waiters wait on are finished, and only their waiters read their rows again;
every waiter also reads its row every POLL_SECONDS, the fallback (no LISTEN, a lost
connection).

The mark also tells whether another session can see the row: one enqueued in the
caller's own uncommitted transaction cannot run before that commits, so waiting on it
is refused at once (TransactionManagementError) rather than timed out.
"""

from __future__ import annotations

import time
from typing import Any

from django.db.transaction import TransactionManagementError

from django_skipqueue.core.payload import Undecodable
from django_skipqueue.core.running import checked_timeout, refuse_waiting_in_a_task
from django_skipqueue.core.states import EXPIRED, FINISHED_STATES, UPSTREAM, JobState
from django_skipqueue.exceptions import InvalidJobError, JobFailed
from django_skipqueue.queue.finished import finished_listener
from django_skipqueue.queue.operator import OperatorVerbs

#: How often a waiter reads its row again when no notification comes.
POLL_SECONDS = 1.0

#: What a waiter reads of its row.
FIELDS = ("state", "result", "last_error", "cancelled_by", "attempts", "finished_at")


class AwaitVerbs(OperatorVerbs):
    """Waiting on one job until it finishes."""

    def wait_for(
        self, job: Any, timeout: float | None = None, *, allow_in_task: bool = False
    ) -> Any:
        """Block until `job` finishes; its result. JobFailed if it ended failed or
        cancelled, TimeoutError after `timeout` seconds. `job`'s fields are read again
        (state, result, last error). Never holds a transaction while it waits. Refused
        inside a task (core/running.py) unless `allow_in_task`."""
        timeout = checked_timeout(timeout)
        if job.id is None:
            raise ValueError(
                "this job has no id: it was built (task.build()), not enqueued; enqueue it first"
            )
        refuse_waiting_in_a_task(f"job {job.id}", allow_in_task)
        deadline = None if timeout is None else time.monotonic() + timeout
        listener = finished_listener(self.db)
        with listener.waiting(), listener.watching(job.id):
            seen = listener.generation
            visible = listener.mark_awaited(job.id)
            while True:
                read_at = time.monotonic()
                row = self.filter(id=job.id).only(*FIELDS).first()
                if row is None:
                    raise self.model.DoesNotExist(
                        f"job {job.id} does not exist: its enqueue was rolled back, or its "
                        "row was deleted (pruned after it finished, or relayed to RabbitMQ, "
                        "whose jobs keep no row without RESULTS)"
                    )
                for name in FIELDS:
                    setattr(job, name, getattr(row, name))
                if job.state in FINISHED_STATES:
                    return outcome_of(job)
                if visible is False:
                    raise TransactionManagementError(
                        f"job {job.id} was enqueued in a transaction that has not committed "
                        "yet: no worker can see it. Wait for it after the commit "
                        "(transaction.on_commit, or outside the atomic block; a view under "
                        "ATOMIC_REQUESTS runs in one: @transaction.non_atomic_requests)."
                    )
                # Woken by a notification, the row is read again only if the listener's
                # one read for all waiters found this job finished, or the poll is due.
                while True:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"job {job.id} ({job.task}) is still {job.state} after {timeout} s"
                        )
                    poll = read_at + POLL_SECONDS - time.monotonic()
                    if poll <= 0:
                        break
                    seen = listener.wait(seen, poll if left is None else min(poll, left))
                    if job.id in listener.finished_jobs():
                        break


def outcome_of(job: Any) -> Any:
    """A finished job's result; JobFailed if it failed or was cancelled."""
    if job.state == JobState.DONE:
        if isinstance(job.result, Undecodable):
            raise InvalidJobError(f"job {job.id}'s result cannot be loaded: {job.result.reason}")
        return job.result
    by = CANCELLERS.get(job.cancelled_by, job.cancelled_by)
    raise JobFailed(job.id, job.task, job.state, job.last_error, cancelled_by=by)


#: The package's own cancellers, in words (JobFailed said "cancelled by skipqueue:upstream").
CANCELLERS = {
    UPSTREAM: "its workflow: a job it waits on failed or was cancelled",
    EXPIRED: "its expiry: it was not started in time",
}
