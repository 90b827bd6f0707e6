# Strict order per key (issue 56, docs/howto/flow-control.md): the job's `order_hold`
# (NULL unless ordered). Nullable with no default: a catalogue change only, under a short
# lock that waits at most LOCK_TIMEOUT; past that the migration fails, changing nothing.
# The index is 0032's.

from django.db import migrations, models

LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s';"


class Migration(migrations.Migration):
    dependencies = [
        ("skipqueue", "0030_coalesce_key_index"),
    ]

    operations = [
        migrations.RunSQL(LOCK_TIMEOUT, migrations.RunSQL.noop),
        migrations.AddField(
            model_name="job",
            name="order_hold",
            field=models.BooleanField(blank=True, null=True),
        ),
        migrations.RunSQL(migrations.RunSQL.noop, LOCK_TIMEOUT),
    ]
