"""python manage.py reapjobs: take back expired leases and prune old jobs."""

from __future__ import annotations

import argparse
import re
import threading
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_skipqueue.conf import get_settings
from django_skipqueue.maintenance.reaper import PRUNE_BATCH_SIZE, HousekeepingResult, Reaper
from django_skipqueue.management.arguments import configure_logging, positive_seconds, typed_options
from django_skipqueue.management.preflight import require_migrated
from django_skipqueue.runtime.stopsignals import StopSignals

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def duration(text: str) -> timedelta:
    """'7d', '12h', '30m', '45s', '1w' (a number and a unit) as a timedelta."""
    match = DURATION.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: use a number and a unit, like 7d, 12h, 30m or 45s"
        )
    return timedelta(seconds=float(match[1]) * UNITS[match[2]])


def batch_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError("must be between 1 and 100000")
    return value


class Command(BaseCommand):
    help = (
        "Reap expired leases (jobs whose worker died go back to pending, or to failed "
        "with no attempt left) and prune finished jobs, in bounded batches."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--loop", action="store_true", help="Run forever, every --interval.")
        parser.add_argument(
            "--interval",
            type=positive_seconds,
            default=10.0,
            metavar="SECONDS",
            help="Seconds between passes with --loop. Default: 10.",
        )
        parser.add_argument(
            "--prune-done-older-than",
            type=duration,
            metavar="DURATION",
            help="Delete done and cancelled jobs finished longer ago than this (7d, 12h, 30m).",
        )
        parser.add_argument(
            "--prune-failed-older-than",
            type=duration,
            metavar="DURATION",
            help="Delete failed jobs finished longer ago than this (7d, 12h, 30m).",
        )
        parser.add_argument(
            "--batch-size",
            type=batch_size,
            default=PRUNE_BATCH_SIZE,
            metavar="N",
            help=f"Jobs deleted per statement. Default: {PRUNE_BATCH_SIZE}.",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count what would be reaped and pruned; change nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        options = typed_options(self.create_parser("manage.py", "reapjobs"), options)
        configure_logging(self, options["verbosity"])
        reaper = Reaper(batch_size=options["batch_size"])
        require_migrated(reaper.database)
        stop = threading.Event()
        # Through StopSignals: a handler that set `stop` itself could deadlock.
        handling = StopSignals(lambda signum: stop.set()).handling()
        with handling if options["loop"] else nullcontext():
            while True:
                self.report(self.one_pass(reaper, options), options["dry_run"])
                if not options["loop"] or stop.wait(options["interval"]):
                    return

    def one_pass(self, reaper: Reaper, options: dict[str, Any]) -> HousekeepingResult:
        prune_workers = timedelta(seconds=get_settings().WORKER_PRUNE_AFTER_SECONDS)
        reaped = reaper.reap(dry_run=options["dry_run"])
        pruned = reaper.prune(
            done_older_than=options["prune_done_older_than"],
            failed_older_than=options["prune_failed_older_than"],
            workers_dead_for=prune_workers,
            dry_run=options["dry_run"],
        )
        return HousekeepingResult(
            requeued=reaped.requeued,
            failed=reaped.failed,
            cancelled=reaped.cancelled,
            expired=reaped.expired,
            locked_out=reaped.locked_out,
            pruned_done=pruned.pruned_done,
            pruned_failed=pruned.pruned_failed,
            pruned_workers=pruned.pruned_workers,
            pruned_workflows=pruned.pruned_workflows,
        )

    def report(self, result: HousekeepingResult, dry_run: bool) -> None:
        verb = "would " if dry_run else ""
        if result.locked_out:
            self.stdout.write(self.style.WARNING("another housekeeper is reaping; skipped"))
        line = (
            f"{verb}reap: {result.requeued} back to pending, {result.failed} failed, "
            f"{result.cancelled} cancelled, {result.expired} expired before they started; "
            f"{verb}prune: {result.pruned_done} done, {result.pruned_failed} failed, "
            f"{result.pruned_workers} dead workers, {result.pruned_workflows} workflows"
        )
        self.stdout.write(self.style.SUCCESS(line))
