# Debounce and throttle (issue 56): one pending job per task and coalesce key, a partial
# unique index built CONCURRENTLY (this migration is not atomic), so that enqueues and
# claims go on while it is built; Django's state gets the constraint it is.

from django.db import migrations, models

CREATE = (
    "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS skipqueue_job_coalesce_key "
    "ON skipqueue_job (task, coalesce_key) "
    "WHERE coalesce_key IS NOT NULL AND state = 'pending'"
)
DROP = "DROP INDEX CONCURRENTLY IF EXISTS skipqueue_job_coalesce_key"


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY

    dependencies = [
        ("skipqueue", "0029_coalesce"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunSQL(CREATE, DROP)],
            state_operations=[
                migrations.AddConstraint(
                    model_name="job",
                    constraint=models.UniqueConstraint(
                        condition=models.Q(("coalesce_key__isnull", False), ("state", "pending")),
                        fields=("task", "coalesce_key"),
                        name="skipqueue_job_coalesce_key",
                    ),
                ),
            ],
        ),
    ]
