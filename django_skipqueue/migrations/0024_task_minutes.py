# The task overview (issue 54): TaskMinute, what each task did in each minute, written
# by the workers with the QueueMinute rows; TaskOverview, the admin index's entry.
#
# skipqueue_add_buckets(a, b) adds two histograms (jsonb arrays of counts) element by
# element, a missing element counting 0 (a row written by an older worker may hold fewer
# buckets): the per-minute upserts use it, the queue's pickup delays and the task's run
# durations alike. Nothing here locks a table of ours: a new table and a new function.

import django_skipqueue.core.payload
from django.db import migrations, models

FORWARD = """
CREATE OR REPLACE FUNCTION skipqueue_add_buckets(a jsonb, b jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT COALESCE(jsonb_agg(COALESCE(x.n::bigint, 0) + COALESCE(y.n::bigint, 0)
                              ORDER BY COALESCE(x.i, y.i)), '[]'::jsonb)
    FROM jsonb_array_elements_text(
            CASE WHEN jsonb_typeof(a) = 'array' THEN a ELSE '[]'::jsonb END)
            WITH ORDINALITY AS x(n, i)
    FULL JOIN jsonb_array_elements_text(
            CASE WHEN jsonb_typeof(b) = 'array' THEN b ELSE '[]'::jsonb END)
            WITH ORDINALITY AS y(n, i) ON x.i = y.i
$$;
"""

BACKWARD = """
DROP FUNCTION IF EXISTS skipqueue_add_buckets(jsonb, jsonb);
"""


class Migration(migrations.Migration):

    dependencies = [
        ('skipqueue', '0023_long_queue_names'),
    ]

    operations = [
        migrations.RunSQL(FORWARD, BACKWARD),
        migrations.CreateModel(
            name='TaskOverview',
            fields=[
            ],
            options={
                'verbose_name': 'task overview',
                'verbose_name_plural': 'task overview',
                'proxy': True,
                'default_permissions': (),
                'indexes': [],
                'constraints': [],
            },
            bases=('skipqueue.job',),
        ),
        migrations.CreateModel(
            name='TaskMinute',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('task', models.CharField(max_length=255)),
                ('minute', models.DateTimeField(help_text="The minute's start (database clock).")),
                ('succeeded', models.PositiveIntegerField(default=0)),
                ('retried', models.PositiveIntegerField(default=0)),
                ('released', models.PositiveIntegerField(default=0)),
                ('failed', models.PositiveIntegerField(default=0)),
                ('cancelled', models.PositiveIntegerField(default=0)),
                ('lost', models.PositiveIntegerField(default=0)),
                ('unknown', models.PositiveIntegerField(default=0)),
                ('runs', models.PositiveIntegerField(default=0)),
                ('run_seconds', models.FloatField(default=0.0)),
                ('run_buckets', django_skipqueue.core.payload.PayloadField(default=list)),
                ('last_error', models.TextField(blank=True, default='')),
                ('last_error_job', models.BigIntegerField(blank=True, null=True)),
                ('last_error_at', models.DateTimeField(blank=True, null=True)),
            ],
            options={
                'verbose_name': 'task minute',
                'verbose_name_plural': 'task minutes',
                'indexes': [models.Index(fields=['minute'], name='skipqueue_taskminute_idx')],
                'constraints': [models.UniqueConstraint(fields=('task', 'minute'), name='skipqueue_taskminute_key')],
            },
        ),
    ]
