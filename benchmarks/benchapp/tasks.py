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


@task(takes_context=True, max_attempts=3)
def stepped(context, steps: int, atomic: bool = False, fail_at: int = 0) -> int:  # noqa: ANN001
    """`steps` no-op durable steps (benchmarks/steps.py); raises once at step `fail_at`
    on the first attempt, so that the second resumes after the recorded ones."""

    def body(index: int) -> int:
        if index == fail_at and context.attempt == 1:
            raise RuntimeError("stop here once")
        return index

    run = context.atomic_step if atomic else context.step
    for index in range(1, steps + 1):
        run("s", body, index)
    return steps


@task(takes_context=True)
def parked(context, kind: str) -> object:  # noqa: ANN001
    """A job that parks at once (benchmarks/steps.py --parked): a sleep of an hour, or a
    wait for the signal "go" (whose payload it returns)."""
    if kind == "sleep":
        context.sleep("nap", 3600)
        return None
    return context.wait_for("go")
