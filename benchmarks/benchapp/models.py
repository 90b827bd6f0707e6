from django.db import models
from django.db.models.functions import Now


class BareJob(models.Model):
    """A row shaped like skipqueue_job, for the bare create() baseline of the enqueue part."""

    task = models.CharField(max_length=255)
    args = models.JSONField(default=list)
    kwargs = models.JSONField(default=dict)
    queue_name = models.CharField(max_length=48, default="default")
    priority = models.SmallIntegerField(default=0)
    state = models.CharField(max_length=16, default="pending")
    run_at = models.DateTimeField(db_default=Now())
    lease = models.DurationField()
    max_attempts = models.PositiveIntegerField(default=5)
    created_at = models.DateTimeField(db_default=Now())

    def __str__(self) -> str:
        return self.task


class Pickup(models.Model):
    """When a latency probe's body started, by the shared machine clock (time.time())."""

    trial = models.PositiveIntegerField()
    started = models.FloatField()

    def __str__(self) -> str:
        return f"trial {self.trial}"


class Execution(models.Model):
    """One run of a `recorded` job's body (counts duplicate executions after SIGKILL)."""

    job_id = models.BigIntegerField()
    attempt = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt}"
