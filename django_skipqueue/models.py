"""The job table and the worker registry: the app's models (Job, Workflow, Queue,
RateBucket, Schedule, QueueMinute, WorkerProcess), one module as Django expects.

Over 600 lines because each model's fields carry their help text and constraints, which
the migrations and the admin read; their verbs are `queue/`'s, their clamping fields
`queue/fields.py`'s.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from django_skipqueue.core.cron import MISSED_POLICIES, SCHEDULE_NAME_MAX_LENGTH
from django_skipqueue.core.payload import PayloadField
from django_skipqueue.core.states import (
    ACTOR_MAX_LENGTH,
    CLAIM_ORDER,
    DEFAULT_QUEUE_NAME,
    FINISHED_STATES,
    QUEUE_NAME_MAX_LENGTH,
    UNFINISHED_STATES,
    UNIQUE_KEY_MAX_LENGTH,
    JobState,
    ParkedOn,
    WorkflowState,
    idempotency_key_of,
)
from django_skipqueue.queue.fields import DateTimeField, DurationField
from django_skipqueue.queue.managers import (
    JobManager,
    QueueManager,
    QueueMinuteManager,
    RateBucketManager,
    ScheduleManager,
    TaskMinuteManager,
    WorkerProcessManager,
)
from django_skipqueue.queue.workflows import WorkflowManager


class WorkerKind(models.TextChoices):
    WORKER = "worker", _("worker")  # runworker: claims from the job table
    CONSUMER = "consumer", _("broker consumer")  # runworker --broker: from RabbitMQ
    RELAY = "relay", _("relay")  # relayjobs: publishes relayed queues' jobs


__all__ = [
    "CLAIM_ORDER",
    "FINISHED_STATES",
    "Job",
    "JobState",
    "PICKUP_BUCKETS",
    "Queue",
    "QueueMinute",
    "QueueOverview",
    "Schedule",
    "Step",
    "TaskMinute",
    "TaskOverview",
    "WorkerKind",
    "WorkerProcess",
    "Workflow",
    "WorkflowState",
]


def queue_names_of(value: Any) -> list[str]:
    """A worker row's `queues` as names, whatever another client stored there."""
    return [name for name in value if isinstance(name, str)] if isinstance(value, list) else []


class WorkerProcess(models.Model):
    """One running `Worker` (a `runworker` process), as recorded in the database."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    queues = models.JSONField(default=list)
    concurrency = models.PositiveSmallIntegerField(default=1)
    started_at = DateTimeField(db_default=Now())
    heartbeat_at = DateTimeField(db_default=Now())
    #: What the process is: a claiming worker (`runworker`), a broker consumer
    #: (`runworker --broker`) or a relay (`relayjobs`).
    kind = models.CharField(
        max_length=16, choices=WorkerKind.choices, default=WorkerKind.WORKER, db_default="worker"
    )
    #: Set when the process stopped cleanly; NULL and a silent heartbeat: it was lost.
    stopped_at = DateTimeField(null=True, blank=True)
    #: Since when the worker waits for a NOTIFY of its queues (its last claim came back
    #: short and its LISTEN works); NULL while it is busy. The job table's trigger
    #: notifies a queue only while a worker of it waits (runtime/waiting.py).
    waiting_since = DateTimeField(null=True, blank=True)

    objects = WorkerProcessManager()

    class Meta:
        verbose_name = _("worker process")
        verbose_name_plural = _("worker processes")
        ordering = ("-started_at",)
        indexes = [
            models.Index(fields=["heartbeat_at"], name="skipqueue_worker_beat_idx"),
            # The NOTIFY trigger's lookup, on every enqueue: the waiting workers only.
            models.Index(
                fields=["waiting_since"],
                name="skipqueue_worker_waiting_idx",
                condition=models.Q(waiting_since__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.hostname}:{self.pid} ({str(self.id)[:8]})"

    @property
    def queue_names(self) -> list[str]:
        return queue_names_of(self.queues)


class Waitable:
    """`await_result()` for a model whose `wait()` blocks: Job and Workflow."""

    _state: models.base.ModelState

    def wait(self, timeout: float | None = None, *, allow_in_task: bool = False) -> Any:
        raise NotImplementedError

    async def await_result(
        self, timeout: float | None = None, *, allow_in_task: bool = False
    ) -> Any:
        """`wait()` for async code (an async view): the same, without blocking the loop."""
        from asgiref.sync import sync_to_async

        waiting = sync_to_async(self._wait_then_close, thread_sensitive=False)
        return await waiting(timeout, allow_in_task)

    def _wait_then_close(self, timeout: float | None, allow_in_task: bool) -> Any:
        from django.db import connections

        try:
            return self.wait(timeout, allow_in_task=allow_in_task)
        finally:
            connections[self._state.db or "default"].close()  # this worker thread's own


class Job(Waitable, models.Model):
    """A call of a registered task, from enqueue to its final state.

    `attempts` counts claims and is the fence: it never goes down. A finished attempt
    is written only where id, state, attempts and an unexpired lease all still match.
    """

    id = models.BigAutoField(primary_key=True)
    task = models.CharField(_("task"), max_length=255, help_text=_("The registered task name."))
    args = PayloadField(default=list, blank=True)
    kwargs = PayloadField(default=dict, blank=True)
    queue_name = models.CharField(max_length=QUEUE_NAME_MAX_LENGTH, default=DEFAULT_QUEUE_NAME)
    priority = models.SmallIntegerField(default=0, help_text=_("-100 to 100; higher runs first."))
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.PENDING)
    run_at = DateTimeField(db_default=Now(), help_text=_("Not claimed before this."))
    expires_at = DateTimeField(
        null=True,
        blank=True,
        help_text=_("Not started by then, it never runs: it ends cancelled, by skipqueue:expired."),
    )
    lease = DurationField(help_text=_("How long each claim owns the job."))
    leased_until = DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0, help_text=_("Claims so far."))
    max_attempts = models.PositiveIntegerField()
    expirations = models.PositiveIntegerField(
        default=0, help_text=_("Leases that ran out and were taken back by the reaper.")
    )
    releases = models.PositiveIntegerField(
        default=0, help_text=_("Attempts given back (graceful shutdown or Retry).")
    )
    last_error = models.TextField(blank=True, default="")
    errors = PayloadField(
        default=list, blank=True, help_text=_("The latest errors, one entry per failed attempt.")
    )
    result = PayloadField(null=True, blank=True, help_text=_("The return value when done."))
    created_at = DateTimeField(db_default=Now())
    started_at = DateTimeField(null=True, blank=True, help_text=_("Start of the last claim."))
    first_started_at = DateTimeField(
        null=True, blank=True, help_text=_("Start of the first claim.")
    )
    worker_ids = PayloadField(  # jsonb: an array column would need django.contrib.postgres
        null=True,
        blank=True,
        help_text=_("Who claimed each attempt: a worker's id, or in-process:host:pid."),
    )
    finished_at = DateTimeField(null=True, blank=True)
    # NULL, not "", for "none": such rows stay out of the partial unique indexes below at
    # no cost, and the enqueue statement does not write the column at all.
    unique_key = models.CharField(  # noqa: DJ001
        max_length=UNIQUE_KEY_MAX_LENGTH,
        null=True,
        blank=True,
        help_text=_("At most one unfinished job of a task holds a key (unique jobs)."),
    )
    schedule = models.CharField(  # noqa: DJ001  (NULL for "none", as unique_key)
        max_length=SCHEDULE_NAME_MAX_LENGTH,
        null=True,
        blank=True,
        help_text=_("The periodic schedule that enqueued it."),
    )
    scheduled_for = DateTimeField(
        null=True, blank=True, help_text=_("The schedule's occurrence this job runs.")
    )
    # Flow control. A key shared by jobs that may run at most `concurrency_limit` at a
    # time across every worker (NULL: no key, the claim's fast path).
    concurrency_key = models.CharField(  # noqa: DJ001  (NULL for "none", as unique_key)
        max_length=UNIQUE_KEY_MAX_LENGTH,
        null=True,
        blank=True,
        help_text=_("Jobs sharing a key run at most concurrency_limit at a time."),
    )
    concurrency_limit = models.PositiveSmallIntegerField(null=True, blank=True)
    # Rate limits per task (`@task(rate_limit="10/m")`): jobs sharing `rate_key` (their
    # task's name) start at most `rate_limit` times per period, across every worker.
    rate_key = models.CharField(  # noqa: DJ001  (NULL for "none", as concurrency_key)
        max_length=UNIQUE_KEY_MAX_LENGTH,
        null=True,
        blank=True,
        help_text=_("Jobs sharing a rate key start at most rate_limit times per period."),
    )
    rate_limit = models.CharField(max_length=32, null=True, blank=True)  # noqa: DJ001
    # Fair share (SKIPQUEUE['FAIR_QUEUES'], queue/fair.py): in a fair queue every job has a
    # key ("" for none), and while several keys have due jobs each gets claims in
    # proportion to its jobs' `fair_weight`. NULL: a job of a queue that is not fair.
    fair_key = models.CharField(  # noqa: DJ001  (NULL for "not fair", as concurrency_key)
        max_length=UNIQUE_KEY_MAX_LENGTH,
        null=True,
        blank=True,
        help_text=_("Jobs of a fair queue share the workers by this key, by weight."),
    )
    # No CHECK (adding one scans the table): the enqueue refuses a weight out of bounds.
    fair_weight = models.SmallIntegerField(default=1, db_default=1)
    # Debounce and throttle (queue/coalesce.py): at most one pending job per task and
    # coalesce key; an enqueue that finds one joins it. `coalesce_until`: a debounced
    # job's latest run time (its first call's time + `debounce_max_wait`).
    coalesce_key = models.CharField(  # noqa: DJ001  (NULL for "none", as concurrency_key)
        max_length=UNIQUE_KEY_MAX_LENGTH,
        null=True,
        blank=True,
        help_text=_("A debounced or throttled job: the calls that share it join one job."),
    )
    coalesce_until = DateTimeField(null=True, blank=True)
    # Strict order per key (`@task(ordered_key=...)`, queue/base.py claimable_under_limits):
    # NULL for a job that is not ordered; else whether its failure holds the later jobs
    # of its key (True) or lets them go on (False). Its key is its concurrency key.
    order_hold = models.BooleanField(null=True, blank=True)
    cancel_requested_at = DateTimeField(
        null=True, blank=True, help_text=_("An operator asked a running job to stop.")
    )
    # A default in the table too: rows inserted by the enqueue statement or by another
    # client that does not know the column still get "".
    cancelled_by = models.CharField(
        max_length=ACTOR_MAX_LENGTH, blank=True, default="", db_default=""
    )
    worker = models.ForeignKey(
        WorkerProcess,
        null=True,
        blank=True,
        related_name="jobs",
        on_delete=models.DO_NOTHING,
        db_constraint=False,  # worker rows are pruned; jobs keep the id as history
        # Only running jobs are looked up by worker: skipqueue_job_worker_run_idx
        # below. A full index took an entry at every insert, claim and ack (0017).
        db_index=False,
    )
    # Workflows (docs/howto/workflows.md). NULL for a job of no workflow: the trigger
    # that moves a workflow on (migration 0012) skips such rows in its WHEN clause.
    workflow = models.ForeignKey(
        "Workflow",
        null=True,
        blank=True,
        related_name="jobs",
        on_delete=models.DO_NOTHING,
        db_constraint=False,  # no lock on the workflow row per inserted job
        db_index=False,  # skipqueue_job_workflow_idx below holds the jobs that have one
    )
    waiting_on = models.PositiveIntegerField(
        null=True, blank=True, help_text=_("Parents not yet done (a waiting workflow job).")
    )
    dependents = PayloadField(
        null=True, blank=True, help_text=_("The ids of the jobs that wait on this one.")
    )
    inputs = PayloadField(
        null=True,
        blank=True,
        help_text=_("Whose results this job receives as its first argument, read at run time."),
    )
    ends_workflow = models.BooleanField(
        null=True, blank=True, help_text=_("Its result is (part of) its workflow's result.")
    )
    #: The running attempt's `context.set_progress()`: {"done", "total", "note", "at"}
    #: (NULL until a task reports any), written through the fence at most once a second.
    progress = PayloadField(
        null=True, blank=True, help_text=_("What the task reported of its progress.")
    )
    #: The W3C trace context of the span that enqueued it ({"traceparent": ...,
    #: "tracestate": ...}); NULL without OpenTelemetry or outside a span.
    trace_context = PayloadField(null=True, blank=True)
    #: Somebody waits on it (`wait()`): it notifies 'skipqueue!job' when it finishes
    #: (migration 0022; queue/awaiting.py).
    awaited = models.BooleanField(
        default=False,
        db_default=False,
        help_text="Somebody waits on it (Job.wait()): it notifies when it finishes.",
    )

    #: Why a pending job is not due (tasks/durable.py): a durable sleep, or a wait for a
    #: signal; set by the release that parks it, cleared by the claim. "" otherwise.
    parked = models.CharField(
        max_length=8, choices=ParkedOn.choices, blank=True, default="", db_default=""
    )
    #: The name of the step it is parked on: the sleep's, or the signal it waits for.
    parked_step = models.CharField(max_length=200, blank=True, default="", db_default="")

    objects = JobManager()

    class Meta:
        verbose_name = _("job")
        verbose_name_plural = _("jobs")
        permissions = [
            ("retry_job", "Can retry failed or cancelled jobs"),
            ("cancel_job", "Can cancel pending jobs and ask running ones to stop"),
            ("requeue_job", "Can requeue stuck jobs"),
            (
                "view_job_payload",
                "Can see job payloads: arguments, results, error messages and tracebacks, "
                "unique keys, progress notes",
            ),
        ]
        indexes = [
            # The claim: WHERE state = 'pending' AND queue_name = ... AND run_at <= now()
            # ORDER BY priority DESC, run_at, id.
            models.Index(
                fields=["queue_name", *CLAIM_ORDER],
                name="skipqueue_job_claim_idx",
                condition=Q(state="pending"),
            ),
            # The reaper: WHERE state = 'running' AND leased_until < now().
            models.Index(
                fields=["leased_until"],
                name="skipqueue_job_lease_idx",
                condition=Q(state="running"),
            ),
            # A worker's running jobs (the admin's worker pages). Partial: an insert or an
            # ack adds nothing to it, only the claim.
            models.Index(
                fields=["worker"],
                name="skipqueue_job_worker_run_idx",
                condition=Q(state="running"),
            ),
            # The admin's failed filter and the pruning of failed jobs: a small set.
            models.Index(
                fields=["finished_at"],
                name="skipqueue_job_failed_idx",
                condition=Q(state="failed"),
            ),
            # The admin's "repeatedly expired" filter (expirations >= any threshold >= 1).
            models.Index(
                fields=["expirations"],
                name="skipqueue_job_expired_idx",
                condition=Q(expirations__gt=0),
            ),
            # Flow control, the claim of keyed jobs: due jobs with a concurrency key, in
            # claim order. Only keyed pending jobs are in it (empty unless used).
            models.Index(
                fields=["queue_name", *CLAIM_ORDER],
                name="skipqueue_job_keyed_claim_idx",
                condition=Q(state="pending", concurrency_key__isnull=False),
            ),
            # Strict order per key: a key's earlier unfinished (or held failed) jobs, looked
            # up by the claim for each ordered candidate. Only ordered jobs are in it.
            models.Index(
                fields=["concurrency_key", "id"],
                name="skipqueue_job_ordered_idx",
                condition=Q(order_hold__isnull=False),
            ),
            # Fair share, the claim of a fair queue (queue/fair.py): its keys one by one
            # (a loose index scan), then each key's first due jobs in claim order. Only
            # the pending jobs of fair queues without a concurrency key are in it (the
            # fair claim leaves those to the limited claim; empty unless used).
            models.Index(
                fields=["queue_name", "fair_key", *CLAIM_ORDER],
                name="skipqueue_job_fair_claim_idx",
                condition=Q(state="pending", fair_key__isnull=False, concurrency_key__isnull=True),
            ),
            # Flow control, the running jobs of a key (counted under the key's lock).
            models.Index(
                fields=["concurrency_key"],
                name="skipqueue_job_key_running_idx",
                condition=Q(state="running", concurrency_key__isnull=False),
            ),
            # Expiring jobs (`expires`), for the reaper's pass that ends those not
            # started in time. Only unstarted jobs with an expiry are in it.
            models.Index(
                fields=["expires_at"],
                name="skipqueue_job_expires_idx",
                condition=Q(state__in=["pending", "waiting"], expires_at__isnull=False),
            ),
            # A workflow's jobs (its page, its cancel, a resume's parent count).
            models.Index(
                fields=["workflow"],
                name="skipqueue_job_workflow_idx",
                condition=Q(workflow__isnull=False),
            ),
            # Workflow jobs waiting on a parent, per queue (queuestats, the overview).
            models.Index(
                fields=["queue_name"],
                name="skipqueue_job_waiting_idx",
                condition=Q(state="waiting"),
            ),
            # Pruning: WHERE state IN (finished) AND finished_at < ...
            models.Index(
                fields=["finished_at"],
                name="skipqueue_job_finished_idx",
                condition=Q(state__in=["done", "failed", "cancelled"]),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(priority__gte=-100, priority__lte=100),
                name="skipqueue_job_priority_range",
            ),
            models.CheckConstraint(
                condition=Q(state__in=JobState.values), name="skipqueue_job_state_valid"
            ),
            models.CheckConstraint(
                condition=Q(attempts__lte=models.F("max_attempts")),
                name="skipqueue_job_attempt_budget",
            ),
            models.CheckConstraint(
                condition=Q(max_attempts__gte=1), name="skipqueue_job_max_attempts_min"
            ),
            # Unique jobs: at most one unfinished job per task and key, under any number
            # of concurrent enqueues (they INSERT ... ON CONFLICT DO NOTHING on it, so a
            # conflict never aborts the caller's transaction). Partial: finished jobs and
            # jobs without a key are not in it.
            models.UniqueConstraint(
                fields=["task", "unique_key"],
                name="skipqueue_job_unique_key",
                condition=Q(unique_key__isnull=False, state__in=UNFINISHED_STATES),
            ),
            # Debounce and throttle (queue/coalesce.py): one pending job per task and key
            # under any number of concurrent enqueues, the conflict target of their INSERT
            # ... ON CONFLICT. Partial: only pending jobs with a key are in it.
            models.UniqueConstraint(
                fields=["task", "coalesce_key"],
                name="skipqueue_job_coalesce_key",
                condition=Q(state="pending", coalesce_key__isnull=False),
            ),
            # Periodic schedules: each occurrence is enqueued once, however many workers
            # tick the schedule at the same time (scheduler.py).
            models.UniqueConstraint(
                fields=["schedule", "scheduled_for"],
                name="skipqueue_job_occurrence",
                condition=Q(schedule__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        # Never the arguments: they may hold secrets.
        return f"{self.task} #{self.id} ({self.state})"

    def __repr__(self) -> str:
        return f"<Job id={self.id} task={self.task} state={self.state} attempts={self.attempts}>"

    @property
    def is_finished(self) -> bool:
        return self.state in FINISHED_STATES

    @property
    def idempotency_key(self) -> str:
        """Stable across every attempt of this job: hand it to external services."""
        return idempotency_key_of(self.id)

    @property
    def progress_fraction(self) -> float | None:
        """done / total of the last progress report, 0 to 1 (None: no report, or no
        total)."""
        report = self.progress if isinstance(self.progress, dict) else {}
        done, total = report.get("done"), report.get("total")
        if not isinstance(done, (int, float)) or not isinstance(total, (int, float)):
            return None
        return min(max(done / total, 0.0), 1.0) if total > 0 else None

    def describe_progress(self) -> str:
        """The last progress report in words: "40 of 100 (40 %): page 3" ("" if none).
        A report of an earlier attempt says so."""
        report = self.progress if isinstance(self.progress, dict) else None
        if report is None:
            return ""
        done, total, note = report.get("done"), report.get("total"), report.get("note")
        text = f"{done:g}" if isinstance(done, (int, float)) else "?"
        if isinstance(total, (int, float)):
            text += f" of {total:g}"
            fraction = self.progress_fraction
            if fraction is not None:
                text += f" ({fraction:.0%})"
        if note:
            text += f": {note}"
        attempt = report.get("attempt")
        if isinstance(attempt, int) and attempt != self.attempts:
            text += f" (attempt {attempt})"
        return text

    def send_signal(self, name: str, payload: Any = None) -> int:
        """Send the signal `name` to this durable job, in the caller's transaction: its
        `context.wait_for(name)` returns `payload` (`Job.objects.send_signal`)."""
        return int(Job.objects.db_manager(self._state.db).send_signal(self.id, name, payload))

    def wait(self, timeout: float | None = None, *, allow_in_task: bool = False) -> Any:
        """Block until this job finishes and return its result, as Celery's
        `AsyncResult.get(timeout=)` does; `await_result()` in async code.

        JobFailed if it ended failed (its last error) or cancelled (by whom),
        TimeoutError after `timeout` seconds; the job's state, result and last error are
        read again. Woken by a NOTIFY when it finishes, through one LISTEN connection the
        process's waiters share, with a poll each second as the fallback; never holds a
        transaction while it waits. Refused at once (TransactionManagementError) inside
        the transaction that enqueued it: no worker can see the job before that commits.
        Refused inside a task (RuntimeError: the job waited on may need this very worker
        thread; chain them), unless `allow_in_task` says its queue's workers are others."""
        manager = Job.objects.db_manager(self._state.db)
        return manager.wait_for(self, timeout, allow_in_task=allow_in_task)


class Workflow(Waitable, models.Model):
    """Jobs enqueued together as chains, groups and chords (docs/howto/workflows.md).

    The handle `.enqueue()` of a chain, group or chord returns; found again by id from
    any process (`Workflow.objects.get(id=...)`). Its jobs move it on in the database
    itself: a trigger on the job table (migration 0012) makes a dependent due in the
    transaction that records its last parent's success, ends dependents of a failed or
    cancelled job, and ends the workflow when its last result is in.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=255, blank=True, default="")
    state = models.CharField(
        max_length=16, choices=WorkflowState.choices, default=WorkflowState.RUNNING
    )
    #: Whose results make the workflow's result: a job id, or a list of such trees.
    output = PayloadField(null=True, blank=True)
    outputs_left = models.PositiveIntegerField(
        default=0, help_text=_("Jobs whose result is part of the workflow's and not yet done.")
    )
    on_error_job_id = models.BigIntegerField(null=True, blank=True)
    failed_job_id = models.BigIntegerField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    created_at = DateTimeField(db_default=Now())
    finished_at = DateTimeField(null=True, blank=True)

    objects = WorkflowManager()

    class Meta:
        verbose_name = _("workflow")
        verbose_name_plural = _("workflows")
        ordering = ("-id",)
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=WorkflowState.values), name="skipqueue_workflow_state"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name or 'workflow'} #{self.id} ({self.state})"

    @property
    def is_finished(self) -> bool:
        return self.state != WorkflowState.RUNNING

    @property
    def result(self) -> Any:
        """The workflow's result once done (a chain's last result, a group's list...);
        WorkflowFailed if it failed or was cancelled, WorkflowNotFinished before."""
        return Workflow.objects.db_manager(self._state.db).result_of(self)

    def progress(self) -> dict[str, Any]:
        """How far the workflow has come: its jobs counted by state, and the progress
        its running jobs reported (`context.set_progress`), in one query of its jobs."""
        jobs = Job.objects.using(self._state.db).filter(workflow_id=self.id)
        counts: dict[str, int] = {}
        running = []
        for job in jobs.only("id", "task", "state", "attempts", "progress").order_by("id"):
            counts[job.state] = counts.get(job.state, 0) + 1
            if job.state == JobState.RUNNING and job.progress:
                running.append({"id": job.id, "task": job.task, "progress": job.progress})
        total = sum(counts.values())
        return {
            "jobs": total,
            "by_state": counts,
            "done": counts.get(JobState.DONE, 0),
            "running": running,
        }

    def wait(self, timeout: float | None = None, *, allow_in_task: bool = False) -> Any:
        """Block until the workflow finishes and return its result (see `result`).

        Woken by a NOTIFY when a workflow finishes, with a poll as the fallback; raises
        TimeoutError after `timeout` seconds. Never holds a transaction while waiting.
        Refused inside a task unless `allow_in_task` (as `Job.wait()`)."""
        manager = Workflow.objects.db_manager(self._state.db)
        return manager.wait_for(self, timeout, allow_in_task=allow_in_task)


class Queue(models.Model):
    """A queue's flow-control state: an operator's pause, and the token bucket of its
    rate limit (SKIPQUEUE['QUEUE_LIMITS']). A row exists once a queue is paused or
    claimed under a limit; a queue without one is simply running."""

    name = models.CharField(primary_key=True, max_length=QUEUE_NAME_MAX_LENGTH)
    paused_at = DateTimeField(null=True, blank=True)
    paused_by = models.CharField(max_length=ACTOR_MAX_LENGTH, blank=True, default="")
    rate_tokens = models.FloatField(
        default=0.0, help_text=_("Job starts the rate limit allows now (a token bucket).")
    )
    rate_refilled_at = DateTimeField(null=True, blank=True)
    created_at = DateTimeField(db_default=Now())

    objects = QueueManager()

    class Meta:
        verbose_name = _("queue")
        verbose_name_plural = _("queues")
        ordering = ("name",)
        permissions = [("pause_queue", "Can pause and resume queues")]

    def __str__(self) -> str:
        return self.name

    @property
    def is_paused(self) -> bool:
        return self.paused_at is not None


class RateBucket(models.Model):
    """The token bucket of a task's rate limit (`@task(rate_limit=...)`), shared by every
    worker: created at the first claim of one of its jobs, locked by each claim that
    takes some (FOR UPDATE SKIP LOCKED), refilled on the database clock."""

    key = models.CharField(primary_key=True, max_length=UNIQUE_KEY_MAX_LENGTH)
    tokens = models.FloatField(
        default=0.0, help_text=_("Job starts the rate limit allows now (a token bucket).")
    )
    refilled_at = DateTimeField(null=True, blank=True)
    #: When the bucket next holds a start, if it holds none now: the claim leaves the
    #: task's jobs out of its candidates until then, so that a backlog of them never
    #: hides the other jobs it could take (the count is made again under the lock).
    empty_until = DateTimeField(null=True, blank=True)

    objects = RateBucketManager()

    class Meta:
        verbose_name = _("rate bucket")
        verbose_name_plural = _("rate buckets")

    def __str__(self) -> str:
        return self.key


class QueueOverview(Job):
    """No table of its own: the admin index's entry for the queue overview page (see
    admin.QueueOverviewAdmin). Viewing it takes the permission to view jobs."""

    class Meta:
        proxy = True
        verbose_name = _("queue overview")
        verbose_name_plural = _("queue overview")
        default_permissions = ()


class TaskOverview(Job):
    """No table of its own: the admin index's entry for the task overview page (see
    admin.TaskOverviewAdmin). Viewing it takes the permission to view jobs."""

    class Meta:
        proxy = True
        verbose_name = _("task overview")
        verbose_name_plural = _("task overview")
        default_permissions = ()


class Schedule(models.Model):
    """A periodic schedule declared in code (`@task(schedule=...)` or SKIPQUEUE['SCHEDULES']).

    The code is the source of the definition; a worker copies it here when it starts
    (`scheduler.sync`) and deletes the rows of schedules no longer in the code. What the
    row adds is the state: the last occurrence enqueued, and whether an operator paused it.
    """

    name = models.CharField(primary_key=True, max_length=SCHEDULE_NAME_MAX_LENGTH)
    task = models.CharField(max_length=255)
    expression = models.CharField(max_length=255, help_text=_("The cron expression."))
    timezone = models.CharField(max_length=64)
    args = PayloadField(default=list, blank=True)
    kwargs = PayloadField(default=dict, blank=True)
    queue_name = models.CharField(max_length=QUEUE_NAME_MAX_LENGTH)
    priority = models.SmallIntegerField(default=0)
    missed = models.CharField(
        max_length=16,
        choices=[(policy, policy) for policy in MISSED_POLICIES],
        default="latest",
        help_text=_("What happens to occurrences no worker enqueued in time."),
    )
    catch_up = models.PositiveIntegerField(default=10)
    grace = models.FloatField(
        default=60.0, help_text=_("Seconds late an occurrence may be and still count on time.")
    )
    last_occurrence_at = DateTimeField(
        null=True, blank=True, help_text=_("The latest occurrence enqueued or passed over.")
    )
    paused_at = DateTimeField(null=True, blank=True)
    paused_by = models.CharField(max_length=ACTOR_MAX_LENGTH, blank=True, default="")
    created_at = DateTimeField(db_default=Now())
    synced_at = DateTimeField(
        db_default=Now(), help_text=_("When a worker last copied the definition from code.")
    )

    objects = ScheduleManager()

    class Meta:
        verbose_name = _("schedule")
        verbose_name_plural = _("schedules")
        ordering = ("name",)
        permissions = [("pause_schedule", "Can pause and resume schedules")]

    def __str__(self) -> str:
        return self.name

    @property
    def is_paused(self) -> bool:
        return self.paused_at is not None


#: Upper bounds (seconds) of the pickup-delay buckets a QueueMinute counts, the last one
#: open-ended. Fixed: a row's `pickup_buckets` holds one count per bound, in this order.
PICKUP_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    3600.0,
    float("inf"),
)


class Outcomes(models.Model):
    """The counts of attempts ended, by outcome (runner.Outcome's values), that a
    QueueMinute and a TaskMinute row hold alike."""

    succeeded = models.PositiveIntegerField(default=0)
    retried = models.PositiveIntegerField(default=0)
    #: Attempts the task gave back (`Retry`): not failures.
    released = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    cancelled = models.PositiveIntegerField(default=0)
    #: Outcomes the fence refused: the attempt had lost the job.
    lost = models.PositiveIntegerField(default=0)
    unknown = models.PositiveIntegerField(default=0)
    #: Attempts ended, whatever their outcome, and the seconds they ran in all.
    runs = models.PositiveIntegerField(default=0)
    run_seconds = models.FloatField(default=0.0)

    class Meta:
        abstract = True


class QueueMinute(Outcomes):
    """What one queue did in one minute, as its workers counted it: the overview's
    charts read these rows, never the job table. Each worker adds its counts every few
    seconds (one upsert per queue and minute, `runtime/minutes.py`); the reaper's pass
    adds the oldest due job's age. Rows older than MINUTES_KEPT_HOURS are deleted."""

    id = models.BigAutoField(primary_key=True)
    queue_name = models.CharField(max_length=QUEUE_NAME_MAX_LENGTH)
    minute = DateTimeField(help_text=_("The minute's start (database clock)."))
    #: Pickup delays (due to started): how many, their sum, and one count per bucket
    #: of PICKUP_BUCKETS.
    pickups = models.PositiveIntegerField(default=0)
    pickup_seconds = models.FloatField(default=0.0)
    pickup_buckets = PayloadField(default=list)
    #: The largest age of the oldest due job seen in this minute (None: not sampled).
    oldest_due_seconds = models.FloatField(null=True, blank=True)

    objects = QueueMinuteManager()

    class Meta:
        verbose_name = _("queue minute")
        verbose_name_plural = _("queue minutes")
        constraints = [
            models.UniqueConstraint(
                fields=["queue_name", "minute"], name="skipqueue_queueminute_key"
            )
        ]
        indexes = [models.Index(fields=["minute"], name="skipqueue_queueminute_idx")]

    def __str__(self) -> str:
        return f"{self.queue_name} {self.minute:%Y-%m-%d %H:%M}"


#: Upper bounds (seconds) of the run-duration buckets a TaskMinute counts, the last one
#: open-ended. Fixed: a row's `run_buckets` holds one count per bound, in this order.
DURATION_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    float("inf"),
)

#: How much of an error's "type: message" a TaskMinute keeps as its last error.
LAST_ERROR_MAX_CHARS = 500


class TaskMinute(Outcomes):
    """What one task did in one minute, as the workers that ran it counted it: the task
    overview reads these rows, never the job table, so that it costs the same at 10,000
    jobs and at 10 million. Written with the QueueMinute rows, in the same transaction
    (`runtime/meter.py`); deleted with them after MINUTES_KEPT_HOURS."""

    id = models.BigAutoField(primary_key=True)
    task = models.CharField(max_length=255)
    minute = DateTimeField(help_text=_("The minute's start (database clock)."))
    #: One count per bucket of DURATION_BUCKETS: how long the attempts ran.
    run_buckets = PayloadField(default=list)
    #: The newest failed attempt's "type: message" (LAST_ERROR_MAX_CHARS at most), its
    #: job and when a worker wrote it: a payload (shown with view_job_payload only).
    last_error = models.TextField(blank=True, default="")
    last_error_job = models.BigIntegerField(null=True, blank=True)
    last_error_at = DateTimeField(null=True, blank=True)

    objects = TaskMinuteManager()

    class Meta:
        verbose_name = _("task minute")
        verbose_name_plural = _("task minutes")
        constraints = [
            models.UniqueConstraint(fields=["task", "minute"], name="skipqueue_taskminute_key")
        ]
        indexes = [models.Index(fields=["minute"], name="skipqueue_taskminute_idx")]

    def __str__(self) -> str:
        return f"{self.task} {self.minute:%Y-%m-%d %H:%M}"


class StepKind(models.TextChoices):
    PLAIN = "plain", _("plain")  # context.step(): at least once
    ATOMIC = "atomic", _("atomic")  # context.atomic_step(): its writes commit with it
    SLEEP = "sleep", _("sleep")  # context.sleep(): the job given back until its time
    SIGNAL = "signal", _("signal")  # context.wait_for(): the job given back until it comes


class Step(models.Model):
    """A durable job's checkpoint (docs/howto/durable-jobs.md): a step its task ran and
    recorded, whose result every later attempt of the job gets back instead of running it
    again. Written only through the fence (queue/steps.sql, RECORD_STEP); deleted with
    its job (a foreign key ON DELETE CASCADE, migration 0025), or by an operator's
    restart from an earlier step."""

    id = models.BigAutoField(primary_key=True)
    #: The database cascades a job's deletion (migration 0025); the unique key below,
    #: which starts with it, is its index.
    job = models.ForeignKey(
        Job,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="steps",
    )
    #: Its place among the job's steps, from 1: the n-th step an attempt meets must be
    #: the n-th recorded.
    position = models.PositiveIntegerField()
    name = models.CharField(max_length=200)
    #: The how-many-th call of this name in the task (a step in a loop), from 1.
    occurrence = models.PositiveIntegerField(default=1)
    kind = models.CharField(max_length=16, choices=StepKind.choices, default=StepKind.PLAIN)
    #: The attempt that recorded it.
    attempt = models.PositiveIntegerField()
    started_at = DateTimeField()
    recorded_at = DateTimeField()
    #: Its return value (a sleep's: its length in seconds), under the result rules.
    result = PayloadField(null=True, blank=True)

    class Meta:
        verbose_name = _("step")
        verbose_name_plural = _("steps")
        constraints = [
            models.UniqueConstraint(fields=["job", "position"], name="skipqueue_step_key")
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} step {self.position} {self.name}"


class Signal(models.Model):
    """A signal sent to a job (`send_signal`) that no wait of it has taken yet: kept
    until its job's next `context.wait_for()` of that name takes it (the oldest first,
    each by one wait), which deletes it and records its payload as that step's result,
    in one fenced statement (queue/steps.sql, TAKE_SIGNAL). Deleted with its job (a
    foreign key ON DELETE CASCADE, migration 0026)."""

    id = models.BigAutoField(primary_key=True)
    #: The database cascades a job's deletion (migration 0026); the index below, which
    #: starts with it, is its index.
    job = models.ForeignKey(
        Job,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        db_index=False,
        related_name="signals",
    )
    name = models.CharField(max_length=200)
    payload = PayloadField(null=True, blank=True)
    sent_at = DateTimeField(db_default=Now())

    class Meta:
        verbose_name = _("signal")
        verbose_name_plural = _("signals")
        indexes = [models.Index(fields=["job", "name", "id"], name="skipqueue_signal_taken")]

    def __str__(self) -> str:
        return f"signal {self.name} to job {self.job_id}"
