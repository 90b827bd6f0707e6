"""python manage.py resumequeue QUEUE [QUEUE ...]: workers claim from them again."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_skipqueue.conf import get_settings
from django_skipqueue.management.preflight import require_migrated
from django_skipqueue.models import Queue


class Command(BaseCommand):
    help = "Resume paused queues: every worker claims from them again within a second."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queues", nargs="+", metavar="QUEUE")

    def handle(self, *args: Any, **options: Any) -> None:
        database = get_settings().DATABASE_ALIAS
        require_migrated(database)
        changed = Queue.objects.db_manager(database).resume(options["queues"])
        names = ", ".join(options["queues"])
        self.stdout.write(
            self.style.SUCCESS(f"resumed {changed} of {len(options['queues'])}: {names}")
        )
