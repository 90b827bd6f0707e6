# Observability (issue 28):
#
# - Job.progress: what a running task reported (`context.set_progress()`).
# - Job.trace_context: the W3C trace context of the span that enqueued the job.
# - WorkerProcess.kind and stopped_at: broker consumers and relays are listed beside the
#   workers; a clean stop is told from a lost process.
# - QueueMinute: per queue and minute, what the workers counted (the admin's charts).
#
# Every new job column is nullable with no default, and `kind`'s default is a constant:
# adding them rewrites no table.

import django_skipqueue.core.payload
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('skipqueue', '0014_rate_limits'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='progress',
            field=django_skipqueue.core.payload.PayloadField(blank=True, help_text='What the task reported of its progress.', null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='trace_context',
            field=django_skipqueue.core.payload.PayloadField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='workerprocess',
            name='kind',
            field=models.CharField(choices=[('worker', 'worker'), ('consumer', 'broker consumer'), ('relay', 'relay')], db_default='worker', default='worker', max_length=16),
        ),
        migrations.AddField(
            model_name='workerprocess',
            name='stopped_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name='QueueMinute',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('queue_name', models.CharField(max_length=48)),
                ('minute', models.DateTimeField(help_text="The minute's start (database clock).")),
                ('succeeded', models.PositiveIntegerField(default=0)),
                ('retried', models.PositiveIntegerField(default=0)),
                ('released', models.PositiveIntegerField(default=0)),
                ('failed', models.PositiveIntegerField(default=0)),
                ('cancelled', models.PositiveIntegerField(default=0)),
                ('lost', models.PositiveIntegerField(default=0)),
                ('unknown', models.PositiveIntegerField(default=0)),
                ('pickups', models.PositiveIntegerField(default=0)),
                ('pickup_seconds', models.FloatField(default=0.0)),
                ('pickup_buckets', django_skipqueue.core.payload.PayloadField(default=list)),
                ('runs', models.PositiveIntegerField(default=0)),
                ('run_seconds', models.FloatField(default=0.0)),
                ('oldest_due_seconds', models.FloatField(blank=True, null=True)),
            ],
            options={
                'verbose_name': 'queue minute',
                'verbose_name_plural': 'queue minutes',
                'indexes': [models.Index(fields=['minute'], name='skipqueue_queueminute_idx')],
                'constraints': [models.UniqueConstraint(fields=('queue_name', 'minute'), name='skipqueue_queueminute_key')],
            },
        ),
    ]
