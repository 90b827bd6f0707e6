# Strict order per key (issue 56): the ordered jobs by key and id, for the claim's look at
# a candidate's earlier jobs. Partial (ordered jobs only) and built CONCURRENTLY (this
# migration is not atomic), so that enqueues and claims go on while it is built.

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY

    dependencies = [
        ("skipqueue", "0031_ordered_keys"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(("order_hold__isnull", False)),
                fields=["concurrency_key", "id"],
                name="skipqueue_job_ordered_idx",
            ),
        ),
    ]
