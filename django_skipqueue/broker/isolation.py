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

The child is a new interpreter, `python -m django_skipqueue.broker.isolation`, with the
consumer's environment and import path (a fork would copy the consumer's threads and
broker connection half-way). It reads its job as JSON on stdin (the message's body and
headers, as the broker carried them), sets Django up, runs the job through
`executor.run_brokered` as a thread does, and writes the verdict as JSON on a pipe of
its own (stdout stays the task's). JSON both ways: nothing read here can run code
(tests/integration/test_static.py, S1).
The child has a session of its own (a Ctrl-C at a terminal stops the consumer, which
waits for its jobs) and gets SIGTERM if the consumer dies (Linux). At its deadline (its
task's timeout, or nine tenths of the broker's consumer timeout, when the consumer
settles the attempt as timed out) it is killed: a process can be stopped, a thread
cannot.

A start costs about a second (an interpreter and Django's setup), paid only for messages
delivered again after a crash. This module imports no model at its top: the child runs
it before Django is set up.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_skipqueue.broker.message import Message
    from django_skipqueue.models import Job
    from django_skipqueue.runtime.executor import Verdict

logger = logging.getLogger("django_skipqueue.broker.isolation")  # __main__ in the child

#: How often the waiting thread looks at the clock while its child runs.
POLL_SECONDS = 0.5


@dataclass(frozen=True)
class Crashed:
    """The child ended without a verdict (or could not start): counted against its job."""

    reason: str

    @classmethod
    def exited(cls, returncode: int | None) -> Crashed:
        """`returncode` as subprocess gives it: negative, the signal that ended it."""
        if returncode is not None and returncode < 0:
            try:
                return cls(f"killed by {signal.Signals(-returncode).name}")
            except ValueError:
                return cls(f"killed by signal {-returncode}")
        return cls(f"exit code {returncode}")


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
    read_end, write_end = os.pipe()
    request = {
        "body": message.body().decode(),
        "headers": message.headers(),
        "database": database,
        "level": logging.getLogger("django_skipqueue").level,
        "verdict_fd": write_end,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    try:
        child = subprocess.Popen(  # noqa: S603  (this interpreter, this module)
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            pass_fds=(write_end,),
            env=env,
            start_new_session=True,
        )
    except OSError as error:  # out of memory or processes: as if it had crashed
        os.close(read_end)
        return Crashed(f"its process could not start: {error}")
    finally:
        os.close(write_end)  # the child holds its own copy: EOF once it ends
    try:
        assert child.stdin is not None  # noqa: S101  (stdin=PIPE)
        with child.stdin:
            child.stdin.write(json.dumps(request).encode())
    except OSError:  # it died before reading it: its exit says why
        pass
    try:
        data = _read_until(read_end, deadline)
    finally:
        os.close(read_end)
    if data is None:  # still running at its deadline
        child.kill()
        child.wait()
        return None
    child.wait()
    if not data:
        return Crashed.exited(child.returncode)
    return verdict_from_json(json.loads(data))


def _read_until(fd: int, deadline: float | None) -> bytes | None:
    """Everything written to `fd` until its writer closed it; None at `deadline`."""
    chunks: list[bytes] = []
    while True:
        wait = POLL_SECONDS if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], min(wait, POLL_SECONDS))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
        elif deadline is not None and time.monotonic() >= deadline:
            return None


def verdict_to_json(verdict: Verdict) -> dict[str, Any]:
    error = verdict.error
    return {
        "outcome": verdict.outcome.value,
        "duration": verdict.duration,
        "result": verdict.result,
        "error": None if error is None else [error.type, error.message, error.traceback],
        "retry_in": None if verdict.retry_in is None else verdict.retry_in.total_seconds(),
    }


def verdict_from_json(data: dict[str, Any]) -> Verdict:
    from django_skipqueue.queue.base import ErrorInfo
    from django_skipqueue.runtime.executor import Outcome, Verdict

    error = data["error"]
    return Verdict(
        Outcome(data["outcome"]),
        float(data["duration"]),
        result=data["result"],
        error=None if error is None else ErrorInfo(*error),
        retry_in=None if data["retry_in"] is None else timedelta(seconds=data["retry_in"]),
    )


def main() -> None:
    """In the child: read the job, run it, write its verdict. It logs as the consumer
    does (`management.arguments.configure_logging`): at its level, to stdout unless the
    settings' LOGGING gave a handler."""
    request = json.loads(sys.stdin.buffer.read())
    from django_skipqueue.runtime.pool import stop_with_parent

    # Linux ties this to the thread that started the child: a thread of the consumer's
    # pool, which lives until the consumer has waited for its jobs.
    stop_with_parent()
    import django

    django.setup()
    ours = logging.getLogger("django_skipqueue")
    ours.setLevel(request["level"])
    if not ours.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        ours.addHandler(handler)
    from django.db import connections

    from django_skipqueue.broker.message import Message
    from django_skipqueue.runtime.executor import Outcome, Verdict, describe_error, run_brokered

    message = Message.decode(request["body"].encode(), request["headers"])
    verdict: Verdict
    try:
        verdict = run_brokered(job_of(message), database=request["database"])
    except Exception as error:  # noqa: BLE001  (a signal receiver, say): settle it anyway
        logger.exception("broker consumer: job id=%s could not run", message.job_id)
        verdict = Verdict(Outcome.FAILED, 0.0, error=describe_error(error))
    finally:
        connections.close_all()
    try:
        text = json.dumps(verdict_to_json(verdict))
    except (TypeError, ValueError) as error:  # a result JSON cannot hold
        failed = Verdict(Outcome.FAILED, verdict.duration, error=describe_error(error))
        text = json.dumps(verdict_to_json(failed))
    with os.fdopen(request["verdict_fd"], "wb") as out:
        out.write(text.encode())


if __name__ == "__main__":
    main()
