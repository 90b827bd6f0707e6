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
