"""Tests only: record every state change of skipqueue_job in testapp_jobaudit."""

from django.db import migrations

FORWARD = """
CREATE FUNCTION testapp_audit_job() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO testapp_jobaudit (job_id, old_state, new_state, old_attempts, new_attempts,
        old_expirations, new_expirations, new_releases, worker_id, at)
    VALUES (NEW.id, OLD.state, NEW.state, OLD.attempts, NEW.attempts, OLD.expirations,
        NEW.expirations, NEW.releases, NEW.worker_id, clock_timestamp());
    RETURN NULL;
END;
$$;
CREATE TRIGGER testapp_job_audit AFTER UPDATE ON skipqueue_job
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION testapp_audit_job();
"""

BACKWARD = """
DROP TRIGGER IF EXISTS testapp_job_audit ON skipqueue_job;
DROP FUNCTION IF EXISTS testapp_audit_job();
"""


class Migration(migrations.Migration):
    dependencies = [("testapp", "0002_chaos_tables"), ("skipqueue", "0002_notify_trigger")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
