"""Tasks: the @task decorator, Task (a frozen, configurable handle) and TaskContext.

Importing this module never imports models: `@task` runs at import time of user
modules, possibly before the app registry is ready.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, Literal, ParamSpec, TypeAlias, TypeVar, overload

from django_skipqueue.conf import get_settings
from django_skipqueue.conf.limits import (
    MAX_CONCURRENCY,
    MAX_RATE_PERIOD,
    canonical_rate,
    check_fair_weight,
    whole_number_from_1,
)
from django_skipqueue.core.cron import Cron
from django_skipqueue.core.payload import normalize_arguments
from django_skipqueue.core.retry import RetryPolicy
from django_skipqueue.core.spec import (
    ON_CONFLICT_CHOICES,
    CallRule,
    JobSpec,
    KeyRule,
    call_signature,
    valid_key,
)
from django_skipqueue.core.states import (
    DEFAULT_QUEUE_NAME,
    validate_queue_name,
)
from django_skipqueue.exceptions import (
    ConfigurationError,
    InvalidJobError,
)

# TaskContext and progress_report lived here before tasks/context.py: importable from
# here still (`from django_skipqueue import TaskContext` is the documented path).
from django_skipqueue.tasks.context import TaskContext, progress_report
from django_skipqueue.tasks.options import (
    validate_expires,
    validate_lease,
    validate_max_attempts,
    validate_priority,
    validate_run_after,
)
from django_skipqueue.tasks.registry import registry

if TYPE_CHECKING:
    from django_skipqueue.models import Job
    from django_skipqueue.queue.managers import JobManager

P = ParamSpec("P")
R = TypeVar("R")
#: A task's unique key: a string, parameter names, or a function of the call's arguments.
UniqueKey: TypeAlias = "str | Sequence[str] | Callable[..., str]"
#: A periodic schedule: a cron expression, an interval (`timedelta(seconds=30)` or
#: "@every 30s"), or a Cron with its own arguments, queue or policy.
Schedule: TypeAlias = "str | timedelta | Cron"


def default_retry_policy() -> RetryPolicy:
    """The project-wide policy from SKIPQUEUE's RETRY_* settings."""
    conf = get_settings()
    return RetryPolicy(
        base=conf.RETRY_BASE_SECONDS, cap=conf.RETRY_CAP_SECONDS, jitter=conf.RETRY_JITTER
    )


@dataclass(frozen=True, kw_only=True)
class Task(Generic[P, R]):
    """A registered task. `using()` returns a configured copy; the original is unchanged.

    Options left as None take the project defaults from SKIPQUEUE at enqueue time.
    """

    func: Callable[P, R]
    name: str
    queue_name: str = DEFAULT_QUEUE_NAME
    priority: int = 0
    run_after: datetime | timedelta | None = None
    max_attempts: int | None = None
    lease: timedelta | None = None
    retry: RetryPolicy | None = None
    non_retryable: tuple[type[BaseException], ...] = ()
    takes_context: bool = False
    database: str | None = None
    #: The hard time limit (`time_limit=`, or its older name `timeout=`): past it the
    #: attempt ends with TimeLimitExceeded (`check_cancelled()` raises it); a task whose
    #: code has not stopped a second later makes its worker process exit (code 3), to be
    #: replaced (runtime/timelimits.py). None: no limit.
    timeout: timedelta | None = None
    #: The soft time limit: past it, `context.check_cancelled()` raises
    #: SoftTimeLimitExceeded, and `context.time_left` counts down to it.
    soft_time_limit: timedelta | None = None
    #: The django.tasks Task this one runs, when declared with Django's @task under
    #: SkipQueueBackend (see backends.py).
    django_task: Any = None
    #: Unique jobs: the key a call holds while its job is unfinished (see `key_for`): a
    #: string, the names of the parameters it is made of, or a function of the call's
    #: arguments returning it. None: jobs of this task are not unique.
    unique_key: UniqueKey | None = None
    #: What an enqueue whose key is held does: "existing" (return the holder), "replace"
    #: (give a pending holder this call's arguments and run time) or "raise".
    on_conflict: str = "existing"
    #: Periodic schedules (`@task(schedule=...)`), each bound to this task.
    schedules: tuple[Cron, ...] = ()
    #: Flow control: jobs whose calls share this key (a string, parameter names, or a
    #: function of the call's arguments, as `unique_key`) run at most
    #: `concurrency_limit` at a time across every worker. None: no key.
    concurrency_key: UniqueKey | None = None
    concurrency_limit: int = 1
    #: A job not started by then never runs: it ends cancelled, by skipqueue:expired. A
    #: delay after the enqueue (after the occurrence, for a schedule's job), or, for one
    #: call (`.using(expires=...)`), an instant.
    expires: datetime | timedelta | None = None
    #: At most this many starts of this task's jobs per period, across every worker:
    #: "10/s", "100/m" or "5000/h" (Celery's `rate_limit`). None: no limit.
    rate_limit: str | None = None
    #: A rate limit per key: `rate_limit` applies to each value of this key (a string,
    #: parameter names, or a function of the call's arguments, as `unique_key`), e.g.
    #: per tenant or per partner account. None: one limit for the whole task.
    rate_key: UniqueKey | None = None
    #: Fair share in a fair queue (SKIPQUEUE['FAIR_QUEUES']): the key its jobs share the
    #: workers by (a tenant; made as `unique_key` is), and their weight (1 to 1000): while
    #: several keys have due jobs, each gets claims in proportion to its weight. None:
    #: the queue's jobs without a key share one key, "".
    fair_key: UniqueKey | None = None
    fair_weight: int = 1
    #: Debounce (queue/coalesce.py): a call waits this long for another of the same
    #: `debounce_key` (made as `unique_key` is; None: one key for the task); each one
    #: that comes meanwhile gives the pending job its arguments and starts the wait
    #: again, up to `debounce_max_wait` after the first. The job runs once, with the
    #: last call's arguments.
    debounce: timedelta | None = None
    debounce_max_wait: timedelta | None = None
    debounce_key: UniqueKey | None = None
    #: Throttle: at most one run per this period for each `throttle_key` (None: one key
    #: for the task); the first call runs at once, and the calls that come while a job
    #: waits join it (the first call's arguments), which runs once the period has passed.
    throttle: timedelta | None = None
    throttle_key: UniqueKey | None = None
    #: Strict order per key: jobs whose calls share this key (made as `unique_key` is)
    #: run one at a time, in the order they were enqueued, across every worker and
    #: every task that names the key. `order_failed`: "hold" (a failed job holds the
    #: later ones until it is retried and ends, or deleted) or "skip" (they go on).
    ordered_key: UniqueKey | None = None
    order_failed: str = "hold"

    def __post_init__(self) -> None:
        validate_queue_name(self.queue_name)
        if self.rate_limit is not None:
            rate = canonical_rate(self.rate_limit, f"rate_limit of {self.name}")
            object.__setattr__(self, "rate_limit", rate)
        object.__setattr__(self, "expires", validate_expires(self.expires))
        validate_priority(self.priority)
        validate_run_after(self.run_after)
        validate_max_attempts(self.max_attempts)
        object.__setattr__(self, "lease", validate_lease(self.lease))
        object.__setattr__(self, "timeout", validate_lease(self.timeout, "time_limit"))
        soft = validate_lease(self.soft_time_limit, "soft_time_limit")
        object.__setattr__(self, "soft_time_limit", soft)
        if soft is not None and self.timeout is not None and soft >= self.timeout:
            raise ConfigurationError(
                f"soft_time_limit of {self.name} ({soft.total_seconds():g}s) must be shorter "
                f"than its time_limit ({self.timeout.total_seconds():g}s)"
            )
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise ConfigurationError(f"retry must be a RetryPolicy, got {self.retry!r}")
        if isinstance(self.non_retryable, type):
            object.__setattr__(self, "non_retryable", (self.non_retryable,))
        for kind in self.non_retryable:
            if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                raise ConfigurationError(f"non_retryable holds {kind!r}, not an exception class")
        if self.on_conflict not in ON_CONFLICT_CHOICES:
            raise InvalidJobError(
                f"on_conflict={self.on_conflict!r} is not one of {', '.join(ON_CONFLICT_CHOICES)}"
            )
        object.__setattr__(self, "unique_key", self._checked_key(self.unique_key, "unique_key"))
        object.__setattr__(
            self, "concurrency_key", self._checked_key(self.concurrency_key, "concurrency_key")
        )
        object.__setattr__(self, "rate_key", self._checked_key(self.rate_key, "rate_key"))
        object.__setattr__(self, "fair_key", self._checked_key(self.fair_key, "fair_key"))
        check_fair_weight(self.fair_weight, self.name)
        self._check_coalescing()
        object.__setattr__(self, "ordered_key", self._checked_key(self.ordered_key, "ordered_key"))
        if self.order_failed not in ("hold", "skip"):
            raise ConfigurationError(
                f"order_failed of {self.name} is 'hold' or 'skip', got {self.order_failed!r}"
            )
        if self.ordered_key is not None and self.concurrency_key is not None:
            raise ConfigurationError(
                f"{self.name}: ordered_key runs its key's jobs one at a time already: "
                f"drop concurrency_key"
            )
        if self.rate_key is not None and self.rate_limit is None:
            raise ConfigurationError(
                f"rate_key of {self.name} names what a rate limit is counted per, but "
                f"{self.name} has no rate_limit: give it one, such as rate_limit='100/m'"
            )
        limit = self.concurrency_limit
        if not whole_number_from_1(limit, MAX_CONCURRENCY):
            raise InvalidJobError(
                f"concurrency_limit must be 1 to {MAX_CONCURRENCY}, got {limit!r}"
            )

    def _check_coalescing(self) -> None:
        """Debounce and throttle: their delays as timedeltas, and the options they cannot
        go with refused in words (ConfigurationError)."""
        for option, most in (("debounce", MAX_COALESCE), ("debounce_max_wait", MAX_COALESCE)):
            object.__setattr__(
                self, option, _period(getattr(self, option), option, self.name, most)
            )
        throttle = _period(self.throttle, "throttle", self.name, timedelta(seconds=MAX_RATE_PERIOD))
        object.__setattr__(self, "throttle", throttle)
        for option in ("debounce_key", "throttle_key"):
            object.__setattr__(self, option, self._checked_key(getattr(self, option), option))
        problems = []
        if self.debounce is None and (self.debounce_key is not None or self.debounce_max_wait):
            problems.append("debounce_key and debounce_max_wait need debounce")
        if throttle is None and self.throttle_key is not None:
            problems.append("throttle_key needs throttle")
        if self.debounce is not None and throttle is not None:
            problems.append("debounce and throttle do not go together: choose one")
        if (self.debounce is not None or throttle is not None) and self.unique_key is not None:
            problems.append(
                "debounce and throttle keep one pending job per key already: drop unique_key"
            )
        if throttle is not None and self.rate_limit is not None:
            problems.append("throttle is a rate of one run per period: drop rate_limit")
        if throttle is not None and self.rate_key is not None:
            problems.append("a throttle counts its runs per throttle_key: drop rate_key")
        if throttle is not None and throttle.total_seconds() % 1:
            problems.append("throttle is a whole number of seconds")
        if (self.debounce is not None or throttle is not None) and self.ordered_key is not None:
            problems.append(
                "debounce and throttle join calls into one job, which an ordered key "
                "cannot keep in order: drop one"
            )
        wait = self.debounce_max_wait
        if wait is not None and self.debounce is not None and wait < self.debounce:
            problems.append("debounce_max_wait is shorter than debounce")
        if problems:
            raise ConfigurationError(f"{self.name}: {'; '.join(problems)}")

    def _checked_key(self, key: Any, option: str) -> Any:
        if key is None or callable(key):
            return key
        if isinstance(key, str):
            return valid_key(key, self.name, option)
        if isinstance(key, (tuple, list)) and key and all(isinstance(n, str) for n in key):
            signature = call_signature(self.func, self.takes_context)
            known = set(signature.parameters) if signature is not None else set(key)
            unknown = [name for name in key if name not in known]
            if unknown:
                raise ConfigurationError(
                    f"{option} of {self.name} names {', '.join(unknown)}, which "
                    f"{self.name} does not take; name its parameters"
                )
            return tuple(key)
        raise ConfigurationError(
            f"{option} of {self.name} must be a string, a list of parameter names or a "
            f"function of the call's arguments, got {key!r}"
        )

    @property
    def positional_names(self) -> tuple[str, ...]:
        """The names of the parameters a job's positional arguments fill, in order (the
        context left out), for the admin's masking of secret ones; () if unknown."""
        try:
            parameters = list(inspect.signature(self.func).parameters.values())
        except (TypeError, ValueError):
            return ()
        if self.takes_context or (self.django_task is not None and self.django_task.takes_context):
            parameters = parameters[1:]
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = tuple(p.name for p in parameters if p.kind in kinds)
        rest = [p.name for p in parameters if p.kind == inspect.Parameter.VAR_POSITIONAL]
        # `*passwords`: every argument past the named ones fills it (redact_call).
        return (*names, f"*{rest[0]}") if rest else names

    @property
    def time_limit(self) -> timedelta | None:
        """The hard time limit (stored as `timeout`, its older name)."""
        return self.timeout

    @property
    def call_rule(self) -> CallRule:
        """Which calls this task's function accepts (checked at enqueue)."""
        return CallRule(self.name, self.func, self.takes_context)

    def _key_rule(self, source: Any, option: str) -> KeyRule | None:
        return KeyRule(option, source, self.call_rule) if source is not None else None

    def key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The unique key of one call: the string `unique_key`, or the named parameters'
        values as JSON (`invoice_id=42`, defaults applied), or what the function
        `unique_key` returns for these arguments."""
        return self._rule("unique_key").of(args, kwargs)

    def concurrency_key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The concurrency key of one call, made as `key_for` makes the unique key."""
        return self._rule("concurrency_key").of(args, kwargs)

    def _rule(self, option: str) -> KeyRule:
        rule = self._key_rule(getattr(self, option), option)
        if rule is None:
            raise InvalidJobError(f"{self.name} has no {option}")
        return rule

    def spec(self) -> JobSpec:
        """What an enqueue of this task writes, as the queue layer takes it: its options
        resolved against SKIPQUEUE now (options left None take the project's defaults),
        its call rule and its key rules."""
        options: dict[str, Any] = {
            "rate_limit": self.rate_limit,
            "rate_key_rule": self._key_rule(self.rate_key, "rate_key"),
        }
        options |= self._coalescing()  # a throttle's rate takes the place of none
        return JobSpec(
            name=self.name,
            queue_name=self.queue_name,
            priority=self.priority,
            run_after=self.run_after,
            max_attempts=self.resolved_max_attempts,
            lease=self.resolved_lease,
            call=self.call_rule,
            unique_key=self._key_rule(self.unique_key, "unique_key"),
            on_conflict=self.on_conflict,
            concurrency_key=self._key_rule(self.concurrency_key, "concurrency_key"),
            concurrency_limit=self.concurrency_limit,
            expires=self.expires,
            fair=self._fair_queue(),
            fair_key=self._key_rule(self.fair_key, "fair_key"),
            fair_weight=self.fair_weight,
            ordered_key=self._key_rule(self.ordered_key, "ordered_key"),
            order_hold=self.order_failed == "hold",
            **options,
        )

    def _coalescing(self) -> dict[str, Any]:
        """The spec's debounce or throttle: a throttle is a rate of one start per period,
        per throttle key (the token buckets of `rate_limit`), whose waiting calls join one
        pending job."""
        if self.debounce is not None:
            return {
                "coalesce": "debounce",
                "coalesce_key": self._key_rule(self.debounce_key, "debounce_key"),
                "debounce": self.debounce,
                "debounce_max_wait": self.debounce_max_wait,
            }
        if self.throttle is not None:
            rule = self._key_rule(self.throttle_key, "throttle_key")
            return {
                "coalesce": "throttle",
                "coalesce_key": rule,
                "rate_limit": canonical_rate(f"1/{self.throttle.total_seconds():g}s"),
                "rate_key_rule": rule,
            }
        return {}

    def _fair_queue(self) -> bool:
        """Whether this task's queue is fair now; ConfigurationError for a fair key or
        weight on a queue that is not (it would be ignored without a word)."""
        if self.queue_name in get_settings().FAIR_QUEUES:
            return True
        if self.fair_key is not None or self.fair_weight != 1:
            raise ConfigurationError(
                f"{self.name} has a fair key or weight, but its queue {self.queue_name!r} "
                f"is not fair: add it to SKIPQUEUE['FAIR_QUEUES']"
            )
        return False

    @functools.cached_property
    def is_async(self) -> bool:
        # Asked for each job a worker runs (0.66 us through inspect); `func` is a field
        # of a frozen dataclass, so the answer is kept (cached_property writes the
        # instance's __dict__, past the frozen __setattr__).
        return inspect.iscoroutinefunction(self.func)

    def __call__(self, /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the function here and now, as if it were not a task."""
        return self.func(*args, **kwargs)

    def call(self, /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the function here and now (django.tasks' name for it)."""
        return self.func(*args, **kwargs)

    def using(
        self,
        *,
        queue_name: str | None = None,
        priority: int | None = None,
        run_after: datetime | timedelta | None = None,
        max_attempts: int | None = None,
        lease: timedelta | float | None = None,
        database: str | None = None,
        unique_key: UniqueKey | None = None,
        on_conflict: str | None = None,
        concurrency_key: UniqueKey | None = None,
        concurrency_limit: int | None = None,
        expires: datetime | timedelta | float | None = None,
        rate_key: UniqueKey | None = None,
        fair_key: UniqueKey | None = None,
        fair_weight: int | None = None,
        debounce_key: UniqueKey | None = None,
        throttle_key: UniqueKey | None = None,
        ordered_key: UniqueKey | None = None,
    ) -> Task[P, R]:
        """A copy with these options changed; options left out (None) are kept.

        `unique_key` makes the jobs it enqueues unique (at most one unfinished job of this
        task holds the key); `on_conflict` says what an enqueue whose key is held does.
        `expires`: a job not started by then never runs (an instant, or a delay after the
        enqueue).
        """
        changes: dict[str, Any] = {
            key: value
            for key, value in {
                "queue_name": queue_name,
                "priority": priority,
                "run_after": run_after,
                "max_attempts": max_attempts,
                "lease": validate_lease(lease),
                "database": database,
                "unique_key": unique_key,
                "on_conflict": on_conflict,
                "concurrency_key": concurrency_key,
                "concurrency_limit": concurrency_limit,
                "expires": validate_expires(expires),
                "rate_key": rate_key,
                "fair_key": fair_key,
                "fair_weight": fair_weight,
                "debounce_key": debounce_key,
                "throttle_key": throttle_key,
                "ordered_key": ordered_key,
            }.items()
            if value is not None
        }
        return dataclasses.replace(self, **changes)

    @property
    def retry_policy(self) -> RetryPolicy:
        return self.retry if self.retry is not None else default_retry_policy()

    @property
    def resolved_max_attempts(self) -> int:
        """This task's max_attempts, or SKIPQUEUE['MAX_ATTEMPTS']."""
        return self.max_attempts or get_settings().MAX_ATTEMPTS

    @property
    def resolved_lease(self) -> timedelta:
        """This task's lease, or SKIPQUEUE['LEASE_SECONDS']."""
        return self.lease or timedelta(seconds=get_settings().LEASE_SECONDS)

    def get_database(self) -> str:
        return self.database or get_settings().DATABASE_ALIAS

    def check_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Refuse a call that does not bind to the function's signature, naming it.

        At enqueue, not at run time: a call with an argument too many or a keyword the
        function does not take would otherwise fail every attempt.
        """
        self.call_rule.check(args, kwargs)

    def s(self, /, *args: Any, **kwargs: Any) -> Signature:
        """A signature of this call: a step of a workflow (chain, group, chord). It
        receives its parent's result as its first argument, before `args`."""
        return Signature(self, args, kwargs)

    def si(self, /, *args: Any, **kwargs: Any) -> Signature:
        """An immutable signature: a step that does not receive its parent's result."""
        return Signature(self, args, kwargs, immutable=True)

    def build(self, /, *args: P.args, **kwargs: P.kwargs) -> Job:
        """An unsaved, checked Job for this call. Raises InvalidJobError before any SQL."""
        return self._jobs().build(self.enqueue_spec(), args, kwargs)

    def enqueue(self, /, *args: P.args, **kwargs: P.kwargs) -> Job:
        """INSERT a pending job in the caller's transaction and return it.

        Nothing is written if the arguments do not survive JSON; the job exists if and
        only if the caller's transaction commits. See `JobManager.enqueue`.
        """
        return self._jobs().enqueue(self.enqueue_spec(), args, kwargs)

    @overload
    def enqueue_many(
        self,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int = ...,
        ids_only: Literal[False] = ...,
    ) -> list[Job]: ...

    @overload
    def enqueue_many(
        self,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int = ...,
        ids_only: Literal[True],
    ) -> list[int]: ...

    def enqueue_many(
        self,
        calls: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
        *,
        batch_size: int = 5000,
        ids_only: bool = False,
    ) -> list[Job] | list[int]:
        """Enqueue many calls, each `(args, kwargs)`, with one INSERT per `batch_size`.

        All run in the caller's transaction. By default every call is checked before the
        first row is written, and the jobs come back (id, run_at and created_at filled
        in): about 1.4 KB of memory a job.

        With `ids_only`, `calls` (a generator, say) is read one batch at a time, each
        batch checked and then written, and only the ids come back: memory stays
        bounded by the batch, for fan-outs of millions. A bad call then raises after
        the batches before it were written; wrap the call in `transaction.atomic()` so
        that none of them commits. See `JobManager.enqueue_many`.
        """
        jobs, spec = self._jobs(), self.enqueue_spec()
        if ids_only:
            return jobs.enqueue_many(spec, calls, batch_size=batch_size, ids_only=True)
        return jobs.enqueue_many(spec, calls, batch_size=batch_size)

    def enqueue_spec(self) -> JobSpec:
        """`spec()` for an enqueue: refusing first (ConfigurationError) a task that workers
        would not find, one registered after start-up from a module they do not import."""
        registry.check_discoverable(self.name)
        # Kept beside the settings it was resolved against (a Task is frozen, so only
        # the settings can change it): building it cost a tenth of an enqueue, measured.
        conf = get_settings()
        cached = self.__dict__.get("_spec_cache")
        if cached is not None and cached[0] is conf:
            return cached[1]
        spec = self.spec()
        object.__setattr__(self, "_spec_cache", (conf, spec))
        return spec

    def _jobs(self) -> JobManager:
        """Job.objects on this task's database (imported here: `@task` runs at import
        time of user modules, possibly before the app registry is ready), kept per alias."""
        alias = self.get_database()
        cached = self.__dict__.get("_jobs_cache")
        if cached is not None and cached[0] == alias:
            return cached[1]
        from django_skipqueue.models import Job

        manager = Job.objects.db_manager(alias)
        object.__setattr__(self, "_jobs_cache", (alias, manager))
        return manager

    def __repr__(self) -> str:
        return f"<Task {self.name} queue={self.queue_name}>"


@dataclass(frozen=True)
class Signature:
    """A task and the arguments of one call of it: a step of a workflow (tasks/canvas.py).

    Unless `immutable` (`task.si(...)`), the job receives its parent's result (a chain's
    previous step, or the list of a group's results) as its first positional argument,
    before `args`.
    """

    task: Task[Any, Any]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    immutable: bool = False

    def __repr__(self) -> str:
        return f"{self.task.name}.{'si' if self.immutable else 's'}(...)"


@overload
def task(function: Callable[P, R], /) -> Task[P, R]: ...


@overload
def task(
    *,
    name: str | None = ...,
    queue_name: str = ...,
    priority: int = ...,
    max_attempts: int | None = ...,
    lease: timedelta | float | None = ...,
    retry: RetryPolicy | None = ...,
    non_retryable: tuple[type[BaseException], ...] = ...,
    takes_context: bool = ...,
    database: str | None = ...,
    timeout: timedelta | float | None = ...,
    time_limit: timedelta | float | None = ...,
    soft_time_limit: timedelta | float | None = ...,
    schedule: Schedule | Sequence[Schedule] | None = ...,
    unique_key: UniqueKey | None = ...,
    on_conflict: str = ...,
    concurrency_key: UniqueKey | None = ...,
    concurrency_limit: int = ...,
    expires: timedelta | float | None = ...,
    rate_limit: str | None = ...,
    rate_key: UniqueKey | None = ...,
    fair_key: UniqueKey | None = ...,
    fair_weight: int = ...,
    debounce: timedelta | float | None = ...,
    debounce_max_wait: timedelta | float | None = ...,
    debounce_key: UniqueKey | None = ...,
    throttle: timedelta | float | None = ...,
    throttle_key: UniqueKey | None = ...,
    ordered_key: UniqueKey | None = ...,
    order_failed: str = ...,
) -> Callable[[Callable[P, R]], Task[P, R]]: ...


def task(
    function: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    queue_name: str = DEFAULT_QUEUE_NAME,
    priority: int = 0,
    max_attempts: int | None = None,
    lease: timedelta | float | None = None,
    retry: RetryPolicy | None = None,
    non_retryable: tuple[type[BaseException], ...] = (),
    takes_context: bool = False,
    database: str | None = None,
    timeout: timedelta | float | None = None,
    time_limit: timedelta | float | None = None,
    soft_time_limit: timedelta | float | None = None,
    schedule: Schedule | Sequence[Schedule] | None = None,
    unique_key: UniqueKey | None = None,
    on_conflict: str = "existing",
    concurrency_key: UniqueKey | None = None,
    concurrency_limit: int = 1,
    expires: timedelta | float | None = None,
    rate_limit: str | None = None,
    rate_key: UniqueKey | None = None,
    fair_key: UniqueKey | None = None,
    fair_weight: int = 1,
    debounce: timedelta | float | None = None,
    debounce_max_wait: timedelta | float | None = None,
    debounce_key: UniqueKey | None = None,
    throttle: timedelta | float | None = None,
    throttle_key: UniqueKey | None = None,
    ordered_key: UniqueKey | None = None,
    order_failed: str = "hold",
) -> Task[P, R] | Callable[[Callable[P, R]], Task[P, R]]:
    """Register a module-level function as a task, bare (`@task`) or with options.

    The task is registered under its dotted path, or `name`. Options are defaults for
    each enqueue and can be changed per call with `using()`. `schedule` runs it
    periodically: a cron expression, an interval (`timedelta(seconds=30)`), a `Cron`, or
    a list of them (see core/cron.py).
    """

    if timeout is not None and time_limit is not None:
        raise ConfigurationError("@task takes time_limit or timeout (its older name), not both")
    hard_limit = time_limit if time_limit is not None else timeout

    def wrap(func: Callable[P, R]) -> Task[P, R]:
        if not callable(func) or not hasattr(func, "__qualname__"):
            raise ConfigurationError(f"@task takes a function, got {func!r}")
        if "<locals>" in func.__qualname__ or "." in func.__qualname__:
            raise ConfigurationError(
                f"@task needs a module-level function; {func.__qualname__} is nested in "
                f"another function or class, so a worker could not find it by name"
            )
        if func.__module__ == "__main__" and name is None:
            raise ConfigurationError(
                f"@task on {func.__qualname__} in __main__: a worker cannot import __main__; "
                f"move it into a module"
            )
        label = name or f"{func.__module__}.{func.__qualname__}"
        new = Task(
            func=func,
            name=label,
            queue_name=queue_name,
            priority=priority,
            max_attempts=max_attempts,
            lease=validate_lease(lease),  # seconds or a timedelta, as a timedelta
            retry=retry,
            non_retryable=tuple(non_retryable),
            takes_context=takes_context,
            database=database,
            timeout=validate_lease(hard_limit, "time_limit"),
            soft_time_limit=validate_lease(soft_time_limit, "soft_time_limit"),
            unique_key=unique_key,
            on_conflict=on_conflict,
            concurrency_key=concurrency_key,
            concurrency_limit=concurrency_limit,
            expires=validate_expires(expires, when="the enqueue"),
            rate_limit=rate_limit,
            rate_key=rate_key,
            fair_key=fair_key,
            fair_weight=fair_weight,
            debounce=_period(debounce, "debounce", label, MAX_COALESCE),
            debounce_max_wait=_period(debounce_max_wait, "debounce_max_wait", label, MAX_COALESCE),
            debounce_key=debounce_key,
            throttle=_period(throttle, "throttle", label, timedelta(seconds=MAX_RATE_PERIOD)),
            throttle_key=throttle_key,
            ordered_key=ordered_key,
            order_failed=order_failed,
        )
        if schedule is not None:
            new = dataclasses.replace(new, schedules=bind_schedules(new, schedule))
        registry.register(new)
        return new

    if function is not None:
        return wrap(function)
    return wrap


def bind_schedules(
    task: Task[Any, Any], schedule: Schedule | Sequence[Schedule]
) -> tuple[Cron, ...]:
    """`schedule` (an expression, an interval, a Cron, or a list of them) as Crons bound to `task`:
    named (the task's name, when it has one schedule), with arguments that its function
    takes and that JSON can hold. ConfigurationError otherwise."""
    given = [schedule] if isinstance(schedule, (str, Cron, timedelta)) else list(schedule)
    crons = [
        Cron.every(item)
        if isinstance(item, timedelta)
        else Cron(expression=item)
        if isinstance(item, str)
        else item
        for item in given
    ]
    for cron in crons:
        if not isinstance(cron, Cron):
            raise ConfigurationError(
                f"schedule of {task.name} must be a cron expression, an interval (a "
                f"timedelta, or '@every 30s'), or a Cron, got {cron!r}"
            )
    if len(crons) > 1 and any(cron.name is None for cron in crons):
        raise ConfigurationError(
            f"{task.name} has {len(crons)} schedules: give each a name "
            f"(Cron('...', name='...')), so that each keeps its own state"
        )
    bound = []
    for cron in crons:
        try:
            task.check_call(cron.args, cron.kwargs or {})
            args, kwargs = normalize_arguments(
                cron.args, cron.kwargs or {}, limit=get_settings().MAX_PAYLOAD_BYTES
            )
        except InvalidJobError as error:
            raise ConfigurationError(f"schedule {cron.name or task.name!r}: {error}") from None
        bound.append(
            dataclasses.replace(
                cron, name=cron.name or task.name, task=task.name, args=args, kwargs=kwargs
            )
        )
    return tuple(bound)


__all__ = [
    "Schedule",
    "Signature",
    "Task",
    "TaskContext",
    "UniqueKey",
    "bind_schedules",
    "default_retry_policy",
    "progress_report",
    "task",
]


#: The longest debounce (and its maximum wait): a week.
MAX_COALESCE = timedelta(days=7)


def _period(value: object, option: str, task_name: str, most: timedelta) -> timedelta | None:
    """A debounce's or throttle's period as a timedelta (from seconds too), from a tenth
    of a second to `most`; ConfigurationError naming the option."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        value = timedelta(seconds=min(value, most.total_seconds() + 1))
    if not isinstance(value, timedelta) or not timedelta(seconds=0.1) <= value <= most:
        raise ConfigurationError(
            f"{option} of {task_name} must be a timedelta or seconds from 0.1 to "
            f"{most.total_seconds():g}, got {value!r}"
        )
    return value
