"""python manage.py schedules: the periodic schedules, their last and next occurrence."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from django_skipqueue.conf import get_settings
from django_skipqueue.maintenance.scheduler import schedule_statuses
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

    def handle(self, *args: Any, **options: Any) -> None:
        database = get_settings().DATABASE_ALIAS
        require_migrated(database)
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


def _moment(value: datetime | None) -> str:
    """In the project's time zone (settings.TIME_ZONE), to the second."""
    return "-" if value is None else timezone.localtime(value).strftime("%Y-%m-%d %H:%M:%S %Z")
