"""python manage.py demo: sign-ups, webhooks and a scheduled report, run to the end."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Count
from django.test import Client

from django_skipqueue.models import FINISHED_STATES, Job, JobState
from django_skipqueue.testing import run_jobs
from shop.tasks import schedule_report


class Command(BaseCommand):
    help = "Enqueue a realistic mix of jobs through the example's views and run them all."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--signups", type=int, default=150, help="Sign-ups to post.")
        parser.add_argument("--orders", type=int, default=100, help="Orders to ship.")

    def handle(self, *args: object, **options: int) -> None:
        call_command("migrate", verbosity=0)
        run = uuid.uuid4().hex[:8]
        client = Client()
        started = time.monotonic()
        ids = []
        for n in range(options["signups"]):
            response = client.post("/signup/", {"username": f"u{run}{n}", "email": f"{n}@x.test"})
            ids.append(response.json()["job"])
        for n in range(options["orders"]):
            callback = "https://down.example/hook" if n % 25 == 0 else "https://hooks.example/o"
            ids.append(client.post(f"/orders/{n}/ship/", {"callback": callback}).json()["job"])
        schedule_report("today", timedelta(seconds=1))
        ids.append(Job.objects.latest("id").id)
        jobs = Job.objects.filter(id__in=ids)
        self.stdout.write(f"enqueued {len(ids)} jobs; running them")

        deadline = time.monotonic() + 60
        while jobs.exclude(state__in=FINISHED_STATES).exists() and time.monotonic() < deadline:
            if not run_jobs(["default", "webhooks", "reports"]):
                time.sleep(0.05)
        elapsed = time.monotonic() - started

        states = dict(jobs.values_list("state").annotate(n=Count("id")))
        retried = jobs.filter(attempts__gt=1).count()
        unfinished = len(ids) - sum(states.get(state, 0) for state in FINISHED_STATES)
        self.stdout.write(
            f"done={states.get(JobState.DONE, 0)} retried={retried} "
            f"failed_as_designed={states.get(JobState.FAILED, 0)} "
            f"throughput={len(ids) / elapsed:.0f} jobs/s"
        )
        if unfinished:
            raise CommandError(f"{unfinished} jobs did not reach a final state")
        self.stdout.write(self.style.SUCCESS(f"all {len(ids)} jobs reached a final state"))
