"""Cron occurrences in a time zone (schedules.py): daylight saving, windows, bad input.

Pure functions: no database. 2026's changes: Europe/Paris 29 March 02:00 -> 03:00 and
25 October 03:00 -> 02:00; America/New_York 8 March 02:00 -> 03:00 and 1 November
02:00 -> 01:00.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from django_skipqueue import Cron
from django_skipqueue.exceptions import ConfigurationError

PARIS = ZoneInfo("Europe/Paris")
NEW_YORK = ZoneInfo("America/New_York")


def local_day(day: datetime, zone: ZoneInfo) -> tuple[datetime, datetime]:
    """The instants (UTC) from the start of `day` to the start of the next, in `zone`."""
    start = day.replace(tzinfo=zone)
    end = (day + timedelta(days=1)).replace(tzinfo=zone)
    return start.astimezone(timezone.utc), end.astimezone(timezone.utc)


def wall(instants: list[datetime], zone: ZoneInfo) -> list[str]:
    return [instant.astimezone(zone).strftime("%H:%M %Z") for instant in instants]


@pytest.mark.parametrize("zone", [PARIS, NEW_YORK])
@pytest.mark.parametrize(
    "day",
    [datetime(2026, 3, 29), datetime(2026, 3, 8), datetime(2026, 10, 25), datetime(2026, 11, 1)],
)
def test_a_0230_daily_job_runs_once_on_every_day(zone: ZoneInfo, day: datetime) -> None:
    after, until = local_day(day, zone)
    assert len(Cron(expression="30 2 * * *").occurrences(after, until, zone)) == 1


def test_a_time_the_spring_change_skips_runs_shifted_by_the_change() -> None:
    after, until = local_day(datetime(2026, 3, 29), PARIS)
    assert wall(Cron(expression="30 2 * * *").occurrences(after, until, PARIS), PARIS) == [
        "03:30 CEST"
    ]


def test_a_time_the_autumn_change_repeats_runs_at_its_first_pass() -> None:
    after, until = local_day(datetime(2026, 11, 1), NEW_YORK)
    assert wall(Cron(expression="30 1 * * *").occurrences(after, until, NEW_YORK), NEW_YORK) == [
        "01:30 EDT"
    ]


def test_an_hourly_job_runs_every_real_hour_across_both_changes() -> None:
    hourly = Cron(expression="0 * * * *")
    autumn = hourly.occurrences(*local_day(datetime(2026, 10, 25), PARIS), PARIS)
    spring = hourly.occurrences(*local_day(datetime(2026, 3, 29), PARIS), PARIS)
    assert len(autumn) == 25 and len(spring) == 23
    for day in (autumn, spring):
        gaps = {later - earlier for earlier, later in zip(day, day[1:], strict=False)}
        assert gaps == {timedelta(hours=1)}
    assert wall(autumn[1:3], PARIS) == ["02:00 CEST", "02:00 CET"]  # (00:00, 24:00]


def test_two_times_that_land_on_one_instant_are_one_occurrence() -> None:
    after, until = local_day(datetime(2026, 3, 29), PARIS)
    found = Cron(expression="0,30 2,3 * * *").occurrences(after, until, PARIS)
    assert wall(found, PARIS) == ["03:00 CEST", "03:30 CEST"]


@pytest.mark.parametrize("expression", ["30 2 * * *", "*/20 * * * *", "15 1,2,3 * * *"])
@pytest.mark.parametrize("day", [datetime(2026, 3, 29), datetime(2026, 10, 25)])
def test_ticking_minute_by_minute_finds_what_one_window_finds(
    expression: str, day: datetime
) -> None:
    """The scheduler asks for short windows, one after another: their union must be the
    day's occurrences, each once, whatever side of a change a window falls on."""
    cron = Cron(expression=expression)
    after, until = local_day(day, PARIS)
    at, ticked = after, []
    while at < until:
        ticked += cron.occurrences(at, at + timedelta(minutes=1), PARIS)
        at += timedelta(minutes=1)
    assert ticked == cron.occurrences(after, until, PARIS)


def test_seconds_are_an_optional_sixth_field() -> None:
    start = datetime(2026, 5, 1, 12, 0, tzinfo=timezone.utc)
    found = Cron(expression="* * * * * */15").occurrences(
        start, start + timedelta(minutes=1), PARIS
    )
    assert [instant.second for instant in found] == [15, 30, 45, 0]


def test_latest_and_next_after() -> None:
    cron = Cron(expression="0 3 * * *")
    moment = datetime(2026, 5, 10, 12, 0, tzinfo=timezone.utc)
    latest = cron.latest(moment, moment - timedelta(days=30), PARIS, 3)
    assert wall(latest, PARIS) == ["03:00 CEST"] * 3
    assert [instant.day for instant in latest] == [8, 9, 10]
    assert cron.next_after(moment, PARIS) == datetime(2026, 5, 11, 1, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"expression": "61 * * * *"}, "not a cron expression"),
        ({"expression": "* * * * *", "timezone": "Mars/Olympus"}, "not a time zone"),
        ({"expression": "* * * * *", "missed": "sometimes"}, "missed='sometimes'"),
        ({"expression": "* * * * *", "catch_up": 0}, "catch_up=0"),
        ({"expression": "* * * * *", "priority": 500}, "priority"),
        ({"expression": "* * * * *", "queue_name": "tab\there"}, "queue name"),
        ({"expression": "* * * * *", "grace": -1}, "grace"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_fault(options: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Cron(**options)


# -- intervals (issue 27) ---------------------------------------------------------------


def test_an_interval_runs_at_multiples_of_its_period_since_the_epoch_in_any_zone() -> None:
    after = datetime(2026, 3, 29, 0, 59, 50, tzinfo=timezone.utc)  # across Paris's spring change
    every = Cron(timedelta(minutes=30))
    assert every.expression == "@every 30m" and every.interval == timedelta(minutes=30)
    found = every.occurrences(after, after + timedelta(hours=3), PARIS)
    assert found == [
        after.replace(minute=30, second=0) + timedelta(minutes=30 * n) for n in range(1, 7)
    ]
    assert every.occurrences(after, after + timedelta(hours=3), NEW_YORK) == found
    assert every.next_after(found[0], PARIS) == found[1]
    assert every.latest(found[-1], after, PARIS, 2) == found[-2:]
    assert Cron("@every 1h30m").interval == timedelta(hours=1, minutes=30)
    assert Cron(timedelta(days=1, seconds=5)).expression == "@every 1d5s"


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("@every", "not an interval"),
        ("@every 30", "not an interval"),
        ("@every 0s", "from 1 second"),
        (timedelta(seconds=1.5), "whole seconds"),
        (timedelta(days=400), "366 days"),
    ],
)
def test_a_bad_interval_is_refused_naming_the_fault(expression, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Cron(expression)


@pytest.mark.parametrize(
    ("expression", "words"),
    [
        (
            "* * * * * */10",
            "next runs Wed 2026-12-02 11:00:00, 11:00:10, 11:00:20"
            " (Europe/Paris), every 10 seconds",
        ),
        (
            "*/10 * * * * *",
            "next runs Wed 2026-12-02 11:00:00, 11:00:01, 11:00:02 (Europe/Paris), every second",
        ),
        (
            "30 2 * * *",
            "next runs Thu 2026-12-03 02:30:00, Fri 2026-12-04 02:30:00, Sat 2026-12-05 02:30:00"
            " (Europe/Paris), every day",
        ),
        (
            "@every 90s",
            "next runs Wed 2026-12-02 11:00:00, 11:01:30, 11:03:00"
            " (Europe/Paris), every 1 minute 30 seconds",
        ),
        (
            "0 9 * * 1,3",
            "next runs Mon 2026-12-07 09:00:00, Wed 2026-12-09 09:00:00, Mon 2026-12-14 09:00:00"
            " (Europe/Paris)",
        ),
    ],
)
def test_the_next_runs_are_said_in_words(expression: str, words: str) -> None:
    now = datetime(2026, 12, 2, 9, 59, 55, tzinfo=timezone.utc)
    assert Cron(expression).describe_upcoming(now, PARIS) == words


def test_only_a_seconds_field_of_star_under_a_restricted_minute_fires_in_bursts() -> None:
    assert Cron("*/10 * * * * *").fires_in_bursts
    assert Cron("0 * * * * *").fires_in_bursts
    assert not Cron("* * * * * */10").fires_in_bursts
    assert not Cron("* * * * * *").fires_in_bursts
    assert not Cron("*/10 * * * *").fires_in_bursts
    assert not Cron("@every 10s").fires_in_bursts
