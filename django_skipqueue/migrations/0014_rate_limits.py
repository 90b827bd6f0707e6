# Rate limits per task (`@task(rate_limit="10/m")`, issue 27): a job of a rate-limited
# task carries its rate key (the task's name) and limit, and the claim takes it under
# its task's token bucket (the new table skipqueue_ratebucket), across every worker.
#
# - Both columns are nullable with no default: adding them rewrites nothing.
# - The claim index of rate-limited jobs is partial (empty unless used) and built
#   CONCURRENTLY, so that claims and enqueues go on meanwhile (not atomic).

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY

    dependencies = [
        ('skipqueue', '0013_job_expires_at'),
    ]

    operations = [
        migrations.CreateModel(
            name='RateBucket',
            fields=[
                ('key', models.CharField(max_length=255, primary_key=True, serialize=False)),
                ('tokens', models.FloatField(default=0.0, help_text='Job starts the rate limit allows now (a token bucket).')),
                ('refilled_at', models.DateTimeField(blank=True, null=True)),
            ],
            options={
                'verbose_name': 'rate bucket',
                'verbose_name_plural': 'rate buckets',
            },
        ),
        migrations.AddField(
            model_name='job',
            name='rate_key',
            field=models.CharField(blank=True, help_text='Jobs sharing a rate key start at most rate_limit times per period.', max_length=255, null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='rate_limit',
            field=models.CharField(blank=True, max_length=32, null=True),
        ),
        AddIndexConcurrently(
            model_name='job',
            index=models.Index(condition=models.Q(('rate_key__isnull', False), ('state', 'pending')), fields=['queue_name', '-priority', 'run_at', 'id'], name='skipqueue_job_rated_claim_idx'),
        ),
    ]
