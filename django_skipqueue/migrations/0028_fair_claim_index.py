# Fair share within a queue (issue 56), its index: a fair queue's pending jobs by key, in
# claim order (the fair claim's walk over the keys and each key's first jobs,
# queue/fair.py). Partial: only fair queues' pending jobs are in it, so other jobs pay
# nothing for it. Built CONCURRENTLY (this migration is not atomic), so that enqueues
# and claims go on while it is built on a large table.

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY

    dependencies = [
        ("skipqueue", "0027_fair_share"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(
                    ("concurrency_key__isnull", True), ("fair_key__isnull", False), ("state", "pending")
                ),
                fields=["queue_name", "fair_key", "-priority", "run_at", "id"],
                name="skipqueue_job_fair_claim_idx",
            ),
        ),
    ]
