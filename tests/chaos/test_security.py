"""S13: a worker role with only the recipe's grants runs jobs (docs: security page)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from django_skipqueue.models import Job
from tests.processes import REPO_ROOT, child_env, database_url
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "explanation" / "security-and-guarantees.md"


def recipe() -> list[str]:
    """The SQL of the docs' least-privilege recipe, statement by statement."""
    block = re.search(r"```sql\n(.*?)```", DOCS.read_text(), re.S).group(1)
    return [s.strip() for s in block.split(";") if s.strip() and not s.strip().startswith("--")]


def test_s13_a_worker_with_only_the_recipes_grants_runs_jobs():
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_database()")
        database = cursor.fetchone()[0]
        if _role_exists(cursor):  # left over from an interrupted run
            cursor.execute("DROP OWNED BY skipqueue_worker")
        cursor.execute("DROP ROLE IF EXISTS skipqueue_worker")
        for statement in recipe():
            statement = statement.replace("DATABASE app", f'DATABASE "{database}"')
            statement = statement.replace("PASSWORD '...'", "PASSWORD 'worker'")
            cursor.execute(statement)
        # Tests only: the audit trigger writes to the test app's table.
        cursor.execute("GRANT INSERT ON testapp_jobaudit TO skipqueue_worker")
        cursor.execute("GRANT USAGE ON SEQUENCE testapp_jobaudit_id_seq TO skipqueue_worker")
    tasks.add.enqueue_many([((n, n), {}) for n in range(20)])
    url = re.sub(r"//[^@]*@", "//skipqueue_worker:worker@", database_url())
    try:
        result = subprocess.run(
            [sys.executable, "-m", "django", "runworker", "--burst", "--no-listen"],
            env=child_env(DATABASE_URL=url),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert Job.objects.filter(state="done").count() == 20
        with connection.cursor() as cursor:  # and the role really is restricted
            cursor.execute("SELECT has_table_privilege('skipqueue_worker', 'auth_user', 'SELECT')")
            assert cursor.fetchone()[0] is False
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP OWNED BY skipqueue_worker")
            cursor.execute("DROP ROLE IF EXISTS skipqueue_worker")


def _role_exists(cursor) -> bool:
    cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = 'skipqueue_worker'")
    return cursor.fetchone() is not None
