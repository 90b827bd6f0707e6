# Fair share within a queue (issue 56, docs/howto/flow-control.md), its columns: the job's
# `fair_key` (NULL outside a fair queue) and `fair_weight`. The index is 0028's.
#
# The columns add no rewrite and no scan: `fair_key` is nullable with no default,
# `fair_weight` has a constant default and no CHECK. Adding them takes a short lock on
# the job table that conflicts with every write; it waits at most LOCK_TIMEOUT, and
# past that the migration fails, changing nothing, and can be run again.

from django.db import migrations, models

LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s';"


class Migration(migrations.Migration):
    dependencies = [
        ("skipqueue", "0026_durable_signals"),
    ]

    operations = [
        migrations.RunSQL(LOCK_TIMEOUT, migrations.RunSQL.noop),
        migrations.AddField(
            model_name="job",
            name="fair_key",
            field=models.CharField(
                blank=True,
                help_text="Jobs of a fair queue share the workers by this key, by weight.",
                max_length=255,
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="fair_weight",
            field=models.SmallIntegerField(db_default=1, default=1),
        ),
        migrations.RunSQL(migrations.RunSQL.noop, LOCK_TIMEOUT),
    ]
