"""Partial indexes for the admin's failed and repeatedly-expired filters (T45).

Both sets are small, and a partial index takes an entry only for rows matching its
predicate, so other writes do not pay for them. Built CONCURRENTLY: the table may be
large and busy when this migration runs.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [("skipqueue", "0004_job_permissions")]

    operations = [
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(("state", "failed")),
                fields=["finished_at"],
                name="skipqueue_job_failed_idx",
            ),
        ),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(("expirations__gt", 0)),
                fields=["expirations"],
                name="skipqueue_job_expired_idx",
            ),
        ),
    ]
