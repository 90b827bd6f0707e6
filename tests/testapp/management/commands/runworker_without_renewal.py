"""runworker whose leases are never renewed: every job has exactly its lease (T3)."""

from __future__ import annotations

from typing import Any

from django_skipqueue.management.commands.runworker import Command as RunWorker
from django_skipqueue.runtime.worker import Worker


class Command(RunWorker):
    help = "runworker with lease renewal off, for the lease-boundary fault test."

    def make_worker(self, options: dict[str, Any]) -> Worker:
        worker = super().make_worker(options)
        worker.renew_leases = False
        return worker
