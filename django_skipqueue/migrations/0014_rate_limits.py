# Rate limits per task (`@task(rate_limit="10/m")`, issue 27): a job of a rate-limited
# task carries its rate key (the task's name) and limit, and the claim takes it under
# its task's token bucket (the new table skipqueue_ratebucket), across every worker.
#
# - Both columns are nullable with no default: adding them rewrites nothing.
# - No index: a rate-limited job also carries a concurrency key (its own, or its task's
#   rate key of no limit), so the keyed claim index of migration 0010 finds it.

from django.db import migrations, models


class Migration(migrations.Migration):

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
                ('empty_until', models.DateTimeField(blank=True, null=True)),
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
    ]
