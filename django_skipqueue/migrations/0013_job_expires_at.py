# Expiring jobs (`@task(expires=...)`, issue 27): a job not started by `expires_at` never
# runs; the reaper ends it cancelled, by skipqueue:expired.
#
# - The column is nullable with no default: adding it rewrites nothing (a catalogue
#   change under a brief ACCESS EXCLUSIVE lock).
# - Its index is partial (unstarted jobs with an expiry: empty unless used) and built
#   CONCURRENTLY, so that claims and enqueues go on meanwhile (not atomic).

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY

    dependencies = [
        ("skipqueue", "0012_workflows"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="expires_at",
            field=models.DateTimeField(
                blank=True,
                help_text="Not started by then, it never runs: it ends cancelled, by skipqueue:expired.",
                null=True,
            ),
        ),
        AddIndexConcurrently(
            model_name="job",
            index=models.Index(
                condition=models.Q(("expires_at__isnull", False), ("state__in", ["pending", "waiting"])),
                fields=["expires_at"],
                name="skipqueue_job_expires_idx",
            ),
        ),
    ]
