from django.db import models
from django.db.models.functions import Now


class Run(models.Model):
    """One execution of a test task's body: written before the ack, so it survives a lost ack."""

    job_id = models.BigIntegerField()
    attempt = models.PositiveIntegerField()
    pid = models.PositiveIntegerField()
    at = models.DateTimeField(db_default=Now())

    class Meta:
        indexes = [models.Index(fields=["job_id"], name="testapp_run_job_idx")]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt} (pid {self.pid})"


class Effect(models.Model):
    """A task's side effect, unique per job: a second insert is a duplicate effect."""

    job_id = models.BigIntegerField(unique=True)

    def __str__(self) -> str:
        return f"effect of job {self.job_id}"


class DuplicateEffect(models.Model):
    job_id = models.BigIntegerField()
    attempt = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"duplicate effect of job {self.job_id} attempt {self.attempt}"


class JobAudit(models.Model):
    """Every state change of a job, written by a trigger (tests only; see migration 0002)."""

    job_id = models.BigIntegerField()
    old_state = models.CharField(max_length=16)
    new_state = models.CharField(max_length=16)
    old_attempts = models.PositiveIntegerField()
    new_attempts = models.PositiveIntegerField()
    old_expirations = models.PositiveIntegerField()
    new_expirations = models.PositiveIntegerField()
    new_releases = models.PositiveIntegerField()
    worker_id = models.UUIDField(null=True)
    at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["job_id"], name="testapp_audit_job_idx")]

    def __str__(self) -> str:
        return f"job {self.job_id}: {self.old_state} -> {self.new_state}"


class Span(models.Model):
    """When a test task's body ran, on the database clock: overlaps are concurrency."""

    job_id = models.BigIntegerField()
    key = models.CharField(max_length=100, blank=True, default="")
    started_at = models.DateTimeField(db_default=Now())
    ended_at = models.DateTimeField(null=True)

    def __str__(self) -> str:
        return f"job {self.job_id} ran {self.started_at} to {self.ended_at}"


class StateViolation(models.Model):
    """A change of a job that the protocol never makes, recorded by the state guard
    (migration 0005, from django_skipqueue.core.states.TRANSITIONS). Every test fails on one."""

    job_id = models.BigIntegerField()
    old_state = models.CharField(max_length=16)
    new_state = models.CharField(max_length=16)
    problem = models.CharField(max_length=100)
    statement = models.TextField()
    at = models.DateTimeField(db_default=Now())

    def __str__(self) -> str:
        return f"job {self.job_id}: {self.old_state} -> {self.new_state}: {self.problem}"


class StepRun(models.Model):
    """One run of a durable test task's step body (tests/tasks/test_durable.py, the
    durable fault test): no unique key, so that a step run twice leaves two rows."""

    job_id = models.BigIntegerField()
    step = models.CharField(max_length=100)
    attempt = models.PositiveIntegerField()
    at = models.DateTimeField(db_default=Now())

    class Meta:
        indexes = [models.Index(fields=["job_id"], name="testapp_steprun_job_idx")]

    def __str__(self) -> str:
        return f"job {self.job_id} step {self.step} attempt {self.attempt}"
