"""Tests only: the state-machine guard on skipqueue_job.

A trigger records in testapp_stateviolation every change of a job the protocol never
makes (django_skipqueue.core.states.TRANSITIONS is the one table of the changes it makes):
an unlisted change of state, any write that keeps a finished job finished but changes
it, and any fall of `attempts`. It records rather than raises, so that no error handling
of the library can hide a violation, and it sees every process: the workers of the
fault suite and the soak write to the same database. tests/conftest.py fails every test
after which a violation is recorded. A test that sets rows up by hand in a state the
protocol would not produce does it inside `tests.guard.setting_up()`.
"""

import django.db.models.functions.datetime
from django.db import migrations, models

from django_skipqueue.core.states import FINISHED_STATES, TRANSITIONS


def forward_sql() -> str:
    allowed = ", ".join(f"'{old}>{new}'" for old, new in TRANSITIONS)
    finished = ", ".join(f"'{state}'" for state in FINISHED_STATES)
    return f"""
CREATE FUNCTION testapp_guard_job() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    problem text := NULL;
BEGIN
    IF current_setting('skipqueue_test.setting_up', true) = 'on' THEN
        RETURN NULL;
    END IF;
    IF NEW.attempts < OLD.attempts THEN
        problem := 'attempts went down from ' || OLD.attempts || ' to ' || NEW.attempts;
    ELSIF OLD.state IN ({finished}) AND NEW.state = OLD.state THEN
        problem := 'a finished job was rewritten';
    ELSIF NOT (OLD.state || '>' || NEW.state) = ANY (ARRAY[{allowed}]) THEN
        problem := 'a change the protocol never makes';
    END IF;
    IF problem IS NOT NULL THEN
        INSERT INTO testapp_stateviolation (job_id, old_state, new_state, problem, statement, at)
        VALUES (NEW.id, OLD.state, NEW.state, problem, left(current_query(), 2000),
                clock_timestamp());
    END IF;
    RETURN NULL;
END;
$$;
CREATE TRIGGER testapp_job_guard AFTER UPDATE ON skipqueue_job
    FOR EACH ROW WHEN (OLD.* IS DISTINCT FROM NEW.*)
    EXECUTE FUNCTION testapp_guard_job();
"""


BACKWARD = """
DROP TRIGGER IF EXISTS testapp_job_guard ON skipqueue_job;
DROP FUNCTION IF EXISTS testapp_guard_job();
"""


class Migration(migrations.Migration):
    dependencies = [("testapp", "0004_spans"), ("skipqueue", "0011_job_relayed_state")]

    operations = [
        migrations.CreateModel(
            name="StateViolation",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("job_id", models.BigIntegerField()),
                ("old_state", models.CharField(max_length=16)),
                ("new_state", models.CharField(max_length=16)),
                ("problem", models.CharField(max_length=100)),
                ("statement", models.TextField()),
                ("at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
        ),
        migrations.RunSQL(forward_sql(), BACKWARD),
    ]
