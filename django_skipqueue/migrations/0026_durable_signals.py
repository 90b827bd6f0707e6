# Durable signals (issue 55): `send_signal(job_id, name, payload)` keeps a signal in
# skipqueue_signal until the job's `context.wait_for(name)` takes it; a job parked on a
# durable sleep or a wait says so in `parked` and `parked_step` (the counts of the
# overview and queuestats, the sender's wake-up: queue/signals.py).
#
# The new columns have a constant default, and no CHECK: adding them rewrites and scans
# nothing, but takes a lock on the job table that conflicts with every
# write; it waits at most LOCK_TIMEOUT, and past that the migration fails, changing
# nothing, and can be run again.

import django.db.models.deletion
import django.db.models.functions.datetime
import django_skipqueue.core.payload
from django.db import migrations, models

LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s';"

FOREIGN_KEY = """
ALTER TABLE skipqueue_signal ADD CONSTRAINT skipqueue_signal_job_fk
    FOREIGN KEY (job_id) REFERENCES skipqueue_job (id) ON DELETE CASCADE;
"""

DROP_FOREIGN_KEY = "ALTER TABLE skipqueue_signal DROP CONSTRAINT skipqueue_signal_job_fk;"


class Migration(migrations.Migration):
    dependencies = [
        ("skipqueue", "0025_durable_steps"),
    ]

    operations = [
        migrations.RunSQL(LOCK_TIMEOUT, migrations.RunSQL.noop),
        migrations.AddField(
            model_name="job",
            name="parked",
            field=models.CharField(
                blank=True,
                choices=[("sleep", "sleeping"), ("signal", "awaiting a signal")],
                db_default="",
                default="",
                max_length=8,
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="parked_step",
            field=models.CharField(blank=True, db_default="", default="", max_length=200),
        ),
        migrations.AlterField(
            model_name="step",
            name="kind",
            field=models.CharField(
                choices=[
                    ("plain", "plain"),
                    ("atomic", "atomic"),
                    ("sleep", "sleep"),
                    ("signal", "signal"),
                ],
                default="plain",
                max_length=16,
            ),
        ),
        migrations.CreateModel(
            name="Signal",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("name", models.CharField(max_length=200)),
                (
                    "payload",
                    django_skipqueue.core.payload.PayloadField(blank=True, null=True),
                ),
                (
                    "sent_at",
                    models.DateTimeField(db_default=django.db.models.functions.datetime.Now()),
                ),
                (
                    "job",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="signals",
                        to="skipqueue.job",
                    ),
                ),
            ],
            options={
                "verbose_name": "signal",
                "verbose_name_plural": "signals",
                "indexes": [
                    models.Index(fields=["job", "name", "id"], name="skipqueue_signal_taken")
                ],
            },
        ),
        migrations.RunSQL(FOREIGN_KEY, DROP_FOREIGN_KEY),
        # Unapplied first, when migrating back: the same bound for the way back.
        migrations.RunSQL(migrations.RunSQL.noop, LOCK_TIMEOUT),
    ]
