"""python manage.py demo: watch jobs survive a crashed worker.

Migrates, enqueues a realistic mix of about 2,000 jobs through the example's views
(sign-ups with welcome emails, order webhooks that are sometimes flaky and once in a
while down for good, scheduled reports), starts two `runworker` processes, SIGKILLs
one in the middle of the run and starts a replacement, and shows live progress. At the
end it checks that every job reached a final state and exits non-zero if one did not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Count, Sum
from django.test import Client

from django_skipqueue.embedded import describe
from django_skipqueue.models import FINISHED_STATES, Job, JobState
from shop.models import WelcomeEmail
from shop.tasks import schedule_report

MANAGE = Path(__file__).resolve().parents[3] / "manage.py"
LOG_DIR = MANAGE.parent / ".demo-logs"
QUEUES = ["default", "webhooks", "reports"]


class Command(BaseCommand):
    help = "Enqueue about 2,000 jobs, run them on two workers, kill one mid-run, check."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--signups", type=int, default=1200, help="Sign-ups to post.")
        parser.add_argument("--orders", type=int, default=750, help="Orders to ship.")
        parser.add_argument("--reports", type=int, default=50, help="Scheduled reports.")
        parser.add_argument("--timeout", type=float, default=50.0, help="Seconds to wait.")

    def handle(self, *args: Any, **options: Any) -> None:
        if settings.EMBEDDED_POSTGRES_DIR is not None:
            self.stdout.write(f"database: embedded PostgreSQL in {settings.EMBEDDED_POSTGRES_DIR}")
        call_command("migrate", verbosity=0)
        started = time.monotonic()
        ids = self.enqueue(options)
        self.stdout.write(
            f"enqueued {len(ids)} jobs through the views in {time.monotonic() - started:.1f}s"
        )

        workers = [self.start_worker(), self.start_worker()]
        self.stdout.write(f"started 2 workers: pids {workers[0].pid}, {workers[1].pid}")
        jobs = Job.objects.filter(id__in=ids)
        run_started = time.monotonic()
        killed = False
        deadline = run_started + options["timeout"]
        try:
            while True:
                states = dict(jobs.values_list("state").annotate(n=Count("id")))
                finished = sum(states.get(state, 0) for state in FINISHED_STATES)
                self.progress(states, finished, len(ids), time.monotonic() - run_started)
                if not killed and finished >= len(ids) // 3:
                    victim = workers.pop(0)
                    victim.send_signal(signal.SIGKILL)
                    victim.wait()
                    workers.append(self.start_worker())
                    killed = True
                    self.stdout.write(
                        ("\n" if self.on_terminal else "")
                        + f"SIGKILL worker pid {victim.pid} in the middle of the run; "
                        f"started pid {workers[-1].pid}"
                    )
                if finished == len(ids) or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=30)
        if self.on_terminal:
            self.stdout.write("")  # end the redrawn progress line
        self.summary(jobs, len(ids), time.monotonic() - run_started, options)

    def enqueue(self, options: dict[str, Any]) -> list[int]:
        run = uuid.uuid4().hex[:6]
        client = Client()
        ids = []
        for n in range(options["signups"]):
            response = client.post(
                "/signup/", {"username": f"demo-{run}-{n}", "email": f"user{n}@example.com"}
            )
            ids.append(response.json()["job"])
        for n in range(options["orders"]):
            callback = "https://down.example/hook" if n % 50 == 0 else "https://hooks.example/o"
            ids.append(client.post(f"/orders/{n}/ship/", {"callback": callback}).json()["job"])
        before = Job.objects.order_by("-id").values_list("id", flat=True).first() or 0
        for n in range(options["reports"]):
            schedule_report(f"day-{n}", timedelta(seconds=2 + n % 4))
        ids.extend(
            Job.objects.filter(id__gt=before, task__endswith="nightly_report").values_list(
                "id", flat=True
            )
        )
        return ids

    def start_worker(self) -> subprocess.Popen[bytes]:
        args = [
            sys.executable,
            str(MANAGE),
            "runworker",
            "--concurrency",
            "4",
            "--reap-interval",
            "1",
            "-v",
            "0",
        ]
        for queue in QUEUES:
            args += ["--queue", queue]
        LOG_DIR.mkdir(exist_ok=True)
        self.worker_count = getattr(self, "worker_count", 0) + 1
        log = open(LOG_DIR / f"worker-{self.worker_count}.log", "w")  # noqa: SIM115
        return subprocess.Popen(args, env=dict(os.environ), stdout=log, stderr=log)

    @property
    def on_terminal(self) -> bool:
        """Whether our output is a terminal: progress then redraws one line with `\r`;
        into a file or a pipe it is a plain line every few seconds instead."""
        isatty = getattr(self.stdout, "isatty", None)
        return bool(isatty and isatty())

    def progress(self, states: dict[str, int], finished: int, total: int, elapsed: float) -> None:
        if not self.on_terminal:
            shown = getattr(self, "progress_shown", None)
            if finished < total and shown is not None and elapsed - shown < 2.0:
                return
            self.progress_shown = elapsed
        line = (
            f"{finished:5}/{total} finished  done {states.get(JobState.DONE, 0):5}  "
            f"failed {states.get(JobState.FAILED, 0):3}  running "
            f"{states.get(JobState.RUNNING, 0):3}  pending {states.get(JobState.PENDING, 0):5}  "
            f"{finished / max(elapsed, 1e-6):5.0f} jobs/s  "
        )
        if self.on_terminal:
            self.stdout.write("\r" + line, ending="")
        else:
            self.stdout.write(line.rstrip())
        self.stdout.flush()

    def summary(self, jobs: Any, total: int, elapsed: float, options: dict[str, Any]) -> None:
        states = dict(jobs.values_list("state").annotate(n=Count("id")))
        unfinished = total - sum(states.get(state, 0) for state in FINISHED_STATES)
        retried = jobs.filter(attempts__gt=1).count()
        expired = jobs.aggregate(n=Sum("expirations"))["n"] or 0
        recovered = jobs.filter(expirations__gt=0, state=JobState.DONE).count()
        emails = WelcomeEmail.objects.filter(
            idempotency_key__in=[
                f"skipqueue-job-{i}"
                for i in jobs.filter(task__endswith="send_welcome_email").values_list(
                    "id", flat=True
                )
            ]
        ).count()
        lines = [
            f"done                     {states.get(JobState.DONE, 0)}",
            f"retried (attempts > 1)   {retried}",
            f"failed as designed       {states.get(JobState.FAILED, 0)}  (the endpoint that "
            f"is always down, and flaky calls that failed all 3 attempts)",
            f"leases expired           {expired}  (jobs held by the killed worker)",
            f"recovered and done       {recovered}",
            f"welcome emails sent      {emails} for {options['signups']} sign-ups "
            f"(idempotency key: none twice)",
            f"throughput               {total / elapsed:.0f} jobs/s over {elapsed:.1f}s",
        ]
        for line in lines:
            self.stdout.write(f"  {line}")
        if unfinished:
            raise CommandError(f"{unfinished} of {total} jobs did not reach a final state")
        self.stdout.write(self.style.SUCCESS(f"all {total} jobs reached a final state: none lost"))
        self.stdout.write(f"worker logs: {LOG_DIR}")
        if settings.EMBEDDED_POSTGRES_DIR is not None:
            self.stdout.write("the embedded PostgreSQL keeps running, for the next run:")
            for line in describe(settings.EMBEDDED_POSTGRES_DIR).splitlines():
                self.stdout.write(f"  {line}")
