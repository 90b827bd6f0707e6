# Debounce and throttle (issue 56, docs/howto/flow-control.md): the job's columns
# `coalesce_key` (NULL unless debounced or throttled) and `coalesce_until`. The unique
# index that makes one pending job per task and key is 0030's.
#
# Both columns are nullable with no default: adding them rewrites and scans nothing,
# but takes a short lock on the job table that conflicts with every write; it waits at
# most LOCK_TIMEOUT, and past that the migration fails, changing nothing.

import django_skipqueue.queue.fields
from django.db import migrations, models

LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s';"


class Migration(migrations.Migration):
    dependencies = [
        ("skipqueue", "0028_fair_claim_index"),
    ]

    operations = [
        migrations.RunSQL(LOCK_TIMEOUT, migrations.RunSQL.noop),
        migrations.AddField(
            model_name="job",
            name="coalesce_key",
            field=models.CharField(
                blank=True,
                help_text="A debounced or throttled job: the calls that share it join one job.",
                max_length=255,
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="coalesce_until",
            field=django_skipqueue.queue.fields.DateTimeField(blank=True, null=True),
        ),
        migrations.RunSQL(migrations.RunSQL.noop, LOCK_TIMEOUT),
    ]
