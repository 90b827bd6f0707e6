"""The shared definitions every layer uses: job states, the claim order, queue names.

A leaf: it imports nothing of this package but `exceptions` (a leaf too), so that any
module may import it without a cycle.
"""

from __future__ import annotations

import re
from operator import attrgetter
from typing import Any

from django.db import models
from django.utils.translation import gettext_lazy as _

from django_skipqueue.exceptions import InvalidJobError

DEFAULT_QUEUE_NAME = "default"
#: Longest queue name: LISTEN/NOTIFY channels are "skipqueue_<queue>" within 63 bytes.
QUEUE_NAME_MAX_LENGTH = 48
MIN_PRIORITY, MAX_PRIORITY = -100, 100
QUEUE_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


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


FINISHED_STATES = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)
#: The states in which a job holds its unique key (see Job's skipqueue_job_unique_key).
UNFINISHED_STATES = (JobState.PENDING, JobState.RUNNING)
#: Longest unique key (the column's length).
UNIQUE_KEY_MAX_LENGTH = 255


def validate_queue_name(name: object) -> str:
    """`name` if it is a valid queue name, else InvalidJobError saying why."""
    if not isinstance(name, str) or not QUEUE_NAME_PATTERN.fullmatch(name):
        raise InvalidJobError(
            f"queue name {name!r} is invalid: use letters, digits, '_', '-' and '.', "
            f"starting with a letter or digit"
        )
    if len(name.encode()) > QUEUE_NAME_MAX_LENGTH:
        raise InvalidJobError(
            f"queue name {name!r} is {len(name.encode())} bytes; at most "
            f"{QUEUE_NAME_MAX_LENGTH} are allowed"
        )
    return name


def idempotency_key_of(job_id: int) -> str:
    """A job's idempotency key: stable across all its attempts; hand it to external services."""
    return f"skipqueue-job-{job_id}"
