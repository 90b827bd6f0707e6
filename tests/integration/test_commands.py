"""reapjobs and runworker as commands: flags, output, batches, dry runs."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import threading
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_skipqueue.maintenance.reaper import Reaper
from django_skipqueue.models import Job, JobState
from tests.factories import BULK_BATCH, JobFactory
from tests.processes import child_env


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_reapjobs_takes_back_expired_leases():
    JobFactory.create_batch(3, expired=True)
    JobFactory(running=True)

    output = run("reapjobs")

    assert "reap: 3 back to pending, 0 failed" in output
    assert Job.objects.filter(state=JobState.PENDING, expirations=1).count() == 3
    assert Job.objects.running().count() == 1


@pytest.mark.django_db(transaction=True)
def test_reapjobs_prunes_old_finished_jobs_in_batches():
    old = Now() - timedelta(days=8)
    Job.objects.bulk_create(
        JobFactory.build_batch(2500, done=True, finished_at=old), batch_size=BULK_BATCH
    )
    Job.objects.bulk_create(JobFactory.build_batch(5, failed=True, finished_at=old))
    recent = JobFactory(done=True)
    pending = JobFactory()

    with CaptureQueriesContext(connection) as queries:
        output = run("reapjobs", "--prune-done-older-than", "7d", "--batch-size", "1000")

    deletes = [q["sql"] for q in queries if q["sql"].startswith('DELETE FROM "skipqueue_job"')]
    assert len(deletes) == 3  # 1000 + 1000 + 500, never one huge statement
    assert "prune: 2500 done, 0 failed" in output
    assert set(Job.objects.values_list("id", flat=True)) == {recent.id, pending.id} | set(
        Job.objects.filter(state=JobState.FAILED).values_list("id", flat=True)
    )
    assert Job.objects.filter(state=JobState.FAILED).count() == 5


@pytest.mark.django_db(transaction=True)
def test_a_pruner_skips_rows_another_pruner_holds_instead_of_waiting():
    ids = [
        job.id
        for job in Job.objects.bulk_create(
            JobFactory.build_batch(10, done=True, finished_at=Now() - timedelta(days=2))
        )
    ]
    held, holding, release = ids[:4], threading.Event(), threading.Event()

    def other_pruner() -> None:  # mid-batch: its rows locked, its DELETE not yet run
        try:
            with transaction.atomic():
                list(Job.objects.select_for_update().filter(id__in=held))
                holding.set()
                release.wait(timeout=10)
        finally:
            connection.close()

    thread = threading.Thread(target=other_pruner)
    thread.start()
    try:
        assert holding.wait(timeout=10)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")  # a wait would fail, not hang
        result = Reaper(batch_size=100).prune(done_older_than=timedelta(days=1))
    finally:
        release.set()
        thread.join(timeout=10)
        connection.close()
    assert result.pruned_done == 6
    assert sorted(Job.objects.values_list("id", flat=True)) == sorted(held)


@pytest.mark.django_db(transaction=True)
def test_reapjobs_prunes_failed_jobs_on_their_own_age():
    JobFactory(failed=True, finished_at=Now() - timedelta(hours=13))
    JobFactory(failed=True)
    output = run("reapjobs", "--prune-failed-older-than", "12h")
    assert "prune: 0 done, 1 failed" in output
    assert Job.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_reapjobs_dry_run_counts_but_changes_nothing():
    JobFactory.create_batch(2, expired=True)
    JobFactory(done=True, finished_at=Now() - timedelta(days=30))
    before = list(Job.objects.order_by("id").values_list("id", "state", "expirations"))

    output = run("reapjobs", "--dry-run", "--prune-done-older-than", "1d")

    assert "would reap: 2 back to pending" in output
    assert "would prune: 1 done" in output
    assert list(Job.objects.order_by("id").values_list("id", "state", "expirations")) == before


@pytest.mark.parametrize("value", ["7", "tomorrow", "-1d", "1y"])
def test_reapjobs_refuses_a_bad_duration(value):
    with pytest.raises(CommandError, match="is not a duration"):
        call_command("reapjobs", f"--prune-done-older-than={value}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "0"], "0 is not positive"),
        (["--concurrency", "many"], "'many' is not a whole number"),
        (["--grace", "-1"], "must be zero or more seconds"),
        (["--poll-interval", "0"], "must be more than zero seconds"),
        (["--max-memory", "lots"], "is not a number of megabytes"),
        (["--queue", ""], "queue name '' is invalid"),
    ],
)
def test_runworker_refuses_bad_flags_with_a_clear_message(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("runworker", *args)


def test_runworker_help_documents_every_flag():
    from django_skipqueue.management.commands.runworker import Command

    help_text = Command().create_parser("manage.py", "runworker").format_help()
    for flag in (
        "--queue",
        "--concurrency",
        "--burst",
        "--max-jobs",
        "--max-memory",
        "--grace",
        "--poll-interval",
        "--no-listen",
        "--reap-interval",
    ):
        assert flag in help_text


@pytest.mark.django_db(transaction=True)
def test_runworker_burst_runs_jobs_and_reports_its_stop_once(settings, caplog):
    from tests.testapp import tasks

    tasks.add.enqueue_many([((1, 2), {})] * 5)
    with caplog.at_level(logging.INFO, logger="django_skipqueue"):
        output = run("runworker", "--burst", "--no-listen", "--concurrency", "2")
    stopped = [r.getMessage() for r in caplog.records if "worker stopped" in r.getMessage()]
    assert len(stopped) == 1 and "claimed=5 succeeded=5" in stopped[0]
    assert "worker stopped" not in output  # not a second line beside the log's
    assert Job.objects.filter(state=JobState.DONE).count() == 5
    # Quiet (-v 0: no INFO lines), one summary line still ends the run.
    assert run("runworker", "--burst", "--no-listen", "-v", "0").count("0 claimed") == 1


@pytest.mark.django_db(transaction=True)
def test_s15_runworker_warns_when_debug_is_on(settings, caplog):
    settings.DEBUG = True
    run("runworker", "--burst", "--no-listen")
    assert "DEBUG=True: every query is kept in memory" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_start_up_check_that_times_out_is_skipped_not_fatal():
    from django_skipqueue.management.commands.runworker import start_up_warnings
    from tests.processes import start_python

    holder = start_python(
        "from django.db import connection, transaction\n"
        "import time\n"
        "with transaction.atomic():\n"
        "    connection.cursor().execute('LOCK TABLE skipqueue_job IN ACCESS EXCLUSIVE MODE')\n"
        "    print('locked', flush=True)\n"
        "    time.sleep(30)\n"
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        name = connection.settings_dict["NAME"]
        with connection.cursor() as cursor:  # for every session, the retries' new ones too
            cursor.execute(f"ALTER DATABASE \"{name}\" SET lock_timeout = '50ms'")
        connection.close()
        try:
            warnings = start_up_warnings(["nowhere"], "default", tries=2)
        finally:
            with connection.cursor() as cursor:
                cursor.execute(f'ALTER DATABASE "{name}" RESET lock_timeout')
            connection.close()
    finally:
        holder.kill()
        holder.communicate(timeout=10)
    assert len(warnings) == 1 and "start-up check of the queues skipped" in warnings[0]


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_sigterm_ends_a_worker_whose_task_left_a_process_running(start_worker, tmp_path):
    import os
    import signal

    from tests.processes import wait_until
    from tests.testapp.tasks import leaks_a_process

    pid_file = tmp_path / "child.pid"
    leaks_a_process.enqueue(str(pid_file))
    worker = start_worker("--concurrency", "1")
    wait_until(lambda: Job.objects.filter(state=JobState.DONE).exists(), timeout=30)
    child = int(pid_file.read_text())
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0
    assert "ending a process a task left running" in worker.output()

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(gone, timeout=5)


@pytest.mark.django_db(transaction=True)
def test_a_runworker_process_collects_garbage_with_its_start_up_frozen():
    """The collector is on for the jobs, with what start-up made frozen, in a worker and
    in the children of `--processes`. Nothing turns it off: importing the package under
    any argv (another app's `runworker` listed first, Channels') leaves it as it was."""
    import gc

    from tests.processes import run_python
    from tests.testapp.tasks import collector_state

    for extra in ([], ["--processes", "2"]):
        jobs = collector_state.enqueue_many([((), {})] * 4)
        done = run_python("-m", "django", "runworker", "--burst", "--no-listen", *extra)
        assert done.returncode == 0, done.stderr
        results = [job.result for job in Job.objects.filter(id__in=[job.id for job in jobs])]
        assert len(results) == 4
        assert all(result["enabled"] and result["frozen"] > 10_000 for result in results)
    assert gc.isenabled()  # this test process imported the package too: untouched
    shell = run_python("-c", "import gc, django_skipqueue; print(gc.isenabled())")
    assert shell.stdout.strip() == "True"
    other = run_python(
        "-c",
        "import sys; sys.argv = ['manage.py', 'runworker']; import gc, django_skipqueue; "
        "print(gc.isenabled())",
    )
    assert other.stdout.strip() == "True", other.stderr


@pytest.mark.django_db(transaction=True)
def test_runworker_runs_the_system_checks_but_those_about_other_commands():
    """runworker runs Django's system checks as every command does, but those tagged
    `commands` (Django's own imports `migrate` and `makemigrations` to compare their
    autodetectors, 6.6 ms of a worker's start-up): a project's untagged check still
    stops it, and the registry is whole again afterwards."""
    from django.core import checks
    from django.core.checks.registry import registry as checks_registry

    ran = []

    def about_commands(app_configs, **kwargs):
        ran.append("commands")
        return []

    def the_projects(app_configs, **kwargs):
        ran.append("project")
        return [checks.Error("the project is broken", id="project.E001")]

    checks.register(about_commands, "commands")
    checks.register(the_projects)
    try:
        with pytest.raises(CommandError, match="project.E001"):
            call_command("runworker", "--burst", "--no-listen", skip_checks=False)
        assert ran == ["project"]
        assert about_commands in checks_registry.registered_checks
        call_command("check", stdout=StringIO(), stderr=StringIO(), fail_level="CRITICAL")
    finally:
        checks_registry.registered_checks -= {about_commands, the_projects}
    assert sorted(ran) == ["commands", "project", "project"]  # `check` ran both


@pytest.mark.django_db(transaction=True)
def test_runworker_on_another_thread_runs_every_system_check():
    """The checks tagged `commands` are hidden from the process's one registry on the
    main thread only: runworker's checks on another thread run them all, so that no
    check run meanwhile by the main thread misses them (an outside trial)."""
    from django.core import checks
    from django.core.checks.registry import registry as checks_registry

    ran = []

    def about_commands(app_configs, **kwargs):
        ran.append(threading.current_thread().name)
        return []

    checks.register(about_commands, "commands")
    try:
        worker = threading.Thread(
            target=call_command,
            args=("runworker", "--burst", "--no-listen"),
            kwargs={"skip_checks": False},
            name="not-main",
        )
        worker.start()
        worker.join(timeout=60)
    finally:
        checks_registry.registered_checks.discard(about_commands)
    assert ran == ["not-main"]


@pytest.mark.django_db(transaction=True)
def test_a_workers_start_up_imports_neither_the_migrate_commands_nor_the_migration_loader():
    """Before its first job a worker reads django_migrations with one statement, not
    through MigrationRecorder, and skips the check that imports `migrate` and
    `makemigrations`: in a project whose apps do not import them at setup (here only
    ours; django.contrib.postgres imports the migration writer, contenttypes the
    operations), a worker imports no part of django.db.migrations and neither command."""
    code = (
        "import sys, django\n"
        "from django.conf import settings\n"
        "from tests import settings as project\n"
        "settings.configure(DATABASES=project.DATABASES, USE_TZ=True,\n"
        "                   INSTALLED_APPS=['django_skipqueue'])\n"
        "django.setup()\n"
        "from django.core.management import call_command\n"
        "call_command('runworker', '--burst', '--no-listen', skip_checks=False)\n"
        "print('loaded', sorted(m for m in sys.modules if m.startswith((\n"
        "    'django.core.management.commands.', 'django.db.migrations'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "worker stopped" in result.stdout + result.stderr  # it ran
    [loaded] = [line for line in result.stdout.splitlines() if line.startswith("loaded")]
    assert loaded == "loaded []"


@pytest.mark.django_db(transaction=True)
def test_call_command_puts_text_options_through_their_types():
    """call_command() hands keyword options over as given: "7d" reached the database
    and raised a raw DataError. Now it is read as the command line reads it, and a bad
    value is a CommandError naming the option."""
    from django.core.management import CommandError, call_command

    from tests.factories import JobFactory

    old = JobFactory(state="done", finished_at=timezone.now() - timedelta(days=9))
    call_command("reapjobs", prune_done_older_than="7d", stdout=io.StringIO())
    assert not Job.objects.filter(id=old.id).exists()
    with pytest.raises(CommandError, match="--prune-done-older-than"):
        call_command("reapjobs", prune_done_older_than="seven days", stdout=io.StringIO())
