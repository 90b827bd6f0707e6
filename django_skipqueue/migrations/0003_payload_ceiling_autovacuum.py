"""A hard payload ceiling in the database, and autovacuum tuned for a queue table.

The ceiling backs up SKIPQUEUE['MAX_PAYLOAD_BYTES'] (checked in Python, at most 1 MiB)
for rows written by raw SQL or another service: 4 MiB of jsonb text for the arguments
and for the return value (jsonb's text form is a little larger than compact JSON).

Autovacuum: a queue table churns (every job is inserted, updated two or three times and
later deleted) while staying small, so the default scale factor (20 % of the table)
lets dead tuples pile up between vacuums and claims slow down. A fixed threshold and
no cost delay vacuum it early and quickly (docs/explanation/failure-model.md 0.10, T40).
"""

from django.db import migrations

CEILING = 4 * 1024 * 1024

FORWARD = f"""
ALTER TABLE skipqueue_job ADD CONSTRAINT skipqueue_job_payload_size CHECK (
    octet_length(args::text) + octet_length(kwargs::text) <= {CEILING}
    AND (result IS NULL OR octet_length(result::text) <= {CEILING})
) NOT VALID;
ALTER TABLE skipqueue_job VALIDATE CONSTRAINT skipqueue_job_payload_size;
ALTER TABLE skipqueue_job SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 5000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);
"""

BACKWARD = """
ALTER TABLE skipqueue_job DROP CONSTRAINT IF EXISTS skipqueue_job_payload_size;
ALTER TABLE skipqueue_job RESET (
    autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
    autovacuum_vacuum_insert_scale_factor, autovacuum_vacuum_insert_threshold,
    autovacuum_analyze_scale_factor, autovacuum_vacuum_cost_delay
);
"""


class Migration(migrations.Migration):
    dependencies = [("skipqueue", "0002_notify_trigger")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
