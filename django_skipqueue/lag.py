"""Why due jobs wait: the queue overview's reasons under its lag, and a job page's line.

A due job is claimed unless one of these holds, tested as the claim tests them: its
queue is paused; no live worker takes the queue; the queue's concurrency limit is full;
the queue's rate limit is spent (SKIPQUEUE['QUEUE_LIMITS']); its task's rate limit is
spent (`@task(rate_limit=...)`); its concurrency key is at its limit. Else it waits for
a free worker thread. A job not due yet waits for its time (`run_at`), or for its
workflow's parents (`waiting`).

A queue's reasons come from its oldest due jobs, SAMPLE of them in claim order (the
claim index serves them): bounded work whatever the backlog, and the very jobs its lag
measures. Every time is the database's.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db.models import Count, DurationField, ExpressionWrapper, F, Q, Value
from django.db.models.functions import Now
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from django_skipqueue.conf import get_settings
from django_skipqueue.conf.limits import QueueLimit, queue_limits
from django_skipqueue.core.states import CLAIM_ORDER, JobState, ParkedOn
from django_skipqueue.exceptions import ConfigurationError
from django_skipqueue.models import (
    Job,
    Queue,
    RateBucket,
    Step,
    StepKind,
    WorkerProcess,
    queue_names_of,
)

if TYPE_CHECKING:
    from django_skipqueue.stats import QueueStats

#: How many of a queue's oldest due jobs its reasons are read from.
SAMPLE = 200

_DUE_FIELDS = ("rate_key", "rate_limit", "concurrency_key", "concurrency_limit")


def queue_reasons(rows: list[QueueStats], database: str | None = None) -> dict[str, list[str]]:
    """For each queue of `rows` with due jobs (relayed ones aside: a relay takes those):
    why they wait, queue-wide reasons first."""
    alias = database or get_settings().DATABASE_ALIAS
    limits = _limits()
    found: dict[str, list[str]] = {}
    for row in rows:
        if row.pending_due <= 0 or row.relayed:
            continue
        leased = row.running - row.stuck  # its running jobs with a live lease, counted already
        reasons = _queue_wide(
            row.queue, limits.get(row.queue), row.paused, row.live_workers, alias, leased
        )
        if row.live_workers and not row.paused:  # else nothing claims: said already
            due = list(
                Job.objects.using(alias)
                .filter(state=JobState.PENDING, queue_name=row.queue, run_at__lte=Now())
                .order_by(*CLAIM_ORDER)
                .values(*_DUE_FIELDS)[:SAMPLE]
            )
            reasons += _held(due, alias)
            if row.queue in get_settings().FAIR_QUEUES:
                reasons += _fair_backlog(row.queue, alias)
        if not reasons:
            reasons.append(_busy(row.running))
        found[row.queue] = reasons
    return found


def _fair_backlog(queue: str, alias: str) -> list[str]:
    """A fair queue's due jobs by key: how many keys share it, and the share of the
    largest backlog (the keys are the jobs' data: counted, never named)."""
    backlog = list(
        Job.objects.using(alias)
        .filter(state=JobState.PENDING, queue_name=queue, run_at__lte=Now())
        .exclude(fair_key=None)
        .values("fair_key")
        .annotate(n=Count("id"))
        .order_by("-n")
        .values_list("n", flat=True)[:FAIR_KEYS_SHOWN]
    )
    if not backlog:
        return []
    total = (
        Job.objects.using(alias)
        .filter(state=JobState.PENDING, queue_name=queue, run_at__lte=Now())
        .exclude(fair_key=None)
        .count()
    )
    keys = len(backlog)
    shown = f"{keys}+" if keys == FAIR_KEYS_SHOWN else str(keys)
    return [
        _(
            "fair share between %(keys)s keys with due jobs; the largest backlog holds "
            "%(largest)d of %(total)d (it gets its share, no more, while others wait)"
        )
        % {"keys": shown, "largest": backlog[0], "total": total}
    ]


#: The most keys a fair queue's line on the overview counts.
FAIR_KEYS_SHOWN = 1000


def _wait_timeout(job: Job, alias: str) -> float | None:
    """The timeout of the wait a job is parked on (its last step's record), or None."""
    result = (
        Step.objects.using(alias)
        .filter(job_id=job.id, kind=StepKind.SIGNAL)
        .order_by("-position")
        .values_list("result", flat=True)
        .first()
    )
    timeout = result.get("timeout") if isinstance(result, dict) else None
    return float(timeout) if isinstance(timeout, (int, float)) else None


def job_reason(job: Job) -> str:
    """Why this pending or waiting job has not started ("" for any other state)."""
    alias = job._state.db or get_settings().DATABASE_ALIAS
    if job.state == JobState.WAITING:
        parents = job.waiting_on or 0
        return ngettext(
            "waiting on %(n)d parent job of its workflow",
            "waiting on %(n)d parent jobs of its workflow",
            parents,
        ) % {"n": parents}
    if job.state != JobState.PENDING:
        return ""
    until = (
        Job.objects.using(alias)
        .filter(id=job.id)
        .annotate(left=_until(Value(job.run_at)))
        .values_list("left", flat=True)
        .first()
    )
    if until is not None and until > timedelta(0):
        wait = _duration(until.total_seconds())
        if job.parked == ParkedOn.SLEEP:
            return _("sleeping (%(step)s): due in %(wait)s") % {
                "step": job.parked_step,
                "wait": wait,
            }
        if job.parked == ParkedOn.SIGNAL:
            if _wait_timeout(job, alias) is None:  # woken each MAX_DELAY_SECONDS only
                return _("awaiting the signal %(step)s (no timeout)") % {"step": job.parked_step}
            return _("awaiting the signal %(step)s (or its timeout, in %(wait)s)") % {
                "step": job.parked_step,
                "wait": wait,
            }
        return _("scheduled: due in %(wait)s") % {"wait": wait}
    queue = job.queue_name
    paused = Queue.objects.using(alias).filter(name=queue, paused_at__isnull=False).exists()
    live = live_queue_workers(alias)[queue]
    reasons = _queue_wide(queue, _limits().get(queue), paused, live, alias)
    if not reasons:
        mine = {field: getattr(job, field) for field in _DUE_FIELDS}
        spent = _rates_spent({job.rate_key}, alias) if job.rate_key else {}
        if job.rate_key in spent:
            reasons.append(
                _("its task's rate limit (%(rate)s) is spent: the next start in %(wait)s")
                % {"rate": job.rate_limit or "?", "wait": _duration(spent[job.rate_key])}
            )
        behind = _in_order_behind(job, alias) if job.order_hold is not None else None
        if behind is not None:
            reasons.append(behind)
        full = _keys_full([mine], alias) if job.order_hold is None else {}
        if job.concurrency_key in full:  # the key itself is the job's data: not shown
            reasons.append(
                _("its concurrency key is at its limit (%(running)d running)")
                % {"running": full[job.concurrency_key]}
            )
        if not reasons and job.fair_key is not None and job.concurrency_key is None:
            reasons.append(_fair_share(job, alias))
    return "; ".join(reasons) or _("due: the next free worker thread takes it")


def _in_order_behind(job: Job, alias: str) -> str | None:
    """An ordered job: the first earlier job of its key that holds it, in words (its id
    and state; the key is the job's data: not shown), or None if it is its key's head."""
    holder = (
        Job.objects.using(alias)
        .filter(
            Q(state__in=[JobState.PENDING, JobState.RUNNING, JobState.WAITING])
            | Q(state=JobState.FAILED, order_hold=True),
            concurrency_key=job.concurrency_key,
            id__lt=job.id,
            order_hold__isnull=False,
        )
        .order_by("id")
        .values_list("id", "state")
        .first()
    )
    if holder is None:
        return None
    holder_id, state = holder
    if state == JobState.FAILED:
        return _(
            "in order behind job %(id)d of its key, which failed: its retry (or its "
            "deletion) lets the key go on"
        ) % {"id": holder_id}
    return _("in order behind job %(id)d of its key (%(state)s)") % {
        "id": holder_id,
        "state": state,
    }


#: The most jobs of its key before a job that its page counts (an index range each).
FAIR_AHEAD_COUNTED = 1000


def _fair_share(job: Job, alias: str) -> str:
    """A fair queue's due job: its key's running jobs and its due jobs before it (the
    claim gives each key its share in that order; the key itself is not shown)."""
    key_jobs = Job.objects.using(alias).filter(queue_name=job.queue_name, fair_key=job.fair_key)
    running = key_jobs.filter(state=JobState.RUNNING, leased_until__gt=Now()).count()
    before = (
        Q(priority__gt=job.priority)
        | Q(priority=job.priority, run_at__lt=job.run_at)
        | Q(priority=job.priority, run_at=job.run_at, id__lt=job.id)
    )
    ahead = key_jobs.filter(before, state=JobState.PENDING, run_at__lte=Now())
    counted = ahead.values("id")[:FAIR_AHEAD_COUNTED].count()
    return _(
        "fair share: its key runs %(running)d jobs (weight %(weight)d), "
        "%(ahead)s of its due jobs come before it"
    ) % {
        "running": running,
        "weight": job.fair_weight,
        "ahead": f"{counted}+" if counted == FAIR_AHEAD_COUNTED else str(counted),
    }


def live_queue_workers(database: str | None = None) -> Counter[str]:
    """Live workers per queue name."""
    alias = database or get_settings().DATABASE_ALIAS
    live: Counter[str] = Counter()
    for queues in WorkerProcess.objects.using(alias).alive().values_list("queues", flat=True):
        live.update(set(queue_names_of(queues)))  # another client's row may hold anything
    return live


# -- the tests, each as the claim makes it --------------------------------------------


def _queue_wide(
    queue: str,
    limit: QueueLimit | None,
    paused: bool,
    live_workers: int,
    alias: str,
    running: int | None = None,
) -> list[str]:
    """`running`: the queue's running jobs with a live lease, if known (else counted)."""
    if paused:
        return [_("paused: no worker claims from it")]
    if not live_workers:
        return [_("no live worker takes this queue")]
    reasons = []
    if limit is not None and limit.concurrency is not None:
        if running is None:
            running = (
                Job.objects.using(alias)
                .filter(state=JobState.RUNNING, queue_name=queue, leased_until__gt=Now())
                .count()
            )
        if running >= limit.concurrency:
            reasons.append(
                _("its concurrency limit: %(running)d of %(limit)d running")
                % {"running": running, "limit": limit.concurrency}
            )
    if limit is not None and limit.rate is not None:
        wait = _queue_rate_wait(queue, limit, alias)
        if wait is not None:
            reasons.append(
                _("its rate limit (%(rate)s) is spent: the next start in %(wait)s")
                % {"rate": _rate_text(limit), "wait": _duration(wait)}
            )
    return reasons


def _queue_rate_wait(queue: str, limit: QueueLimit, alias: str) -> float | None:
    """Seconds until the queue's token bucket holds a start (None: it holds one now).
    Its row holds the bucket as the last claim left it; it refills on the clock."""
    bucket = (
        Queue.objects.using(alias)
        .filter(name=queue, rate_refilled_at__isnull=False)
        .annotate(age=_until(F("rate_refilled_at"), since=True))
        .values_list("rate_tokens", "age")
        .first()
    )
    if bucket is None:
        return None
    tokens, age = bucket
    rate = limit.refill_per_second
    now = min(float(limit.rate or 0), tokens + age.total_seconds() * rate)
    return None if now >= 1 else (1 - now) / rate


def _held(due: list[dict[str, Any]], alias: str) -> list[str]:
    """The oldest due jobs held by their task's rate limit or their concurrency key."""
    reasons = []
    rate_keys = Counter(job["rate_key"] for job in due if job["rate_key"])
    spent = _rates_spent(set(rate_keys), alias)
    limits = {job["rate_key"]: job["rate_limit"] for job in due if job["rate_key"]}
    for key, wait in sorted(spent.items()):
        # A rate per key's bucket is `task[value]`, the value made of the jobs' arguments:
        # the task's name only, never the value (a view-only user sees no payload).
        task, per_key = key.split("[", 1)[0], "[" in key
        words = (
            _("%(held)s: task %(task)s's rate limit per key (%(rate)s), the next start in %(wait)s")
            if per_key
            else _("%(held)s: task %(task)s's rate limit (%(rate)s), the next start in %(wait)s")
        )
        reasons.append(
            words
            % {
                "held": _of_the_oldest(rate_keys[key], len(due)),
                "task": task.rsplit(".", 1)[-1],
                "rate": limits.get(key) or "?",
                "wait": _duration(wait),
            }
        )
    full = _keys_full(due, alias)
    held = [job["concurrency_key"] for job in due if job["concurrency_key"] in full]
    if held:  # how many keys, never which: a key is made of the jobs' arguments
        reasons.append(
            ngettext(
                "%(held)s: a concurrency key at its limit",
                "%(held)s: %(keys)d concurrency keys at their limit",
                len(set(held)),
            )
            % {"held": _of_the_oldest(len(held), len(due)), "keys": len(set(held))}
        )
    return reasons


def _rates_spent(keys: set[str], alias: str) -> dict[str, float]:
    """Of these task rate keys, those whose bucket holds no start now: seconds until one."""
    if not keys:
        return {}
    buckets = (
        RateBucket.objects.using(alias)
        .filter(key__in=keys, empty_until__gt=Now())
        .annotate(left=_until(F("empty_until")))
        .values_list("key", "left")
    )
    return {key: left.total_seconds() for key, left in buckets}


def _keys_full(due: list[dict[str, Any]], alias: str) -> dict[str, int]:
    """Of the concurrency keys of these jobs, those at their limit: their running jobs
    (a live lease: a dead worker's job stops holding its slot when its lease ends)."""
    limits = {job["concurrency_key"]: job["concurrency_limit"] or 1 for job in due}
    limits.pop(None, None)
    if not limits:
        return {}
    running = (
        Job.objects.using(alias)
        .filter(state=JobState.RUNNING, concurrency_key__in=list(limits), leased_until__gt=Now())
        .values("concurrency_key")
        .annotate(n=Count("id"))
        .values_list("concurrency_key", "n")
    )
    return {key: n for key, n in running if n >= limits[key]}


# -- words ------------------------------------------------------------------------


def _busy(running: int) -> str:
    """Nothing holds them: the workers that take the queue are busy (with this queue's
    jobs or with their other queues')."""
    return ngettext(
        "its workers' threads are busy (%(running)d of its jobs running)",
        "its workers' threads are busy (%(running)d of its jobs running)",
        running,
    ) % {"running": running}


def _limits() -> dict[str, QueueLimit]:
    try:
        return queue_limits()
    except ConfigurationError:  # reported by the system check skipqueue.E011
        return {}


def _until(moment: Any, *, since: bool = False) -> ExpressionWrapper:
    """`moment` minus the database's now (or now minus it, `since`), as an interval."""
    difference = Now() - moment if since else moment - Now()
    return ExpressionWrapper(difference, output_field=DurationField())


def _of_the_oldest(count: int, sample: int) -> str:
    if count == sample:
        return _("all of the oldest %(sample)d held") % {"sample": sample}
    return _("%(count)d of the oldest %(sample)d held") % {"count": count, "sample": sample}


def _rate_text(limit: QueueLimit) -> str:
    unit = {1.0: "s", 60.0: "m", 3600.0: "h"}.get(limit.period, f"{limit.period:g}s")
    return f"{limit.rate}/{unit}"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return _("under a second")
    if seconds < 120:
        return _("%(n)d s") % {"n": round(seconds)}
    return _("%(n)d min") % {"n": round(seconds / 60)}
