"""python manage.py schedules: the periodic schedules, their last and next occurrence."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from django_skipqueue.conf import get_settings
from django_skipqueue.maintenance.scheduler import backfill, schedule_statuses
from django_skipqueue.management.preflight import require_migrated
from django_skipqueue.models import Schedule

COLUMNS = ["name", "task", "cron", "timezone", "state", "last_occurrence_at", "next_occurrence_at"]


class Command(BaseCommand):
    help = (
        "List the periodic schedules (from @task(schedule=...) and SKIPQUEUE['SCHEDULES']) "
        "with their state and their last and next occurrence; pause or resume some."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON, for scripts.")
        parser.add_argument(
            "--pause",
            nargs="+",
            metavar="NAME",
            help="Pause these schedules: no occurrence is enqueued until resumed.",
        )
        parser.add_argument(
            "--resume",
            nargs="+",
            metavar="NAME",
            help="Resume these schedules from now (occurrences passed while paused are not run).",
        )
        parser.add_argument(
            "--backfill",
            metavar="NAME",
            help="Enqueue the schedule's past occurrences from --from to --to, each once "
            "(those enqueued already are skipped); its own progress is left as it is.",
        )
        parser.add_argument(
            "--from", dest="start", metavar="WHEN", help="With --backfill: after this instant."
        )
        parser.add_argument(
            "--to", dest="end", metavar="WHEN", help="With --backfill: up to this instant (now)."
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="With --backfill: list, enqueue nothing."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        database = get_settings().DATABASE_ALIAS
        require_migrated(database)
        if options["backfill"]:
            self._backfill(options, database)
            return
        schedules = Schedule.objects.db_manager(database)
        for verb in ("pause", "resume"):
            names = options[verb]
            if not names:
                continue
            known = set(schedules.filter(name__in=names).values_list("name", flat=True))
            unknown = sorted(set(names) - known)
            if unknown:
                raise CommandError(
                    f"no schedule named {', '.join(map(repr, unknown))} in the database "
                    f"(a worker records the code's schedules when it starts)"
                )
            changed = (
                schedules.pause(names, by="manage.py schedules")
                if verb == "pause"
                else (schedules.resume(names))
            )
            self.stdout.write(self.style.SUCCESS(f"{verb}d {changed} of {len(names)}"))
        statuses = schedule_statuses(database)
        if options["json"]:
            rows = [status.as_dict() for status in statuses]
            self.stdout.write(json.dumps({"schedules": rows}, indent=2))
            return
        if not statuses:
            self.stdout.write(self.style.WARNING("no periodic schedules"))
            return
        cells = [
            {
                "name": status.name,
                "task": status.task,
                "cron": status.expression,
                "timezone": status.timezone,
                "state": status.state,
                "last_occurrence_at": _moment(status.last_occurrence_at),
                "next_occurrence_at": _moment(status.next_occurrence_at),
            }
            for status in statuses
        ]
        widths = {c: max([len(c), *(len(r[c]) for r in cells)]) for c in COLUMNS}
        self.stdout.write("  ".join(c.ljust(widths[c]) for c in COLUMNS).rstrip())
        for row, status in zip(cells, statuses, strict=True):
            self.stdout.write("  ".join(row[c].ljust(widths[c]) for c in COLUMNS).rstrip())
            if status.next_runs:  # under its row: the expression's meaning, in words
                self.stdout.write(f"    {status.next_runs}")

    def _backfill(self, options: dict[str, Any], database: str) -> None:
        if not options["start"]:
            raise CommandError("--backfill needs --from: the instant the range starts after")
        start = _instant(options["start"], "--from")
        end = _instant(options["end"], "--to") if options["end"] else timezone.now()
        try:
            done = backfill(
                options["backfill"], start, end, database=database, dry_run=options["dry_run"]
            )
        except ValueError as error:
            raise CommandError(str(error)) from error
        for occurrence in done.occurrences if options["dry_run"] else ():
            self.stdout.write(_moment(occurrence))
        verb = "would enqueue" if options["dry_run"] else "enqueued"
        count = len(done.occurrences) if options["dry_run"] else done.enqueued
        self.stdout.write(
            self.style.SUCCESS(
                f"{verb} {count} of {len(done.occurrences)} occurrences of "
                f"{options['backfill']!r} in ({_moment(start)}, {_moment(end)}]"
            )
        )


def _instant(text: str, option: str) -> datetime:
    """An ISO 8601 date or time; without an offset, in the project's time zone."""
    try:
        moment = parse_datetime(text)
        if moment is None:
            day = parse_date(text)
            moment = datetime(day.year, day.month, day.day) if day is not None else None
    except ValueError:  # well formed, not a day of the calendar: 2026-02-30
        moment = None
    if moment is None:
        raise CommandError(f"{option} {text!r} is not a date or a time like 2026-12-01T09:00")
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


def _moment(value: datetime | None) -> str:
    """In the project's time zone (settings.TIME_ZONE), to the second."""
    return "-" if value is None else timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S %Z")
