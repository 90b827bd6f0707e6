"""The shared definitions every layer uses: job states, the claim order, queue names.

A leaf: it imports nothing of this package but `exceptions` (a leaf too), so that any
module may import it without a cycle.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from django.db import models
from django.utils.translation import gettext_lazy as _

from django_skipqueue.conf.validators import (  # noqa: F401  (part of this module's face)
    QUEUE_NAME_MAX_LENGTH,
    QUEUE_NAME_PATTERN,
    validate_queue_name,
)
from django_skipqueue.exceptions import InvalidJobError

DEFAULT_QUEUE_NAME = "default"
#: The longest operator name kept where a job was cancelled or a queue or schedule paused
#: (`cancelled_by`, `paused_by`): Django's own username length.
ACTOR_MAX_LENGTH = 150
MIN_PRIORITY, MAX_PRIORITY = -100, 100


#: The claim's ORDER BY, which the claim index mirrors.
CLAIM_ORDER = ("-priority", "run_at", "id")


def sort_in_claim_order(jobs: list[Any]) -> None:
    """Sort `jobs` in place by CLAIM_ORDER (stable sorts, last key first)."""
    for key in reversed(CLAIM_ORDER):
        jobs.sort(key=attrgetter(key.lstrip("-")), reverse=key.startswith("-"))


class JobState(models.TextChoices):
    PENDING = "pending", _("pending")
    RUNNING = "running", _("running")
    DONE = "done", _("done")
    FAILED = "failed", _("failed")
    CANCELLED = "cancelled", _("cancelled")
    #: Published to RabbitMQ by the relay (a relayed queue that keeps results); the
    #: consumer writes its outcome back. See broker.py.
    RELAYED = "relayed", _("relayed")
    #: A workflow's job whose parents have not all succeeded yet: never claimed. It
    #: becomes pending in the transaction that records its last parent's success
    #: (docs/howto/workflows.md).
    WAITING = "waiting", _("waiting")


FINISHED_STATES = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


class ParkedOn(models.TextChoices):
    """Why a pending job is not due (`Job.parked`): a durable step gave it back."""

    SLEEP = "sleep", _("sleeping")  # context.sleep()
    SIGNAL = "signal", _("awaiting a signal")  # context.wait_for()


class WorkflowState(models.TextChoices):
    RUNNING = "running", _("running")
    DONE = "done", _("done")
    #: A job of it ended failed or cancelled: its dependents were cancelled.
    FAILED = "failed", _("failed")
    #: An operator cancelled the whole workflow.
    CANCELLED = "cancelled", _("cancelled")


#: Every change of a job's state the protocol makes, (from, to), with the verbs that make
#: it: the state machine in one table (docs/explanation/protocol.md draws it). Anything
#: else is a bug: the test database's guard (tests/testapp, migration 0005) records any
#: other change, any write that keeps a finished job finished but changes it, and any
#: fall of `attempts`, and the suite fails on each. A feature that writes `state` adds
#: its changes here. Rows are inserted pending (enqueue, schedules) or waiting (a
#: workflow's dependents) and deleted only when finished (pruning) or relayed without
#: results (the relay).
TRANSITIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("pending", "pending"): (
        "enqueue_many (unique, replace)",
        "restart_from_step (operator: a durable job made due)",
        "wake_signalled (a job parked on a wait made due by its signal's commit)",
    ),
    ("pending", "running"): ("claim", "claim_limited"),
    ("pending", "cancelled"): ("cancel", "end_expired (reap: not started by expires_at)"),
    ("pending", "failed"): ("claim (a row that cannot be claimed or loaded)", "relay (unfit)"),
    ("pending", "relayed"): ("relay (a queue with RESULTS)",),
    ("running", "running"): ("renew", "renew_many", "extend_lease", "cancel (the request)"),
    ("running", "done"): ("ack", "ack_many"),
    ("running", "pending"): (
        "fail (retried)",
        "release (give_back)",
        "release_many (a Retry that spends no attempt: a durable sleep or wait)",
        "reap",
        "requeue (operator)",
    ),
    ("running", "failed"): ("fail", "reap", "claim (a row that cannot be loaded)"),
    ("running", "cancelled"): ("end_cancelled", "fail", "release", "reap"),
    ("waiting", "waiting"): ("a parent's ack (one parent fewer to wait on)",),
    ("waiting", "pending"): ("the ack of its last parent", "the workflow failed (on_error)"),
    ("waiting", "cancelled"): (
        "a parent failed or was cancelled",
        "cancel",
        "end_expired (reap: not started by expires_at)",
    ),
    ("cancelled", "waiting"): ("retry_now of its failed parent (operator)",),
    ("relayed", "done"): ("the consumer's write-back",),
    ("relayed", "failed"): ("the consumer's write-back",),
    ("failed", "pending"): ("retry_now (operator)", "restart_from_step (operator)"),
    ("cancelled", "pending"): ("retry_now (operator)", "restart_from_step (operator)"),
}
#: The only changes that take a job out of a finished state: an operator's explicit act.
OPERATOR_TRANSITIONS = frozenset(
    {("failed", "pending"), ("cancelled", "pending"), ("cancelled", "waiting")}
)
#: Who ends a workflow's job whose parent failed or was cancelled (`cancelled_by`): such a
#: job waits again when an operator retries that parent.
UPSTREAM = "skipqueue:upstream"
#: Who ends a workflow's on_error job when the workflow succeeded (`cancelled_by`).
UNNEEDED = "skipqueue:unneeded"
#: Who ends a job not started by its `expires_at` (`cancelled_by`): the reaper.
EXPIRED = "skipqueue:expired"

#: The states in which a job holds its unique key (see Job's skipqueue_job_unique_key).
UNFINISHED_STATES = (JobState.PENDING, JobState.RUNNING, JobState.WAITING)
#: Longest unique key (the column's length).
UNIQUE_KEY_MAX_LENGTH = 255


def idempotency_key_of(job_id: int) -> str:
    """A job's idempotency key: stable across all its attempts; hand it to external services."""
    return f"skipqueue-job-{job_id}"


#: The longest name of a durable step or signal kept, in characters (skipqueue_step.name,
#: skipqueue_signal.name).
STEP_NAME_MAX_LENGTH = 200


def check_step_name(name: object, what: str) -> None:
    """InvalidJobError unless `name` can be the name of a step or signal (`what`), checked
    before anything runs or is written (a name the database refuses would fail a step's
    record after its work was done)."""
    if not isinstance(name, str) or not name or len(name) > STEP_NAME_MAX_LENGTH:
        raise InvalidJobError(
            f"a {what}'s name must be a non-empty str of at most {STEP_NAME_MAX_LENGTH} "
            f"characters, got {name!r}"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidJobError(
            f"the {what} name {name!r} holds a lone surrogate, which UTF-8 cannot encode"
        ) from None
    if "\x00" in name:
        raise InvalidJobError(f"the {what} name {name!r} holds a NUL character (\\x00)")
