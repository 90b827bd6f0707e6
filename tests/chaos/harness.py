"""The shared fault-test harness: a supervisor of worker processes and checks C1-C7.

Checks are counts over the job table, the audit trigger's rows (testapp_jobaudit), the
probe's run log (testapp_run) and its effects; each must equal the stated value.
"""

from __future__ import annotations

import json
import random
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from django.db import connection

from tests.processes import WorkerHandle


class Supervisor:
    """Starts, kills and restarts runworker processes; keeps their logs."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        #: The database's deadlock counter when the test began: C7 counts from here, so
        #: one test's deadlock is not every later test's.
        self.deadlocks_at_start = deadlocks()
        self.workers: list[WorkerHandle] = []
        self.retired: list[WorkerHandle] = []
        self.others: list[WorkerHandle] = []
        self.kills = 0

    def start(
        self,
        *args: str,
        settings: dict | None = None,
        pg_options: str = "",
        clock_skew: float = 0.0,
        command: str = "runworker",
    ) -> WorkerHandle:
        index = len(self.workers) + len(self.retired)
        env = {"SKIPQUEUE_TEST_SETTINGS": json.dumps(settings or {})}
        if clock_skew:  # this worker's process clock is off by this many seconds
            env["SKIPQUEUE_TEST_CLOCK_SKEW_SECONDS"] = str(clock_skew)
        if pg_options:
            env["SKIPQUEUE_TEST_PG_OPTIONS"] = pg_options
        handle = WorkerHandle(
            ["-v", "1", *args], self.log_dir / f"worker-{index}.log", command, **env
        )
        self.workers.append(handle)
        return handle

    def start_command(self, command: str, *args: str) -> WorkerHandle:
        """Another management command (reapjobs --loop, say), stopped at teardown."""
        index = len(self.workers) + len(self.retired) + len(self.others)
        handle = WorkerHandle(list(args), self.log_dir / f"{command}-{index}.log", command)
        self.others.append(handle)
        return handle

    def kill_random(self, rng: random.Random, signum: int = signal.SIGKILL) -> WorkerHandle:
        victim = rng.choice(self.workers)
        victim.signal(signum)
        victim.wait(timeout=10)
        self.workers.remove(victim)
        self.retired.append(victim)
        self.kills += 1
        return victim

    def logs(self) -> str:
        return "".join(handle.output() for handle in [*self.retired, *self.workers])

    def count_in_logs(self, pattern: str) -> int:
        return len(re.findall(pattern, self.logs()))

    def stop_all(self) -> None:
        for handle in [*self.workers, *self.retired, *self.others]:
            handle.stop()


def scalar(sql: str, params: list | None = None) -> int:
    with connection.cursor() as cursor:
        cursor.execute(sql, params or [])
        return int(cursor.fetchone()[0] or 0)


@dataclass
class Report:
    """The figures of one fault run; `violations()` lists the checks that failed."""

    jobs: int
    figures: dict[str, int] = field(default_factory=dict)

    def violations(self) -> list[str]:
        bad = []
        for name in (
            "C1_lost",
            "C2_terminal_changed",
            "C3_runs_unbounded",
            "C4_foreign_ack",
            "C5_over_budget",
            "C7_deadlocks",
        ):
            if self.figures.get(name, 0):
                bad.append(f"{name}={self.figures[name]}")
        if self.figures["C6_duplicate_runs"] > self.figures["C6_allowance"]:
            bad.append("C6: more runs than claims")
        return bad

    def __str__(self) -> str:
        return " ".join(f"{key}={value}" for key, value in self.figures.items())


def deadlocks() -> int:
    return scalar("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")


def check(job_ids: list[int], deadlocks_before: int) -> Report:
    """C1-C7 over the given jobs (docs/explanation/failure-model.md, "The harness")."""
    ids = list(job_ids)
    figures = {
        "C1_lost": len(ids)
        - scalar(
            "SELECT count(*) FROM skipqueue_job WHERE id = ANY(%s) "
            "AND state IN ('done', 'failed', 'cancelled')",
            [ids],
        ),
        "C2_terminal_changed": scalar(
            "SELECT count(*) FROM testapp_jobaudit WHERE job_id = ANY(%s) "
            "AND old_state IN ('done', 'failed', 'cancelled')",
            [ids],
        ),
        # Each claim runs the body at most once: runs never exceed attempts. (The plan's
        # 1 + expirations + releases leaves out attempts that failed and were retried,
        # which a database restart causes legitimately.)
        "C3_runs_unbounded": scalar(
            "SELECT count(*) FROM skipqueue_job j JOIN (SELECT job_id, count(*) AS runs "
            "FROM testapp_run GROUP BY job_id) r ON r.job_id = j.id WHERE j.id = ANY(%s) "
            "AND r.runs > j.attempts",
            [ids],
        ),
        "C4_foreign_ack": scalar(
            "SELECT count(*) FROM testapp_jobaudit WHERE job_id = ANY(%s) "
            "AND old_state = 'running' AND new_state = 'done' "
            "AND old_attempts <> new_attempts",
            [ids],
        ),
        "C5_over_budget": scalar(
            "SELECT count(*) FROM skipqueue_job WHERE id = ANY(%s) AND attempts > max_attempts",
            [ids],
        ),
        "C6_duplicate_runs": scalar(
            "SELECT count(*) - count(DISTINCT job_id) FROM testapp_run WHERE job_id = ANY(%s)",
            [ids],
        ),
        "C6_allowance": scalar(  # every extra run is a later claim of the same job
            "SELECT sum(GREATEST(attempts - 1, 0)) FROM skipqueue_job WHERE id = ANY(%s)",
            [ids],
        ),
        "retried_after_failure": scalar(
            "SELECT count(*) FROM skipqueue_job WHERE id = ANY(%s) "
            "AND attempts > 1 + expirations + releases",
            [ids],
        ),
        "C7_deadlocks": deadlocks() - deadlocks_before,
        "done": scalar(
            "SELECT count(*) FROM skipqueue_job WHERE id = ANY(%s) AND state = 'done'", [ids]
        ),
        "acked_done_twice": scalar(
            "SELECT count(*) FROM (SELECT job_id FROM testapp_jobaudit WHERE job_id = ANY(%s) "
            "AND new_state = 'done' GROUP BY job_id HAVING count(*) > 1) twice",
            [ids],
        ),
        "expirations": scalar(
            "SELECT sum(expirations) FROM skipqueue_job WHERE id = ANY(%s)", [ids]
        ),
        "reaped_transitions": scalar(
            "SELECT count(*) FROM testapp_jobaudit WHERE job_id = ANY(%s) "
            "AND new_expirations = old_expirations + 1",
            [ids],
        ),
        "duplicate_effects": scalar(
            "SELECT count(*) FROM testapp_duplicateeffect WHERE job_id = ANY(%s)", [ids]
        ),
    }
    return Report(jobs=len(ids), figures=figures)
