"""Settings: the sole reader of `settings.SKIPQUEUE`.

Defaults live here and only here. Values are read at call time (built once per
SKIPQUEUE object), so `override_settings(SKIPQUEUE=...)` just works. Bad keys and
values are reported by the system checks in `checks.py` (skipqueue.E001/E002), not
by a crash at import.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from importlib.util import find_spec
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.functional import empty

from django_skipqueue.exceptions import ConfigurationError


def _positive_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


#: The bounds of a lease (and of a task's timeout). Below a quarter second a loaded
#: worker's claim-to-ack time passes the lease, so every attempt would expire; past a
#: week a crashed worker's job would wait that long. The claim and the renewal clamp a
#: row's lease to the same bounds, whoever wrote it.
MIN_LEASE = timedelta(seconds=0.25)
MAX_LEASE = timedelta(days=7)


def _lease_seconds(value: Any) -> bool:
    return _positive_number(value) and (
        MIN_LEASE.total_seconds() <= value <= MAX_LEASE.total_seconds()
    )


#: The largest MAX_PAYLOAD_BYTES allowed; the database's own ceiling (migration 0003)
#: is four times that, in jsonb's slightly larger text form.
PAYLOAD_BYTES_CEILING = 1024 * 1024


def _payload_limit(value: Any) -> bool:
    return _positive_int(value) and value <= PAYLOAD_BYTES_CEILING


def _zero_or_more(value: Any) -> bool:
    return value == 0 or _positive_number(value)


def _boolean(value: Any) -> bool:
    return isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1


def _none_or_zero_or_more_int(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def _none_or_positive_int(value: Any) -> bool:
    return value is None or _positive_int(value)


def _name(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _names(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(_name(item) for item in value)


def _networks(value: Any) -> bool:
    if not isinstance(value, (list, tuple)):
        return False
    try:
        for item in value:
            ipaddress.ip_network(item, strict=False)
    except (TypeError, ValueError):
        return False
    return True


def _dict(value: Any) -> bool:
    return isinstance(value, dict)


def _named_entries(value: Any) -> bool:
    return isinstance(value, dict) and all(
        _name(key) and isinstance(entry, dict) for key, entry in value.items()
    )


@dataclass(frozen=True, kw_only=True)
class SkipQueueSettings:
    """Every key of the `SKIPQUEUE` setting, with its default. Units are in the names."""

    #: The database alias that holds the job table.
    DATABASE_ALIAS: str = "default"
    #: How long a claim owns a job before the reaper may take it back.
    LEASE_SECONDS: float = 300.0
    #: Attempts (claims) a job gets before it ends failed, unless its task says otherwise.
    MAX_ATTEMPTS: int = 5
    #: The most attempts a task or enqueue may ask for (a guard against runaway retries).
    MAX_ATTEMPTS_LIMIT: int = 100
    #: The furthest ahead a job may be scheduled (run_after), in seconds: one year.
    MAX_DELAY_SECONDS: float = 365 * 24 * 3600.0
    #: If set, an enqueue that would leave more pending jobs than this in its queue is
    #: refused with QueueFullError (a guard against floods and tasks that fan out
    #: without end). Approximate under concurrent enqueues. None: no limit.
    MAX_PENDING_PER_QUEUE: int | None = None
    #: Backoff of the default retry policy: base * 2**(attempt-1), capped, +/- jitter.
    RETRY_BASE_SECONDS: float = 1.0
    RETRY_CAP_SECONDS: float = 3600.0
    RETRY_JITTER: float = 0.1
    #: Largest JSON encoding of a job's args and kwargs together, and of a return value.
    MAX_PAYLOAD_BYTES: int = 256 * 1024
    #: How many error entries (one per failed attempt) a job keeps; the oldest go first.
    ERROR_HISTORY_LENGTH: int = 10
    #: Modules imported at start-up to register tasks, besides each app's `tasks` module.
    TASK_MODULES: tuple[str, ...] = ()
    #: Worker: the longest idle wait between claims when no NOTIFY arrives (jittered).
    POLL_INTERVAL_SECONDS: float = 5.0
    #: Worker: LISTEN for new jobs (needs a direct connection, not a transaction pooler).
    LISTEN: bool = True
    #: A single enqueue's INSERT sent straight on libpq where nothing could tell
    #: (`db/direct.py`); False: always through Django's cursor.
    DIRECT_ENQUEUE: bool = True
    #: Worker: jobs claimed ahead of free threads, so claims and acks come in batches.
    #: None: adapt it to the jobs' run time (about 50 ms of work per thread, at most 64
    #: per thread and 1,024 in all; none for jobs of a second or more). 0: never claim
    #: ahead.
    PREFETCH: int | None = None
    #: Worker: how often the built-in housekeeper reaps expired leases (0 turns it off).
    REAP_INTERVAL_SECONDS: float = 10.0
    #: Worker: how often a worker records that it is alive.
    HEARTBEAT_SECONDS: float = 10.0
    #: Worker: how often it logs a `worker progress` line at INFO with what ran since the
    #: last one (per-job lines are DEBUG; failures are logged one by one). 0: never.
    PROGRESS_SECONDS: float = 10.0
    #: A worker whose heartbeat is older than this is shown as dead.
    WORKER_DEAD_AFTER_SECONDS: float = 60.0
    #: Rows of workers dead for longer than this are deleted by the housekeeper.
    WORKER_PRUNE_AFTER_SECONDS: float = 24 * 3600.0
    #: Worker: seconds jobs in flight get to finish after SIGTERM before they are released.
    GRACE_SECONDS: float = 30.0
    #: Worker: the server ends a session of ours that sits idle this long inside one of
    #: our own transactions that take locks (a worker frozen by SIGSTOP, a paused VM, a
    #: long GC), which rolls it back and frees its locks for the other workers. Set with
    #: SET LOCAL at the start of each such transaction (safe behind a transaction pooler).
    IDLE_IN_TRANSACTION_SECONDS: float = 5.0
    #: Worker: the longest one of those transactions waits for a lock before it gives up
    #: and tries again later (a passing error).
    LOCK_TIMEOUT_SECONDS: float = 5.0
    #: Periodic schedules of tasks you do not decorate yourself, by name: each a dict
    #: with "task" (its registered name), "cron" (the expression) and optionally "args",
    #: "kwargs", "queue_name", "priority", "timezone", "missed", "catch_up", "grace"
    #: (see the Cron class). Checked by skipqueue.E010.
    SCHEDULES: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Flow control per queue, across every worker: {"reports": {"concurrency": 3},
    #: "webhooks": {"rate": "10/s"}}: at most that many running jobs, at most that
    #: many job starts per second, minute or hour. Checked by skipqueue.E011.
    QUEUE_LIMITS: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Fair queues (docs/howto/flow-control.md): in each, jobs share the workers by their
    #: fair key (`@task(fair_key=...)`), in proportion to their weight, while several
    #: keys have due jobs. Checked by skipqueue.E014.
    FAIR_QUEUES: tuple[str, ...] = ()
    #: Queues relayed to RabbitMQ (the job table as a transactional outbox):
    #: {"QUEUES": ["webhooks"], "URL": "amqp://..."} and optionally "BATCH_SIZE",
    #: "PREFETCH", "RESULTS" and "DELIVERY_LIMIT" (see broker.RelayConfig). Empty: off.
    #: Checked by skipqueue.E012.
    RELAY: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The web metrics view (`django_skipqueue.urls`, docs/howto/monitoring.md): clients
    #: from these networks ("10.0.0.0/8", "127.0.0.1") may scrape it without logging
    #: in; anyone else needs a user with the "view job" permission.
    METRICS_ALLOWED_NETWORKS: tuple[str, ...] = ()
    #: How often the metrics' queue gauges are read from the database, in seconds (by
    #: a thread of `runworker --metrics-port`; by the web view on a scrape past it).
    METRICS_SAMPLE_SECONDS: float = 15.0
    #: The admin's "repeatedly expired" filter: jobs with at least this many expirations.
    REPEATED_EXPIRY_THRESHOLD: int = 2
    #: Keys whose values are masked in stored errors and the admin (any case, punctuation
    #: ignored; a substring, "api_key" also masks "apiKey" and "X-Api-Key", except that
    #: a name of at most 4 characters must be a whole word: "pass" masks "db_pass", not
    #: "passenger"). See redaction.py.
    REDACT_KEYS: tuple[str, ...] = (
        "password",
        "passwd",
        "passphrase",
        "pass",
        "pwd",
        "token",
        "secret",
        "authorization",
        "auth",
        "api_key",
        "private_key",
        "credential",
        "cookie",
        "sessionid",
        "sessid",
        "signature",
        "oauth",
    )

    def problems(self) -> list[tuple[str, str]]:
        """(key, what is wrong) for each value of the wrong type or out of range."""
        rules: dict[str, tuple[Callable[[Any], bool], str]] = {
            "DATABASE_ALIAS": (_name, "a database alias (non-empty string)"),
            "LEASE_SECONDS": (_lease_seconds, "seconds from 0.25 to 604800 (7 days)"),
            "MAX_ATTEMPTS": (_positive_int, "a positive integer"),
            "MAX_ATTEMPTS_LIMIT": (_positive_int, "a positive integer"),
            "MAX_DELAY_SECONDS": (_positive_number, "a positive number of seconds"),
            "MAX_PENDING_PER_QUEUE": (_none_or_positive_int, "None or a positive integer"),
            "RETRY_BASE_SECONDS": (_positive_number, "a positive number of seconds"),
            "RETRY_CAP_SECONDS": (_positive_number, "a positive number of seconds"),
            "RETRY_JITTER": (_fraction, "a fraction in [0, 1)"),
            "MAX_PAYLOAD_BYTES": (_payload_limit, "a positive integer of bytes, at most 1 MiB"),
            "ERROR_HISTORY_LENGTH": (_positive_int, "a positive integer"),
            "TASK_MODULES": (_names, "a list of dotted module paths"),
            "POLL_INTERVAL_SECONDS": (_positive_number, "a positive number of seconds"),
            "LISTEN": (_boolean, "True or False"),
            "DIRECT_ENQUEUE": (_boolean, "True or False"),
            "PREFETCH": (_none_or_zero_or_more_int, "None or a whole number, zero or more"),
            "REAP_INTERVAL_SECONDS": (_zero_or_more, "zero (off) or more seconds"),
            "HEARTBEAT_SECONDS": (_positive_number, "a positive number of seconds"),
            "PROGRESS_SECONDS": (_zero_or_more, "zero (off) or more seconds"),
            "WORKER_DEAD_AFTER_SECONDS": (_positive_number, "a positive number of seconds"),
            "WORKER_PRUNE_AFTER_SECONDS": (_positive_number, "a positive number of seconds"),
            "GRACE_SECONDS": (_zero_or_more, "zero or more seconds"),
            "IDLE_IN_TRANSACTION_SECONDS": (_positive_number, "a positive number of seconds"),
            "LOCK_TIMEOUT_SECONDS": (_positive_number, "a positive number of seconds"),
            "REDACT_KEYS": (_names, "a list of key names"),
            "METRICS_ALLOWED_NETWORKS": (_networks, "a list of IP networks ('10.0.0.0/8')"),
            "METRICS_SAMPLE_SECONDS": (_positive_number, "a positive number of seconds"),
            "REPEATED_EXPIRY_THRESHOLD": (_positive_int, "a positive integer"),
            "SCHEDULES": (_named_entries, "a dict of schedule names to dicts"),
            "QUEUE_LIMITS": (_named_entries, "a dict of queue names to dicts"),
            "FAIR_QUEUES": (_names, "a list of queue names"),
            "RELAY": (_dict, "a dict (QUEUES, URL, ...) or empty"),
        }
        found = []
        for key, (valid, expected) in rules.items():
            value = getattr(self, key)
            if not valid(value):
                found.append((key, f"must be {expected}, got {value!r}"))
        if not found and self.RETRY_CAP_SECONDS < self.RETRY_BASE_SECONDS:
            found.append(("RETRY_CAP_SECONDS", "must be >= RETRY_BASE_SECONDS"))
        if not found and self.MAX_ATTEMPTS > self.MAX_ATTEMPTS_LIMIT:
            found.append(
                ("MAX_ATTEMPTS", f"must be <= MAX_ATTEMPTS_LIMIT ({self.MAX_ATTEMPTS_LIMIT})")
            )
        return found


def check_entry(where: str, entry: object, allowed: frozenset[str]) -> dict[str, Any]:
    """One entry of a dict setting (SCHEDULES, QUEUE_LIMITS): a dict of known keys, or
    ConfigurationError naming `where` and the keys it takes."""
    if not isinstance(entry, dict):
        raise ConfigurationError(f"{where} must be a dict of {', '.join(sorted(allowed))}")
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ConfigurationError(
            f"{where} has unknown keys {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}"
        )
    return entry


KNOWN_KEYS = frozenset(field.name for field in dataclasses.fields(SkipQueueSettings))


def user_settings() -> dict[str, Any]:
    """The project's `SKIPQUEUE` dict as written (empty if unset)."""
    value = getattr(settings, "SKIPQUEUE", {})
    return dict(value) if isinstance(value, dict) else {}


_cache: tuple[object, SkipQueueSettings] | None = None


#: The dotted path of our django.tasks backend, as a project writes it in TASKS.
BACKEND_PATH = "django_skipqueue.backends.SkipQueueBackend"


def tasks_api_installed() -> bool:
    """Whether django.tasks (Django >= 6.0) or the django-tasks backport can be imported:
    core/tasks_api.py imports whichever it finds; this looks without importing."""
    return any(find_spec(name) is not None for name in ("django.tasks", "django_tasks"))


def task_backends_of_ours() -> list[dict[str, Any]]:
    """The entries of settings.TASKS that use SkipQueueBackend (read, not imported)."""
    entries = (getattr(settings, "TASKS", {}) or {}).values()
    return [e for e in entries if isinstance(e, dict) and e.get("BACKEND") == BACKEND_PATH]


def get_settings() -> SkipQueueSettings:
    """The project's SKIPQUEUE dict laid over our defaults. Call it; never keep it.

    Built once per SKIPQUEUE object (measured: building it cost about a tenth of an
    enqueue, which reads it several times) and built again whenever the setting is
    another object, as under override_settings, or setting_changed says so. Unknown
    keys are left out here and reported by the system check skipqueue.E001.
    """
    global _cache
    raw = _skipqueue_setting()
    cached = _cache
    if cached is not None and cached[0] is raw:
        return cached[1]
    known = {key: value for key, value in user_settings().items() if key in KNOWN_KEYS}
    for key in ("TASK_MODULES", "REDACT_KEYS", "METRICS_ALLOWED_NETWORKS", "FAIR_QUEUES"):
        if isinstance(known.get(key), list):
            known[key] = tuple(known[key])
    built = SkipQueueSettings(**known)
    _cache = (raw, built)
    return built


def _skipqueue_setting() -> Any:
    """settings.SKIPQUEUE, None if unset. Read from the settings object behind Django's
    lazy one where there is one: for a project without SKIPQUEUE, the lazy object
    raised and caught an AttributeError on every read, 3.4 us each (measured; a worker
    reads it once per job, an enqueue more). `_wrapped` is read past LazyObject's
    `__getattribute__` (Python code, a fifth of what an enqueue spent here), as that
    method itself reads it."""
    wrapped = object.__getattribute__(settings, "_wrapped")
    if wrapped is empty:  # not configured yet: the lazy object configures itself
        return getattr(settings, "SKIPQUEUE", None)
    return getattr(wrapped, "SKIPQUEUE", None)


@receiver(setting_changed)
def _forget_settings(*, setting: str, **kwargs: Any) -> None:
    global _cache
    if setting == "SKIPQUEUE":
        _cache = None
