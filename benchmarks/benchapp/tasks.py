import time

from benchmarks.benchapp.models import Pickup
from django_skipqueue import task


@task
def noop() -> None:
    return None


@task
def mark_pickup(trial: int) -> None:
    Pickup.objects.create(trial=trial, started=time.time())


@task(takes_context=True, lease=3.0, max_attempts=20)
def recorded(context, ms: int = 5) -> None:  # noqa: ANN001
    from benchmarks.benchapp.models import Execution

    Execution.objects.create(job_id=context.job_id, attempt=context.attempt)
    time.sleep(ms / 1000)


@task
def sink(data: str) -> None:
    """A job whose cost is its arguments (benchmarks/large_payloads.py)."""
    return None
