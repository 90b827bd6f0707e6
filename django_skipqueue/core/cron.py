"""Periodic schedules as values: `Cron` (one declared schedule) and its occurrences.

A leaf of pure functions: no database, no models. Parsing and matching a cron
expression is croniter's; what this module adds is the time zone. A cron expression
matches wall-clock times of its zone; the occurrences are instants (aware UTC), chosen
so that each day runs a fixed-time schedule once, daylight saving or not:

- a time that happens twice (the autumn change) runs once, at its first pass, unless
  the schedule runs every hour (hour field `*`): then both passes run, one real hour
  apart, as an hourly job must;
- a time that does not happen (the spring change) runs shifted forward by the change
  (02:30 becomes 03:30), unless the schedule runs every hour: then that hour is simply
  not there, and the runs stay one real hour apart.

Two wall-clock times that land on one instant are one occurrence.

An interval (`@every 30s`, or a `timedelta` given as the expression) is not a cron
expression: its occurrences are the instants that are whole multiples of the interval
since the Unix epoch, in UTC, whatever the zone. Every worker computes the same
instants, so an occurrence is enqueued once however many tick; the first run is at the
next multiple, not at start-up. The scheduler
(`scheduler.py`) decides, on the database clock, which occurrences are due; this module
only says which instants a schedule has.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from datetime import datetime, timedelta, tzinfo
from datetime import timezone as _timezone
from functools import cached_property
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django_skipqueue.core.states import MAX_PRIORITY, MIN_PRIORITY, validate_queue_name
from django_skipqueue.exceptions import ConfigurationError, InvalidJobError


def _croniter() -> Any:
    """croniter's class, imported when a schedule first needs it: a worker or a web
    process without schedules never loads it, nor dateutil (measured: about 10 ms of a
    worker's start-up, before its first claim)."""
    from croniter import croniter

    return croniter


#: What a schedule does with occurrences that no worker enqueued in time (`missed`).
MISSED_POLICIES = ("latest", "skip", "catch_up")
#: Longest schedule name (the column's length).
SCHEDULE_NAME_MAX_LENGTH = 200
#: The most occurrences one pass enqueues for one schedule (a second-by-second schedule
#: whose workers were all down for a day must not enqueue 86,400 jobs at once).
MAX_OCCURRENCES_PER_PASS = 1000
#: The widest change of UTC offset in any zone (with margin): how far from a window a
#: daylight-saving change can still move an occurrence into it.
_SHIFT = timedelta(hours=3)
#: An interval schedule's expression: `@every ` and a duration such as `30s`, `5m`,
#: `1h30m` or `2d` (what a `timedelta` given as the expression is written as).
EVERY_PREFIX = "@every"
_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
#: The longest interval: a year (a longer period is a cron expression's job).
MAX_INTERVAL = timedelta(days=366)
_UNITS = (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1))
_UTC = _timezone.utc


@dataclass(frozen=True)
class Cron:
    """A periodic schedule: enqueue `task` at each time `expression` matches.

    `expression` has five fields (minute, hour, day of month, month, day of week), or six
    with seconds last (`* * * * * */10`: every ten seconds), or an alias (`@hourly`,
    `@daily`, `@weekly`, `@monthly`, `@yearly`), or an interval: `@every 30s` (`s`, `m`,
    `h`, `d`, combined as `1h30m`), or a `timedelta`, which is written so. Times are
    read in `timezone` (default settings.TIME_ZONE); an interval's instants do not
    depend on it (see the module's docstring). `args` and `kwargs` are passed to every
    run; `queue_name` and `priority` default to the task's.

    `missed` says what happens to occurrences that no worker enqueued within `grace`
    seconds of their time (every worker down, say): `latest` runs the most recent of them
    once (unless a later one is on time), `skip` runs none, `catch_up` runs the most
    recent `catch_up` of them, each once.

    `expires` (seconds or a timedelta): a job of this schedule not started that long
    after its occurrence never runs; it ends cancelled, by skipqueue:expired.
    """

    expression: str  # a timedelta is taken too, and written as `@every ...`
    _: KW_ONLY
    name: str | None = None
    task: str | None = None  # set when bound to its task
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] | None = None  # None: no keyword arguments
    queue_name: str | None = None
    priority: int | None = None
    timezone: str | None = None
    missed: str = "latest"
    catch_up: int = 10
    grace: float = 60.0
    #: A job of this schedule not started this long after its occurrence never runs
    #: (seconds or a timedelta); default: the task's own `expires`.
    expires: float | timedelta | None = None

    def __post_init__(self) -> None:
        if self.kwargs is None:
            object.__setattr__(self, "kwargs", {})
        if isinstance(self.expression, timedelta):
            object.__setattr__(self, "expression", every_expression(self.expression, self.label))
        if isinstance(self.expression, str) and self.expression.startswith(EVERY_PREFIX):
            interval_of(self.expression, self.label)  # ConfigurationError if malformed
        elif not isinstance(self.expression, str) or not _croniter().is_valid(self.expression):
            raise ConfigurationError(
                f"schedule {self.label}: {self.expression!r} is not a cron expression; use "
                f"five fields (minute hour day-of-month month day-of-week), six with "
                f"seconds last, or an alias such as @daily"
            )
        try:  # an expression that is valid but never matches (Feb 31) cannot run
            if self.interval is None:
                next(self._matches(datetime(2000, 1, 1)))
        except ValueError:  # croniter's CroniterBadDateError
            raise ConfigurationError(
                f"schedule {self.label}: {self.expression!r} never matches a date (no "
                f"such day in those months); fix the day of month or the month"
            ) from None
        if self.name is not None and not (
            isinstance(self.name, str) and 0 < len(self.name) <= SCHEDULE_NAME_MAX_LENGTH
        ):
            raise ConfigurationError(
                f"schedule name {self.name!r} must be a string of 1 to "
                f"{SCHEDULE_NAME_MAX_LENGTH} characters"
            )
        if self.missed not in MISSED_POLICIES:
            raise ConfigurationError(
                f"schedule {self.label}: missed={self.missed!r} is not one of "
                f"{', '.join(MISSED_POLICIES)}"
            )
        if isinstance(self.catch_up, bool) or not isinstance(self.catch_up, int):
            raise ConfigurationError(f"schedule {self.label}: catch_up must be an integer")
        if not 1 <= self.catch_up <= MAX_OCCURRENCES_PER_PASS:
            raise ConfigurationError(
                f"schedule {self.label}: catch_up={self.catch_up} must be 1 to "
                f"{MAX_OCCURRENCES_PER_PASS}"
            )
        grace = self.grace
        if (
            isinstance(grace, bool)
            or not isinstance(grace, (int, float))
            or not (math.isfinite(grace) and grace >= 0)
        ):
            raise ConfigurationError(f"schedule {self.label}: grace must be seconds >= 0")
        if self.expires is not None:
            expires: object = self.expires
            if isinstance(expires, (int, float)) and not isinstance(expires, bool):
                expires = timedelta(seconds=expires) if math.isfinite(expires) else None
            if not isinstance(expires, timedelta) or not timedelta(0) < expires <= MAX_INTERVAL:
                raise ConfigurationError(
                    f"schedule {self.label}: expires must be a positive number of seconds or "
                    f"a timedelta after the occurrence, at most {MAX_INTERVAL.days} days, got "
                    f"{self.expires!r}"
                )
            object.__setattr__(self, "expires", expires)
        if self.queue_name is not None:
            try:
                validate_queue_name(self.queue_name)
            except InvalidJobError as error:
                raise ConfigurationError(f"schedule {self.label}: {error}") from None
        priority = self.priority
        if priority is not None and (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not MIN_PRIORITY <= priority <= MAX_PRIORITY
        ):
            raise ConfigurationError(
                f"schedule {self.label}: priority must be an integer from {MIN_PRIORITY} to "
                f"{MAX_PRIORITY}, got {priority!r}"
            )
        if self.timezone is not None:
            zone_of(self.timezone, self.label)
        if isinstance(self.args, (str, bytes)) or not isinstance(self.args, Sequence):
            raise ConfigurationError(f"schedule {self.label}: args must be a list")
        if not isinstance(self.kwargs, Mapping):
            raise ConfigurationError(f"schedule {self.label}: kwargs must be a dict")

    @property
    def label(self) -> str:
        return repr(self.name or self.task or self.expression)

    def zone(self, default: str) -> tzinfo:
        """The zone its times are read in: its own, or `default` (settings.TIME_ZONE)."""
        return zone_of(self.timezone or default, self.label)

    @classmethod
    def every(cls, period: timedelta, **options: Any) -> Cron:
        """An interval schedule: `Cron.every(timedelta(seconds=30), name="poll")`."""
        return cls(every_expression(period, repr(options.get("name") or period)), **options)

    @property
    def interval(self) -> timedelta | None:
        """The period of an interval schedule (`@every ...`); None for a cron expression."""
        if not self.expression.startswith(EVERY_PREFIX):
            return None
        return interval_of(self.expression, self.label)

    def upcoming(self, moment: datetime, zone: tzinfo, count: int = 3) -> list[datetime]:
        """The first `count` instants after `moment` (fewer if there are none within ten
        years)."""
        found: list[datetime] = []
        while len(found) < count:
            following = self.next_after(found[-1] if found else moment, zone)
            if following is None:
                break
            found.append(following)
        return found

    def describe_upcoming(self, moment: datetime, zone: tzinfo, count: int = 3) -> str:
        """The next runs in words, in the schedule's zone: `next runs 10:00:10, 10:00:20,
        10:00:30 (Europe/Paris), every 10 seconds`. Shown wherever a schedule is (the
        schedules command, the admin, the checks), so that an expression that does not
        mean what was meant is seen at once."""
        shown, cadence = self.upcoming_words(moment, zone, count)
        if not shown:
            return "no run within ten years"
        every = f", {cadence}" if cadence else ""
        return f"next runs {', '.join(shown)} ({zone}){every}"

    def upcoming_words(
        self, moment: datetime, zone: tzinfo, count: int = 3
    ) -> tuple[list[str], str]:
        """The parts of `describe_upcoming`: each next run's time in `zone` (with its day
        when the day changes), and the cadence (`every 10 seconds`, or "" when the gaps
        differ). No runs within ten years: ([], "")."""
        instants = self.upcoming(moment, zone, count)
        local = [instant.astimezone(zone) for instant in instants]
        shown, previous_day = [], None
        for when in local:
            day = when.date()
            shown.append(
                when.strftime("%H:%M:%S")
                if day == previous_day
                else when.strftime("%a %Y-%m-%d %H:%M:%S")
            )
            previous_day = day
        gaps = {b - a for a, b in itertools.pairwise(instants)}
        cadence = f"every {duration_in_words(gaps.pop())}" if len(gaps) == 1 else ""
        if self.interval is not None:
            cadence = f"every {duration_in_words(self.interval)}"
        return shown, cadence

    @property
    def fires_in_bursts(self) -> bool:
        """A six-field expression whose seconds field (the last) is `*` while its minute
        field is not: every second of the minutes it matches, then nothing (what
        `*/10 * * * * *` does; every ten seconds is `* * * * * */10`)."""
        fields = self.expression.split()
        return len(fields) == 6 and fields[5] == "*" and fields[0] != "*"

    @cached_property
    def _every_hour(self) -> bool:
        hours = _croniter()(self.expression).expanded[1]
        return hours == ["*"] or len(hours) >= 24

    def _matches(self, start: datetime) -> Iterator[datetime]:
        """The naive wall-clock times after `start` (naive) that the expression matches."""
        times = _croniter()(self.expression, start)
        while True:
            yield times.get_next(datetime)

    def occurrences(
        self, after: datetime, until: datetime, zone: tzinfo, *, limit: int | None = None
    ) -> list[datetime]:
        """The instants in (after, until] (aware), in order, in UTC; the first `limit`."""
        if until <= after:
            return []
        if self.interval is not None:
            return _multiples(self.interval, after, until, limit)
        found: set[datetime] = set()
        changes = _changes(after, until, zone)
        bounds = [after, *(at for at, _, _ in changes), until]
        for start, end in itertools.pairwise(bounds):
            # Each stretch has one UTC offset: its wall times map one to one.
            offset = _offset(start, zone)
            low = (start + offset).replace(tzinfo=None)
            if start != after:  # a change instant: in this stretch, not the one before
                low -= timedelta(microseconds=1)
            high = (end + offset).replace(tzinfo=None)
            for wall in self._matches(low):
                if wall > high or (limit is not None and len(found) >= limit):
                    break
                if wall == high and end != until:
                    break  # the change itself: the next stretch's first instant
                if self._every_hour or _first_pass(wall, zone, offset):
                    found.add((wall - offset).replace(tzinfo=_UTC))
        if not self._every_hour:
            # Spring changes up to _SHIFT before the window: the wall times they skipped,
            # shifted forward by the change, may land in it.
            for at, before, later in _changes(after - _SHIFT, until, zone):
                if later <= before:
                    continue
                gap_low = (at + before).replace(tzinfo=None) - timedelta(microseconds=1)
                gap_high = (at + later).replace(tzinfo=None)
                for wall in self._matches(gap_low):
                    if wall >= gap_high:
                        break
                    instant = (wall - before).replace(tzinfo=_UTC)
                    if after < instant <= until:
                        found.add(instant)
        ordered = sorted(found)
        return ordered if limit is None else ordered[:limit]

    def latest(self, until: datetime, after: datetime, zone: tzinfo, count: int) -> list[datetime]:
        """The last `count` instants in (after, until], in order."""
        if count < 1 or until <= after:
            return []
        if self.interval is not None:
            start = max(after, until - self.interval * (count + 1))
            return _multiples(self.interval, start, until, None)[-count:]
        step = self._period(until, zone) * (count + 1)
        while True:
            start = max(until - step, after)
            found = self.occurrences(start, until, zone)
            if len(found) >= count or start == after:
                return found[-count:]
            step *= 4

    def next_after(self, moment: datetime, zone: tzinfo) -> datetime | None:
        """The first instant after `moment`, or None if there is none within ten years."""
        if self.interval is not None:
            return _multiples(self.interval, moment, moment + self.interval, 1)[0]
        step = self._period(moment, zone) * 2
        horizon = moment + timedelta(days=3660)
        start = moment
        while start < horizon:
            found = self.occurrences(start, start + step, zone, limit=1)
            if found:
                return found[0]
            start, step = start + step, step * 2
        return None

    def _period(self, moment: datetime, zone: tzinfo) -> timedelta:
        """About the time between two occurrences near `moment` (at least a second)."""
        if self.interval is not None:
            return self.interval
        wall = moment.astimezone(zone).replace(tzinfo=None)
        times = self._matches(wall)
        first, second = next(times), next(times)
        return max(second - first, timedelta(seconds=1))


def interval_of(expression: str, label: str = "") -> timedelta:
    """The period of `@every <duration>`, or ConfigurationError naming the fault."""
    text = expression[len(EVERY_PREFIX) :].strip()
    match = _DURATION.fullmatch(text)
    if not text or match is None:
        raise ConfigurationError(
            f"schedule {label}: {expression!r} is not an interval; write `@every ` and a "
            f"duration such as 30s, 5m, 1h30m or 2d, or give a timedelta"
        )
    days, hours, minutes, seconds = (int(group or 0) for group in match.groups())
    return _checked_interval(
        timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds), label
    )


def every_expression(period: timedelta, label: str = "") -> str:
    """A `timedelta` as the interval expression `@every 1h30m` (whole seconds)."""
    _checked_interval(period, label)
    seconds, parts = int(period.total_seconds()), []
    for unit, size in zip("dhms", (86400, 3600, 60, 1), strict=True):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return f"{EVERY_PREFIX} {''.join(parts)}"


def _checked_interval(period: timedelta, label: str) -> timedelta:
    if period.microseconds or not timedelta(seconds=1) <= period <= MAX_INTERVAL:
        raise ConfigurationError(
            f"schedule {label}: an interval must be whole seconds, from 1 second to "
            f"{MAX_INTERVAL.days} days, got {period}"
        )
    return period


def duration_in_words(period: timedelta) -> str:
    """`90 seconds` -> "1 minute 30 seconds"; one hour -> "hour" (as in "every hour")."""
    seconds, words = int(period.total_seconds()), []
    for unit, size in _UNITS:
        if seconds == size:
            return unit  # "every hour", not "every 1 hour"
    for unit, size in _UNITS:
        if seconds >= size:
            count, seconds = divmod(seconds, size)
            words.append(f"{count} {unit}{'' if count == 1 else 's'}")
    return " ".join(words) or f"{period.total_seconds():g} seconds"


def _multiples(
    period: timedelta, after: datetime, until: datetime, limit: int | None
) -> list[datetime]:
    """The instants in (after, until] that are whole multiples of `period` since the
    epoch (UTC), in order; the first `limit`."""
    step = int(period.total_seconds())
    first = (math.floor(after.timestamp()) // step + 1) * step
    last = math.floor(until.timestamp())
    count = max(0, (last - first) // step + 1)
    if limit is not None:
        count = min(count, limit)
    return [datetime.fromtimestamp(first + n * step, _UTC) for n in range(count)]


def zone_of(name: str, label: str = "") -> tzinfo:
    """The time zone named `name` (IANA, like settings.TIME_ZONE), or ConfigurationError."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        where = f"schedule {label}: " if label else ""
        raise ConfigurationError(
            f"{where}{name!r} is not a time zone name (use an IANA name such as "
            f"'Europe/Paris' or 'UTC')"
        ) from None


def _first_pass(wall: datetime, zone: tzinfo, offset: timedelta) -> bool:
    """Whether the wall time `wall`, read at UTC `offset`, is its first (or only) pass."""
    return wall.replace(tzinfo=zone, fold=0).utcoffset() == offset


def _offset(moment: datetime, zone: tzinfo) -> timedelta:
    return moment.astimezone(zone).utcoffset() or timedelta(0)


def _changes(
    low: datetime, high: datetime, zone: tzinfo
) -> list[tuple[datetime, timedelta, timedelta]]:
    """The UTC-offset changes in (low, high]: (instant, offset before, offset after).

    Looked for in stretches of 30 days (no zone changes its offset twice in 30 days), so
    a window of seconds costs two offset lookups.
    """
    found = []
    start = low
    while start < high:
        end = min(start + timedelta(days=30), high)
        before, after = _offset(start, zone), _offset(end, zone)
        if before != after:
            at = _change_after(start, end, zone, before)
            found.append((at, before, _offset(at, zone)))
        start = end
    return found


def _change_after(low: datetime, high: datetime, zone: tzinfo, offset: timedelta) -> datetime:
    """The first instant in (low, high] whose offset is not `offset`, to the second."""
    low_s, high_s = math.floor(low.timestamp()), math.ceil(high.timestamp())
    while high_s - low_s > 1:
        middle = (low_s + high_s) // 2
        if _offset(datetime.fromtimestamp(middle, _UTC), zone) == offset:
            low_s = middle
        else:
            high_s = middle
    return datetime.fromtimestamp(high_s, _UTC)
