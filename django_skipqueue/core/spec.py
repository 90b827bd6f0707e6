"""JobSpec: the one value that passes from the task API to the queue layer.

A `Task` (tasks/) resolves its options against the project's settings and hands the
queue layer (queue/) a frozen `JobSpec`: the task's name and resolved options, its call
rule (which arguments bind to the function), its key rules (unique and concurrency
keys) and `columns()`, the one mapping of a call to a job row's columns. Every job row
is built from a spec: `enqueue`, `enqueue_many`, the django.tasks backend, unique
inserts and a schedule's occurrences (docs/explanation/architecture.md, "The port").
The queue layer never imports `Task` and never calls back into it.

Pure: nothing here imports a model, opens a connection or starts a thread.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from django_skipqueue.conf import SkipQueueSettings, get_settings
from django_skipqueue.conf.limits import MAX_CONCURRENCY
from django_skipqueue.core.states import UNIQUE_KEY_MAX_LENGTH
from django_skipqueue.exceptions import InvalidJobError

#: What an enqueue whose unique key is held does (JobSpec.on_conflict).
ON_CONFLICT_CHOICES = ("existing", "replace", "raise")


class SpecMemo:
    """Values derived from a spec, kept beside it, never on it (a spec is a frozen value):
    keyed by the spec (hashed by value, a fraction of a microsecond), or a tuple holding
    it. At most `size` entries; full, it starts again empty, so specs made per call (a
    `run_after` of their own) are not kept for ever. Threads may race on an entry: each
    computes the same value, and the last write stays."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._values: dict[Any, Any] = {}

    def get(self, key: Any) -> Any:
        return self._values.get(key)

    def put(self, key: Any, value: Any) -> None:
        if len(self._values) >= self.size:
            self._values = {}
        self._values[key] = value


#: Specs whose bounds passed (JobSpec.check_bounds), with the settings they passed under.
_BOUNDS_PASSED = SpecMemo()


@functools.lru_cache(maxsize=1024)
def call_signature(func: Callable[..., Any], takes_context: bool) -> inspect.Signature | None:
    """The signature a call's arguments must bind to (the context left out), if known."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin or C function without one
        return None
    parameters = list(signature.parameters.values())
    return signature.replace(parameters=parameters[1:] if takes_context else parameters)


@dataclass(frozen=True)
class CallShape:
    """A signature of named parameters only (no *args, **kwargs, positional-only): a
    call binds to it when its positional count fits, its keywords are named, none twice,
    and every required parameter is given. Checked in a few set operations, where
    `Signature.bind` costs several microseconds a call (a fifth of a bulk enqueue)."""

    positional: tuple[str, ...]
    names: frozenset[str]
    required: frozenset[str]

    def binds(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
        if len(args) > len(self.positional):
            return False
        given = self.positional[: len(args)]
        if not kwargs:
            return self.required.issubset(given)
        if not self.names.issuperset(kwargs) or not set(given).isdisjoint(kwargs):
            return False
        return self.required.issubset(set(given).union(kwargs))


@functools.lru_cache(maxsize=1024)
def call_shape(func: Callable[..., Any], takes_context: bool) -> CallShape | None:
    """The fast check of `call_signature`, when the signature allows one."""
    signature = call_signature(func, takes_context)
    if signature is None:
        return None
    kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}
    parameters = list(signature.parameters.values())
    if any(parameter.kind not in kinds for parameter in parameters):
        return None
    return CallShape(
        positional=tuple(
            p.name for p in parameters if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
        ),
        names=frozenset(p.name for p in parameters),
        required=frozenset(p.name for p in parameters if p.default is inspect.Parameter.empty),
    )


@dataclass(frozen=True)
class CallRule:
    """Which calls a task's function accepts: checked at enqueue, not at run time, so a
    call with an argument too many or a keyword the function does not take is refused
    before it is stored (it would otherwise fail every attempt)."""

    task_name: str
    func: Callable[..., Any]
    takes_context: bool = False

    def check(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Refuse (InvalidJobError, naming the problem) a call that does not bind."""
        shape = call_shape(self.func, self.takes_context)
        if shape is not None and shape.binds(args, kwargs):
            return  # the common case; any refusal is explained by Signature.bind below
        signature = call_signature(self.func, self.takes_context)
        if signature is None:
            return
        try:
            signature.bind(*args, **kwargs)
        except TypeError as error:
            problems = [*_unexpected_keywords(signature, kwargs), str(error)]
            shown = signature.replace(
                parameters=[
                    parameter.replace(annotation=inspect.Parameter.empty)
                    for parameter in signature.parameters.values()
                ],
                return_annotation=inspect.Signature.empty,
            )
            raise InvalidJobError(
                f"{self.task_name}{shown} cannot be called with these arguments: "
                + "; ".join(dict.fromkeys(problems))
            ) from None

    def bound_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, defaults applied."""
        signature = call_signature(self.func, self.takes_context)
        if signature is None:
            return dict(kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)


def _unexpected_keywords(signature: inspect.Signature, kwargs: Mapping[str, Any]) -> list[str]:
    """Each keyword the function does not take, named with the parameter it may have
    meant: Python's own message names only the first problem it meets, often a missing
    argument that the misspelt keyword was meant to give."""
    parameters = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    takes = [
        name
        for name, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    problems = []
    for name in kwargs:
        if name in takes:
            continue
        close = difflib.get_close_matches(name, takes, n=1, cutoff=0.5)
        close = close or [t for t in takes if t.startswith(name) or name.startswith(t)][:1]
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"got an unexpected keyword argument {name!r}{hint}")
    return problems


#: The concurrency key of a rate-limited task's jobs that have none of their own: it
#: routes them to the limited claim (by the keyed claim index) and limits nothing.
RATE_KEY_PREFIX = "skipqueue:rate:"


#: The concurrency key of an ordered job: its ordered key's, apart from every other
#: key (an ordered key is held one at a time, in order, on the key's own jobs).
ORDER_KEY_PREFIX = "skipqueue:order:"


def ordered_concurrency_key(value: str) -> str:
    """`ORDER_KEY_PREFIX` and an ordered key's value, hashed if the column could not hold
    it. Not the task's name: the tasks that name one key share its order."""
    key = ORDER_KEY_PREFIX + value
    if len(key) > UNIQUE_KEY_MAX_LENGTH:
        key = ORDER_KEY_PREFIX + hashlib.sha256(value.encode()).hexdigest()
    return key


def rate_concurrency_key(task_name: str) -> str:
    """`RATE_KEY_PREFIX` and the task's name, hashed if the column could not hold it."""
    key = RATE_KEY_PREFIX + task_name
    if len(key) > UNIQUE_KEY_MAX_LENGTH:
        key = RATE_KEY_PREFIX + hashlib.sha256(task_name.encode()).hexdigest()
    return key


def keyed_rate_key(task_name: str, value: str) -> str:
    """The token bucket's key of one value of a task's rate key: `task[value]`, hashed if
    the column could not hold it (two keys that collide would share one bucket)."""
    key = f"{task_name}[{value}]"
    if len(key) > UNIQUE_KEY_MAX_LENGTH:
        digest = hashlib.sha256(value.encode()).hexdigest()
        key = f"{task_name[: UNIQUE_KEY_MAX_LENGTH - len(digest) - 2]}[{digest}]"
    return key


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def valid_key(key: object, task_name: str, option: str = "unique_key") -> str:
    """`key` if PostgreSQL can store it as a key of `task_name`; InvalidJobError if not."""
    what = option.replace("_", " ")
    if not isinstance(key, str) or not key:
        raise InvalidJobError(f"the {what} of {task_name} must be a non-empty string, got {key!r}")
    if "\x00" in key or not _encodable(key):
        raise InvalidJobError(
            f"the {what} of {task_name} holds a NUL character or a lone surrogate, "
            f"which PostgreSQL cannot store in text: {key!r}"
        )
    if len(key) > UNIQUE_KEY_MAX_LENGTH:
        raise InvalidJobError(
            f"the {what} of {task_name} is {len(key)} characters; at most "
            f"{UNIQUE_KEY_MAX_LENGTH} fit (hash a long one)"
        )
    return key


@dataclass(frozen=True)
class KeyRule:
    """How one call's key is made (a unique key, or a concurrency key): a fixed string,
    the named parameters' values as JSON (`invoice_id=42`, defaults applied), or what a
    function of the call's arguments returns."""

    option: str  # "unique_key" or "concurrency_key", for the error messages
    source: str | tuple[str, ...] | Callable[..., Any]
    call: CallRule

    def of(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The key of this call; InvalidJobError if it is not one PostgreSQL can store."""
        source, name = self.source, self.call.task_name
        if callable(source):
            return valid_key(source(*args, **kwargs), name, self.option)
        if isinstance(source, tuple):
            values = self.call.bound_arguments(args, kwargs)
            parts = (
                f"{param}={json.dumps(values.get(param), sort_keys=True, separators=(',', ':'))}"
                for param in source
            )
            return valid_key(",".join(parts), name, self.option)
        return valid_key(source, name, self.option)


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A task's resolved options, call rule and key rules: what one enqueue writes.

    Made by `Task.spec()` (options left unset take the project's settings then) and by
    the scheduler from a schedule's row; taken by every enqueue verb of the queue layer.
    """

    name: str
    queue_name: str
    priority: int
    run_after: datetime | timedelta | None
    max_attempts: int
    lease: timedelta
    call: CallRule
    unique_key: KeyRule | None = None
    on_conflict: str = "existing"
    concurrency_key: KeyRule | None = None
    concurrency_limit: int = 1
    #: A job not started by then never runs (`expires_at`): a datetime, or a delay
    #: after the enqueue (after the occurrence, for a schedule's job).
    expires: datetime | timedelta | None = None
    #: Rate limits per task: at most this many starts of the task's jobs per period
    #: ("10/s", "100/m", "5000/h"), across every worker (`rate_key` is the task's name).
    rate_limit: str | None = None
    #: A rate limit per key (`@task(rate_limit=..., rate_key=...)`): one token bucket per
    #: value of this key (a tenant, a partner's API account), made as `concurrency_key`
    #: is. None: one bucket for the task.
    rate_key_rule: KeyRule | None = None
    #: Fair share: whether the queue is fair (SKIPQUEUE['FAIR_QUEUES'], read when the
    #: spec is made); then each job has a fair key (this rule's, or "" without one) and
    #: `fair_weight` (1 to MAX_FAIR_WEIGHT).
    fair: bool = False
    fair_key: KeyRule | None = None
    fair_weight: int = 1
    #: Debounce or throttle (queue/coalesce.py): "debounce", "throttle" or "" (neither);
    #: the calls of one coalesce key (this rule's, or "" without one) join one pending
    #: job. A throttle's rate is `rate_limit` (one start per period, per `rate_key_rule`).
    coalesce: str = ""
    coalesce_key: KeyRule | None = None
    debounce: timedelta | None = None
    debounce_max_wait: timedelta | None = None
    #: Strict order per key (`@task(ordered_key=...)`): its jobs run one at a time in
    #: enqueue order; `order_hold`: a failed one holds the later ones (else they go on).
    ordered_key: KeyRule | None = None
    order_hold: bool = True

    @property
    def rate_key(self) -> str | None:
        """The rate key every job of this spec shares: the task's name, for a rate limit
        per task; None without a rate limit, or with one per key (`key_columns`)."""
        if self.rate_limit is None or self.rate_key_rule is not None:
            return None
        return self.name

    @property
    def keyed(self) -> bool:
        """Whether its jobs carry a concurrency key, and so go through the limited claim:
        their own (`concurrency_key`), or, for a rate-limited task without one, a key of
        its own with no concurrency limit (`rate_concurrency_key`)."""
        return (
            self.concurrency_key is not None
            or self.rate_limit is not None
            or self.ordered_key is not None
        )

    @property
    def plain(self) -> bool:
        """Whether its jobs hold no column of their own but the arguments: no unique or
        concurrency key, no rate limit, not in a fair queue (the enqueue's and the
        workflows' shortest statements)."""
        return self.unique_key is None and not self.keyed and not self.fair and not self.coalesce

    def check_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Refuse (InvalidJobError) a call that does not bind to the task's signature."""
        self.call.check(args, kwargs)

    def key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The unique key of one call (InvalidJobError for a spec without one)."""
        return self._rule(self.unique_key, "unique_key").of(args, kwargs)

    def concurrency_key_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The concurrency key of one call (InvalidJobError for a spec without one)."""
        return self._rule(self.concurrency_key, "concurrency_key").of(args, kwargs)

    def _rule(self, rule: KeyRule | None, option: str) -> KeyRule:
        if rule is None:
            raise InvalidJobError(f"{self.name} has no {option}")
        return rule

    def check_bounds(self, conf: SkipQueueSettings | None = None) -> None:
        """The per-task volume guards (case S11, docs/explanation/failure-model.md):
        max_attempts and run_after against SKIPQUEUE's caps. A run_after datetime is
        compared with this process's clock: a bound of days or more, not a lease
        decision. The queue's pending cap is the queue layer's to count.

        A spec whose bounds are durations (or unset) passes or fails the same way for a
        given SKIPQUEUE: its pass is kept (`_BOUNDS_PASSED`) beside those settings, as
        the check costs a tenth of a plain enqueue's Python (`python benchmarks/run.py
        --parts enqueue` counts its instructions)."""
        conf = conf or get_settings()
        if _BOUNDS_PASSED.get(self) is conf:
            return
        if self.max_attempts > conf.MAX_ATTEMPTS_LIMIT:
            raise InvalidJobError(
                f"max_attempts {self.max_attempts} is over SKIPQUEUE['MAX_ATTEMPTS_LIMIT'] "
                f"({conf.MAX_ATTEMPTS_LIMIT})"
            )
        for option in ("run_after", "expires"):
            when = getattr(self, option)
            if when is None:
                continue
            delay = when - timezone.now() if isinstance(when, datetime) else when
            if delay.total_seconds() > conf.MAX_DELAY_SECONDS:
                raise InvalidJobError(
                    f"{option} is {delay} ahead, over SKIPQUEUE['MAX_DELAY_SECONDS'] "
                    f"({conf.MAX_DELAY_SECONDS:.0f} s)"
                )
        start, end = self.run_after, self.expires
        never = (isinstance(start, timedelta) and isinstance(end, timedelta) and start >= end) or (
            isinstance(start, datetime) and isinstance(end, datetime) and start >= end
        )
        if never:
            raise InvalidJobError(
                f"{self.name} would never run: run_after ({start}) is not before its expiry ({end})"
            )
        if not isinstance(start, datetime) and not isinstance(end, datetime):
            _BOUNDS_PASSED.put(self, conf)

    def shared_columns(self) -> dict[str, Any]:
        """The columns every job of this spec holds alike."""
        return {
            "task": self.name,
            "queue_name": self.queue_name,
            "priority": self.priority,
            "max_attempts": self.max_attempts,
            "lease": self.lease,
            "rate_key": self.rate_key,
            "rate_limit": self.rate_limit,
        }

    def key_columns(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The columns one call's keys fill (none for a spec without keys)."""
        columns: dict[str, Any] = {}
        if self.unique_key is not None:
            columns["unique_key"] = self.unique_key.of(args, kwargs)
        if self.ordered_key is not None:  # one at a time per key, and in order
            columns["concurrency_key"] = ordered_concurrency_key(self.ordered_key.of(args, kwargs))
            columns["concurrency_limit"] = 1
            columns["order_hold"] = self.order_hold
        elif self.concurrency_key is not None:
            columns["concurrency_key"] = self.concurrency_key.of(args, kwargs)
            columns["concurrency_limit"] = self.concurrency_limit
        elif self.rate_limit is not None:
            columns["concurrency_key"] = rate_concurrency_key(self.name)
            columns["concurrency_limit"] = MAX_CONCURRENCY
        if self.rate_key_rule is not None and self.rate_limit is not None:
            columns["rate_key"] = keyed_rate_key(self.name, self.rate_key_rule.of(args, kwargs))
        if self.fair:
            key = self.fair_key.of(args, kwargs) if self.fair_key is not None else ""
            columns["fair_key"] = key
            columns["fair_weight"] = self.fair_weight
        if self.coalesce:
            rule = self.coalesce_key
            columns["coalesce_key"] = rule.of(args, kwargs) if rule is not None else ""
        return columns

    def columns(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The one mapping of a checked call (JSON-ready arguments) to a job row's columns.

        `run_at` is left out: the insert computes it on the database's clock from
        `run_after` (or the scheduler gives an occurrence's instant).
        """
        return (
            self.shared_columns()
            | {"args": list(args), "kwargs": dict(kwargs)}
            | self.key_columns(args, kwargs)
        )
