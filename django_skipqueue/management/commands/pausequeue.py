"""python manage.py pausequeue QUEUE [QUEUE ...]: no worker claims from them until resumed."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_skipqueue.conf import get_settings
from django_skipqueue.exceptions import InvalidJobError
from django_skipqueue.management.preflight import require_migrated
from django_skipqueue.models import Queue


class Command(BaseCommand):
    help = (
        "Pause queues: every worker stops claiming from them within a second (jobs already "
        "running finish). The pause is kept in the database until resumequeue."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queues", nargs="+", metavar="QUEUE")
        parser.add_argument(
            "--by", default="manage.py pausequeue", help="Who paused them, for the admin."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        database = get_settings().DATABASE_ALIAS
        require_migrated(database)
        try:
            changed = Queue.objects.db_manager(database).pause(options["queues"], by=options["by"])
        except InvalidJobError as error:
            raise CommandError(str(error)) from error
        names = ", ".join(options["queues"])
        self.stdout.write(
            self.style.SUCCESS(f"paused {changed} of {len(options['queues'])}: {names}")
        )
