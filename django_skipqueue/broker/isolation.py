"""Jobs delivered again, each run in a process of its own (`runworker --broker`).

RabbitMQ delivers a message again when the consumer that held it died or lost its
connection: perhaps that message killed it. Run in a thread beside others, a second
crash on it would return every delivery the process then held, and the broker counts
each return against DELIVERY_LIMIT, so innocent neighbours would reach the limit with
the poison. Such a message (and the retry of an attempt given up on while it ran) runs
in a child process instead: a crash ends the child only, and the consumer counts it
against that message alone (`Crashed`: one more delivery, or the dead queue at the
limit). Nothing has to stop the consumption meanwhile: an earlier design cancelled the
consumers to run such a message alone, and every cancel risked a delivery that arrived
during it, which pika returns to the queue and RabbitMQ counts (under load, a cascade
that dead-lettered innocent jobs; tests/chaos/test_relay.py, T58).

The child is started with multiprocessing's "spawn" (a fresh interpreter: the consumer
has threads and a broker connection, which a fork copies half-way), sets Django up,
runs the job through `executor.run_brokered` as a thread does, and sends the verdict
back on a pipe. It leaves the consumer's process group (a Ctrl-C at a terminal stops the
consumer, which waits for its jobs) and gets SIGTERM if the consumer dies (Linux). At
its deadline (its task's timeout, or nine tenths of the broker's consumer timeout, when
the consumer settles the attempt as timed out) it is killed: a process can be stopped,
a thread cannot.

A start costs about a second (an interpreter and Django's setup), paid only for messages
delivered again after a crash. This module imports no model at its top: a child imports
it before Django is set up.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from django_skipqueue.broker.message import Message
    from django_skipqueue.models import Job
    from django_skipqueue.runtime.executor import Verdict

logger = logging.getLogger(__name__)

#: How often the waiting thread looks at the clock while its child runs.
POLL_SECONDS = 0.5


@dataclass(frozen=True)
class Crashed:
    """The child ended without a verdict (or could not start): counted against its job."""

    reason: str

    @classmethod
    def exited(cls, exitcode: int | None) -> Crashed:
        """`exitcode` as multiprocessing gives it: negative, the signal that ended it."""
        if exitcode is not None and exitcode < 0:
            try:
                return cls(f"killed by {signal.Signals(-exitcode).name}")
            except ValueError:
                return cls(f"killed by signal {-exitcode}")
        return cls(f"exit code {exitcode}")


def job_of(message: Message) -> Job:
    """The unsaved Job a delivery runs as."""
    from django_skipqueue.core.states import JobState
    from django_skipqueue.models import Job

    return Job(
        id=message.job_id,
        task=message.task,
        queue_name=message.queue,
        args=message.args,
        kwargs=message.kwargs,
        attempts=message.attempt,
        max_attempts=message.max_attempts,
        lease=timedelta(seconds=message.lease_seconds),
        state=JobState.RUNNING,
        trace_context=message.trace,
    )


def run_isolated(message: Message, *, database: str, deadline: float | None) -> Any:
    """Run `message`'s job in a child process: its Verdict; Crashed if the child ended
    without one; None if it still ran at `deadline` (the process clock) and was killed."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    ours = logging.getLogger("django_skipqueue")
    child = context.Process(
        target=_child,
        args=(message, database, sender, ours.level),
        name=f"skipqueue-job-{message.job_id}",
    )
    try:
        child.start()
    except OSError as error:  # out of memory or processes: as if it had crashed
        receiver.close()
        return Crashed(f"its process could not start: {error}")
    finally:
        sender.close()  # the child holds the other end: EOF once it ends
    try:
        while True:
            wait = POLL_SECONDS
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            if receiver.poll(wait):
                try:
                    verdict = receiver.recv()
                except EOFError:
                    child.join()
                    return Crashed.exited(child.exitcode)
                child.join()
                return verdict
            if deadline is not None and time.monotonic() >= deadline:
                child.kill()
                child.join()
                return None
    finally:
        receiver.close()


def _child(message: Message, database: str, sender: Connection, level: int) -> None:
    """In the child: run the job, send its verdict. It logs as the consumer does
    (`management.arguments.configure_logging`): at its level, to stdout unless the
    settings' LOGGING gave a handler."""
    os.setpgid(0, 0)
    from django_skipqueue.runtime.pool import stop_with_parent

    # Linux ties this to the thread that started the child: a thread of the consumer's
    # pool, which lives until the consumer has waited for its jobs.
    stop_with_parent()
    import django

    django.setup()
    ours = logging.getLogger("django_skipqueue")
    ours.setLevel(level)
    if not ours.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        ours.addHandler(handler)
    from django.db import connections

    from django_skipqueue.runtime.executor import Outcome, Verdict, describe_error, run_brokered

    verdict: Verdict
    try:
        verdict = run_brokered(job_of(message), database=database)
    except Exception as error:  # noqa: BLE001  (a signal receiver, say): settle it anyway
        logger.exception("broker consumer: job id=%s could not run", message.job_id)
        verdict = Verdict(Outcome.FAILED, 0.0, error=describe_error(error))
    finally:
        connections.close_all()
    try:
        sender.send(verdict)
    except Exception as error:  # noqa: BLE001  (a result pickle cannot carry)
        sender.send(Verdict(Outcome.FAILED, verdict.duration, error=describe_error(error)))
