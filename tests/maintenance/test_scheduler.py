"""The scheduler's database side (scheduler.py): sync, tick, missed occurrences, pause."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F
from django.db.models.functions import Now
from django.test import override_settings

from django_skipqueue import Cron
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.maintenance.scheduler import defined_schedules, sync, tick
from django_skipqueue.models import Job, Schedule
from django_skipqueue.tasks.base import bind_schedules
from tests.testapp.tasks import add, send_invoice

pytestmark = pytest.mark.django_db


def schedules(*crons: Cron, task=add) -> dict[str, Cron]:
    bound = [bind_schedules(task, cron)[0] for cron in crons]
    return {cron.name: cron for cron in bound}


def set_last_occurrence(name: str, seconds_ago: float) -> None:
    Schedule.objects.filter(name=name).update(
        last_occurrence_at=Now() - timedelta(seconds=seconds_ago)
    )


def database_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        return cursor.fetchone()[0]


def test_sync_inserts_updates_and_deletes_to_match_the_code() -> None:
    sync(schedules(Cron(expression="* * * * *", name="a", args=[1, 2])), database="default")
    Schedule.objects.filter(name="a").update(paused_at=Now())
    set_last_occurrence("a", 3600)
    Schedule.objects.create(
        name="gone", task=add.name, expression="* * * * *", timezone="UTC", queue_name="default"
    )
    sync(schedules(Cron(expression="*/5 * * * *", name="a", args=[1, 2])), database="default")
    row = Schedule.objects.get()
    assert row.name == "a" and row.expression == "*/5 * * * *"
    assert row.is_paused  # an operator's pause survives a deploy
    # A changed expression starts from now, not from the old definition's last run.
    assert Schedule.objects.filter(last_occurrence_at__gte=Now() - timedelta(seconds=5)).exists()


def test_each_occurrence_is_enqueued_once_however_often_it_is_ticked() -> None:
    defined = schedules(Cron(expression="* * * * * *", name="every-second", args=[1, 2]))
    sync(defined, database="default")
    set_last_occurrence("every-second", 5)
    first = tick(defined, database="default")
    Schedule.objects.update(last_occurrence_at=F("last_occurrence_at") - timedelta(seconds=5))
    again = tick(defined, database="default")  # the same occurrences: the constraint holds
    jobs = Job.objects.filter(schedule="every-second")
    times = sorted(jobs.values_list("scheduled_for", flat=True))
    assert first.enqueued >= 5
    assert again.enqueued == len(times) - first.enqueued  # rows inserted, not rows tried
    assert len(times) == len(set(times))
    assert all(b - a == timedelta(seconds=1) for a, b in zip(times, times[1:], strict=False))
    job = jobs.first()
    assert (job.task, job.args, job.run_at) == (add.name, [1, 2], job.scheduled_for)
    assert 0 < first.next_in <= 1


@pytest.mark.parametrize(("policy", "expected"), [("latest", 1), ("skip", 0), ("catch_up", 3)])
def test_missed_occurrences_follow_the_schedules_policy(policy: str, expected: int) -> None:
    cron = Cron(expression="* * * * *", name="m", args=[1, 2], missed=policy, catch_up=3, grace=0)
    defined = schedules(cron)
    sync(defined, database="default")
    set_last_occurrence("m", 600)  # ten minutes of occurrences that no worker enqueued
    result = tick(defined, database="default")
    assert Job.objects.filter(schedule="m").count() == expected
    assert result.missed == 1
    # The schedule moved past all of them: the next pass enqueues nothing more.
    assert tick(defined, database="default").enqueued == 0
    latest = Schedule.objects.get().last_occurrence_at
    assert database_now() - latest < timedelta(minutes=1)
    if expected:
        assert Job.objects.filter(schedule="m").latest("scheduled_for").scheduled_for == latest


def test_on_time_occurrences_all_run_whatever_the_policy() -> None:
    cron = Cron(expression="* * * * * *", name="s", args=[1, 2], missed="skip", grace=60)
    defined = schedules(cron)
    sync(defined, database="default")
    set_last_occurrence("s", 10)
    tick(defined, database="default")
    assert Job.objects.filter(schedule="s").count() >= 10


def test_a_new_schedule_starts_at_its_next_occurrence() -> None:
    defined = schedules(Cron(expression="0 0 1 1 *", name="yearly", args=[1, 2]))
    sync(defined, database="default")
    assert tick(defined, database="default").enqueued == 0
    assert Schedule.objects.get().last_occurrence_at is None


def test_a_paused_schedule_enqueues_nothing_and_resumes_from_now() -> None:
    defined = schedules(Cron(expression="* * * * * *", name="p", args=[1, 2]))
    sync(defined, database="default")
    set_last_occurrence("p", 30)
    assert Schedule.objects.pause(["p"], by="ops") == 1
    assert tick(defined, database="default").enqueued == 0
    assert Schedule.objects.get().paused_by == "ops"
    assert Schedule.objects.resume(["p"]) == 1
    tick(defined, database="default")
    # Resumed from now: the 30 seconds passed while paused are not run.
    assert Job.objects.filter(schedule="p").count() <= 2


def test_a_schedule_without_a_row_does_not_fire() -> None:
    defined = schedules(Cron(expression="* * * * * *", name="unsynced", args=[1, 2]))
    assert tick(defined, database="default").enqueued == 0
    assert not Job.objects.exists()


def test_a_unique_task_on_a_schedule_keeps_one_unfinished_job() -> None:
    defined = schedules(Cron(expression="* * * * * *", name="u", args=[9]), task=send_invoice)
    sync(defined, database="default")
    set_last_occurrence("u", 5)
    tick(defined, database="default")
    assert list(Job.objects.values_list("unique_key", flat=True)) == ["invoice_id=9"]


@override_settings(
    SKIPQUEUE={"SCHEDULES": {"nightly": {"task": add.name, "cron": "0 3 * * *", "args": [1, 2]}}}
)
def test_settings_schedules_are_bound_to_registered_tasks() -> None:
    cron = defined_schedules()["nightly"]
    assert (cron.task, cron.args, cron.expression) == (add.name, [1, 2], "0 3 * * *")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"task": "nowhere.task", "cron": "* * * * *"}, "not a registered task"),
        ({"task": add.name, "cron": "* * * * *", "args": [1]}, "cannot be called"),
        ({"task": add.name, "cron": "* * * * *", "when": "now"}, "unknown keys when"),
        ({"task": add.name}, "needs one of 'cron'"),
    ],
)
def test_a_bad_settings_schedule_is_refused_naming_it(entry: dict, message: str) -> None:
    with (
        override_settings(SKIPQUEUE={"SCHEDULES": {"bad": entry}}),
        pytest.raises(ConfigurationError, match=message),
    ):
        defined_schedules()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_enqueues_and_runs_its_schedules_and_burst_workers_do_not(start_worker) -> None:
    from tests.processes import wait_until

    settings = {"SCHEDULES": {"tick": {"task": add.name, "cron": "* * * * * *", "args": [1, 2]}}}
    burst = start_worker("--burst", settings=settings)
    assert burst.wait(timeout=30) == 0
    assert not Schedule.objects.exists()  # a burst worker leaves schedules alone
    start_worker(settings=settings)
    wait_until(
        lambda: Job.objects.filter(schedule="tick", state="done").count() >= 2,
        timeout=20,
        message="no scheduled job ran",
    )
    assert Schedule.objects.get().task == add.name


# -- trial finding 14: rolling deploys, decided from the rows -------------------------


def test_a_paused_schedule_removed_then_recreated_by_an_older_release_stays_paused() -> None:
    old_release = schedules(Cron(expression="* * * * * *", name="report", args=[1, 2]))
    sync(old_release, database="default")
    Schedule.objects.pause(["report"], by="operator")

    sync({}, database="default")  # a newer release without it starts
    assert Schedule.objects.get().is_paused  # kept, with its pause
    sync(old_release, database="default")  # an older worker restarts meanwhile
    set_last_occurrence("report", 3)

    assert tick(old_release, database="default").enqueued == 0
    assert Schedule.objects.get().paused_by == "operator"


def test_a_removed_schedule_that_was_not_paused_is_deleted() -> None:
    sync(schedules(Cron(expression="* * * * *", name="report", args=[1, 2])), database="default")
    sync({}, database="default")
    assert not Schedule.objects.exists()


def test_workers_of_two_releases_fire_the_expression_of_the_row() -> None:
    old_release = schedules(Cron(expression="* * * * * *", name="beat", args=[1, 2]))
    new_release = schedules(Cron(expression="* * * * * */2", name="beat", args=[1, 2]))
    sync(old_release, database="default")
    sync(new_release, database="default")  # the newer worker started last
    set_last_occurrence("beat", 10.5)
    Schedule.objects.update(grace=60)

    tick(old_release, database="default")  # the older worker still runs
    tick(new_release, database="default")

    occurrences = list(Job.objects.values_list("scheduled_for", flat=True))
    assert occurrences and all(at.second % 2 == 0 for at in occurrences)  # */2 only
    assert 4 <= len(occurrences) <= 6  # ten seconds at one every two, not one a second


def test_a_row_naming_a_task_this_worker_lacks_is_left_to_the_others(caplog) -> None:
    defined = schedules(Cron(expression="* * * * * *", name="beat", args=[1, 2]))
    sync(defined, database="default")
    Schedule.objects.update(task="newer.release.task")
    set_last_occurrence("beat", 3)

    assert tick(defined, database="default").enqueued == 0
    assert "which this worker does not have" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_worker_whose_code_has_no_schedule_left_deletes_the_last_row(start_worker) -> None:
    from tests.processes import wait_until

    Schedule.objects.create(
        name="gone", task=add.name, expression="* * * * *", timezone="UTC", queue_name="default"
    )
    start_worker()
    wait_until(lambda: not Schedule.objects.exists(), timeout=20, message="the row stayed")


def test_a_schedule_honours_max_pending_per_queue(settings, caplog) -> None:
    defined = schedules(Cron(expression="* * * * * *", name="beat", args=[1, 2]))
    sync(defined, database="default")
    add.enqueue(5, 6)  # the queue's one allowed pending job
    set_last_occurrence("beat", 3)
    settings.SKIPQUEUE = {"MAX_PENDING_PER_QUEUE": 1}

    assert tick(defined, database="default").enqueued == 0
    assert not Job.objects.filter(schedule="beat").exists()
    assert "MAX_PENDING_PER_QUEUE" in caplog.text


# -- intervals and the next runs in words (issue 27) --------------------------------


def test_an_interval_schedule_enqueues_each_multiple_once() -> None:
    defined = schedules(Cron(timedelta(seconds=2), name="every-2s", args=[1, 2]))
    sync(defined, database="default")
    assert Schedule.objects.get().expression == "@every 2s"
    set_last_occurrence("every-2s", 9)
    first = tick(defined, database="default")
    again = tick(defined, database="default")
    times = sorted(Job.objects.filter(schedule="every-2s").values_list("scheduled_for", flat=True))
    # Once each: the second tick enqueues nothing, unless the next multiple came between
    # the two ticks (the first said how soon: a few ms, now and then).
    assert first.enqueued >= 4
    assert again.enqueued == 0 or (again.enqueued == 1 and first.next_in < 0.5)
    assert all(moment.timestamp() % 2 == 0 for moment in times)  # multiples since the epoch
    assert all(b - a == timedelta(seconds=2) for a, b in zip(times, times[1:], strict=False))


@pytest.mark.parametrize(
    ("every", "expression"),
    [(30, "@every 30s"), (timedelta(minutes=5), "@every 5m"), ("1h30m", "@every 1h30m")],
)
def test_a_settings_schedule_takes_every_instead_of_cron(every, expression: str) -> None:
    entry = {"task": add.name, "every": every, "args": [1, 2]}
    with override_settings(SKIPQUEUE={"SCHEDULES": {"often": entry}}):
        assert defined_schedules()["often"].expression == expression


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"task": add.name, "cron": "* * * * *", "every": 30}, "one of 'cron'"),
        ({"task": add.name, "every": -1}, "positive number of seconds"),
        ({"task": add.name, "every": "soon"}, "not an interval"),
        ({"task": add.name, "every": [30]}, "must be seconds"),
    ],
)
def test_a_bad_every_is_refused_naming_it(entry: dict, message: str) -> None:
    with (
        override_settings(SKIPQUEUE={"SCHEDULES": {"bad": {**entry, "args": [1, 2]}}}),
        pytest.raises(ConfigurationError, match=message),
    ):
        defined_schedules()


def test_a_seconds_field_slip_is_a_check_warning_with_the_next_runs(settings) -> None:
    from django_skipqueue.checks import check_schedules

    settings.SKIPQUEUE = {
        "SCHEDULES": {
            "slip": {"task": add.name, "cron": "*/10 * * * * *", "args": [1, 2]},
            "meant": {"task": add.name, "cron": "* * * * * */10", "args": [1, 2]},
        }
    }
    messages = check_schedules()
    assert [message.id for message in messages] == ["skipqueue.W004"]
    assert "'slip'" in messages[0].msg and "every second" in messages[0].msg
    assert "'* * * * * */10'" in messages[0].hint


def test_the_schedules_command_says_the_next_runs_under_each_row(settings) -> None:
    from io import StringIO

    from django.core.management import call_command

    settings.SKIPQUEUE = {"SCHEDULES": {"often": {"task": add.name, "every": 90, "args": [1, 2]}}}
    sync(defined_schedules(), database="default")
    out = StringIO()
    call_command("schedules", stdout=out)
    lines = out.getvalue().splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("often"))
    assert "@every 1m30s" in lines[row]
    assert lines[row + 1].strip().startswith("next runs ")
    assert lines[row + 1].endswith("every 1 minute 30 seconds")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_runs_an_interval_schedule(start_worker) -> None:
    from tests.processes import wait_until

    settings = {"SCHEDULES": {"often": {"task": add.name, "every": 1, "args": [1, 2]}}}
    start_worker(settings=settings)
    wait_until(
        lambda: Job.objects.filter(schedule="often", state="done").count() >= 2,
        timeout=20,
        message="no interval job ran",
    )
    times = sorted(Job.objects.filter(schedule="often").values_list("scheduled_for", flat=True))
    assert all(moment.microsecond == 0 for moment in times)


def test_a_backfill_enqueues_a_past_range_each_occurrence_once_beside_the_ticks() -> None:
    """`schedules --backfill`: an outage's hours run after the fact. The occurrences a
    tick enqueued already are skipped (the occurrence constraint), a second backfill of
    the same range adds nothing, and the schedule's own progress does not move."""
    from django_skipqueue.maintenance.scheduler import backfill

    defined = schedules(Cron(expression="*/10 * * * *", name="ten", args=[1, 2]))
    sync(defined, database="default")
    now = database_now()
    end = now.replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(hours=2)
    before = Schedule.objects.get().last_occurrence_at
    first = backfill("ten", start, end, database="default", schedules=defined)
    assert len(first.occurrences) == 12 and first.enqueued == 12
    again = backfill("ten", start - timedelta(hours=1), end, database="default", schedules=defined)
    assert (len(again.occurrences), again.enqueued) == (18, 6)
    times = sorted(Job.objects.filter(schedule="ten").values_list("scheduled_for", flat=True))
    assert len(times) == 18 == len(set(times)) and times[-1] == end
    assert Schedule.objects.get().last_occurrence_at == before
    with pytest.raises(ValueError, match="after the database's now"):
        backfill("ten", start, now + timedelta(minutes=1), database="default", schedules=defined)
    with pytest.raises(ValueError, match="no schedule named 'nope'"):
        backfill("nope", start, end, database="default", schedules=defined)
    dry = backfill(
        "ten", start - timedelta(hours=3), end, database="default", schedules=defined, dry_run=True
    )
    assert (len(dry.occurrences), dry.enqueued) == (30, 0)
    assert Job.objects.filter(schedule="ten").count() == 18


def test_the_backfill_command_says_what_is_wrong_in_words() -> None:
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="--backfill needs --from"):
        call_command("schedules", "--backfill", "nightly")
    with pytest.raises(CommandError, match="--from 'yesterday' is not a date or a time"):
        call_command("schedules", "--backfill", "nightly", "--from", "yesterday")
    with pytest.raises(CommandError, match="no schedule named 'nightly' in the code"):
        call_command("schedules", "--backfill", "nightly", "--from", "2026-12-01")


def test_a_backfill_reads_its_range_in_the_projects_zone_once_and_its_jobs_expire_from_now():
    """The outside trial: with TIME_ZONE Asia/Tokyo, Dec 1 to Dec 5 of a 02:30 schedule
    gave Dec 2 to 5 (the range shifted by the offset twice), and a schedule's `expires`
    counted from each past occurrence cancelled every backfilled job unrun."""
    from zoneinfo import ZoneInfo

    from django.core.management import call_command

    from django_skipqueue.maintenance.scheduler import backfill

    tokyo = ZoneInfo("Asia/Tokyo")
    cron = Cron(expression="30 2 * * *", name="nightly", args=[1, 2], expires=600)
    defined = schedules(cron)
    with override_settings(TIME_ZONE="Asia/Tokyo"):
        sync(defined, database="default")
        start = timezone_aware(2026, 12, 1, tokyo)
        done = backfill(
            "nightly", start, timezone_aware(2026, 12, 5, tokyo), database="default",
            schedules=defined,
        )  # fmt: skip
        local = [moment.astimezone(tokyo) for moment in done.occurrences]
        assert [(m.day, m.hour, m.minute) for m in local] == [(d, 2, 30) for d in (1, 2, 3, 4)]
        assert done.enqueued == 4
        now = database_now()
        expiries = Job.objects.filter(schedule="nightly").values_list("expires_at", flat=True)
        assert all(now < at <= now + timedelta(seconds=601) for at in expiries)
        with pytest.raises(Exception, match="'2026-02-30' is not a date or a time"):
            call_command("schedules", "--backfill", "nightly", "--from", "2026-02-30")


def timezone_aware(year: int, month: int, day: int, zone) -> object:
    from datetime import datetime

    return datetime(year, month, day, tzinfo=zone)
