"""python manage.py queuestats: the queue overview numbers, as a table or JSON."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_skipqueue.conf import get_settings
from django_skipqueue.management.preflight import require_migrated
from django_skipqueue.stats import jobs_in_progress, queue_stats

COLUMNS = [
    "queue",
    "pending_due",
    "scheduled",
    "waiting",
    "sleeping",
    "awaiting_signal",
    "running",
    "stuck",
    "failed",
    "lag_seconds",
    "done_5m",
    "done_1h",
    "live_workers",
    "live_relays",
    "paused",
    "limits",
    "broker_ready",
    "broker_dead",
]


#: The widest queue name printed in the table's first column.
NAME_WIDTH = 40


class Command(BaseCommand):
    help = (
        "Print, per queue: due and scheduled jobs, workflow jobs waiting on a parent, "
        "durable jobs sleeping or awaiting a signal, "
        "running, stuck (lease expired), failed, the age of the oldest due job (lag), jobs "
        "done in 5 minutes and 1 hour, live workers, whether it is paused and its limits; "
        "for a queue relayed to RabbitMQ, the messages ready in the broker and its dead "
        "letters (due and lag are then the relay's backlog)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON, for scripts.")

    def handle(self, *args: Any, **options: Any) -> None:
        require_migrated(get_settings().DATABASE_ALIAS)
        rows = [row.as_dict() for row in queue_stats()]
        table_rows = [
            {**row, **({} if row["relayed"] else {"broker_ready": "", "broker_dead": ""})}
            for row in rows
        ]
        if options["json"]:
            document = {"queues": rows, "in_progress": jobs_in_progress()}
            self.stdout.write(json.dumps(document, indent=2))
            return

        # A name longer than NAME_WIDTH (queue names may be 200 bytes) is printed whole on
        # a line of its own, its numbers on the next: the table keeps its width.
        def text(row: dict[str, Any], column: str) -> str:
            if column == "queue":
                return row["queue"] if len(row["queue"]) <= NAME_WIDTH else ""
            return _cell(row[column])

        widths = {c: max([len(c), *(len(text(r, c)) for r in table_rows)]) for c in COLUMNS}
        self.stdout.write("  ".join(c.ljust(widths[c]) for c in COLUMNS).rstrip())
        for row in table_rows:
            if len(row["queue"]) > NAME_WIDTH:
                self.stdout.write(row["queue"])
            self.stdout.write("  ".join(text(row, c).ljust(widths[c]) for c in COLUMNS).rstrip())
        if not rows:
            self.stdout.write(self.style.WARNING("no jobs and no live workers"))


def _cell(value: Any) -> str:
    if value is None:
        return "?"  # the broker was not reachable
    if isinstance(value, bool):
        return "paused" if value else "-"
    if value == "":
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)
