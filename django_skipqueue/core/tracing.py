"""OpenTelemetry traces from enqueue to job (the `[otel]` extra: opentelemetry-api).

- `enqueue_context()`, at an enqueue inside an active span: a PRODUCER span
  `skipqueue enqueue <task>`, whose W3C trace context (`traceparent`, `tracestate`) the
  job row keeps in `trace_context`.
- `start_run()` / `end_run()`, around each attempt in a worker: a CONSUMER span
  `skipqueue run <task>` whose parent is that context (so retries are new spans of the
  same trace), with OpenTelemetry's messaging attributes and the error on a failure.
  Spans the task opens are its children.

The application brings the SDK and its exporter; without an SDK the API's spans record
nothing. Without opentelemetry-api installed, each function returns at its first line.

This module imports OpenTelemetry only once it can matter (`_needed`): a span can be
current, or an SDK set, only in a process that has imported `opentelemetry.trace`
already (the application, its SDK's set-up, `opentelemetry-instrument`), or where
`OTEL_PYTHON_TRACER_PROVIDER` names the provider the API is to load. Elsewhere an
enqueue, or a job that carries no context, costs a dictionary lookup and no import:
the import is 8-16 ms of a worker's start-up, before its first job.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from django_skipqueue.core.redaction import redact_text

logger = logging.getLogger(__name__)

#: The `messaging.system` attribute of our spans.
SYSTEM = "skipqueue"
_INSTRUMENTATION = "django_skipqueue"

_api: Any = None  # (trace, propagate, context) once imported; False: not installed


def _otel() -> Any:
    global _api
    if _api is None:
        try:
            from opentelemetry import context, propagate, trace
        except ImportError:
            _api = False
        except Exception:  # noqa: BLE001
            # The API refuses to load as configured (OTEL_PROPAGATORS naming a
            # propagator that is not installed raises ValueError): said once, then no
            # tracing in this process. Tracing never fails an enqueue or a job.
            logger.warning("tracing: OpenTelemetry could not be loaded; no spans", exc_info=True)
            _api = False
        else:
            _api = (trace, propagate, context)
    return _api


_provider_named: bool | None = None  # OTEL_PYTHON_TRACER_PROVIDER set: read once


def _needed(carried: object = None) -> bool:
    """Whether OpenTelemetry may have something to do here (see the module's docstring):
    `carried`, a job's stored context, is to be carried on; or the API is imported; or
    the environment names a provider. The environment is read once per process, as
    the API reads it once: `name in os.environ` encodes the name and raises KeyError
    inside (0.7 us a job; 5-6 % of a worker's samples holding the GIL, py-spy)."""
    global _provider_named
    if carried or "opentelemetry.trace" in sys.modules:
        return True
    if _provider_named is None:
        _provider_named = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
    return _provider_named


def enqueue_context(task: str, queue: str, count: int = 1) -> dict[str, str] | None:
    """At an enqueue: None outside an active span (or without OpenTelemetry); else a
    PRODUCER span for the enqueue of `count` jobs, and its context to store. A failure
    of the SDK is logged and stores nothing: the enqueue goes on."""
    if "opentelemetry.trace" not in sys.modules:
        return None  # no span can be current in a process that never imported the API
    api = _otel()
    if not api:
        return None
    try:
        return _producer_context(task, queue, count, *api)
    except Exception:  # noqa: BLE001
        logger.warning("tracing: no span for an enqueue of %s", task, exc_info=True)
        return None


def _producer_context(
    task: str, queue: str, count: int, trace: Any, propagate: Any, context: Any
) -> dict[str, str] | None:
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    tracer = trace.get_tracer(_INSTRUMENTATION)
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.destination.name": queue,
        "messaging.operation.type": "send",
        "messaging.operation.name": "enqueue",
        "skipqueue.task": task,
    }
    if count != 1:
        attributes["messaging.batch.message_count"] = count
    span = tracer.start_span(
        f"skipqueue enqueue {task}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    )
    try:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return carrier or None
    finally:
        span.end()


#: The longest value of a stored trace context carried on to a job's run: W3C's limit of
#: a baggage header (8,192 bytes); a `traceparent` is 55 characters.
CARRIED_VALUE_MAX_CHARS = 8192


def start_run(job: Any) -> Any:
    """Before an attempt of `job` (a Job) runs: its CONSUMER span, made current (None
    without OpenTelemetry; None too without an SDK when the job carries no context;
    None if the SDK fails: logged, the job runs). Hand the result to `end_run`."""
    if not _needed(job.trace_context):
        return None  # no context to carry on, and no SDK could record a span
    api = _otel()
    if not api:
        return None
    try:
        return _start_run(job, *api)
    except Exception:  # noqa: BLE001  (a malformed stored context, a broken SDK)
        logger.warning("tracing: no span for job id=%s", job.id, exc_info=True)
        return None


def _start_run(job: Any, trace: Any, propagate: Any, context: Any) -> Any:
    stored = job.trace_context
    # Only text values: a row another client wrote may hold anything (it then starts a
    # trace of its own).
    carrier = (
        {key: value for key, value in stored.items() if isinstance(value, str)}
        if isinstance(stored, dict)
        else {}
    )
    for key, value in list(carrier.items()):
        if len(value) > CARRIED_VALUE_MAX_CHARS:
            # W3C caps baggage at 8,192 bytes; a larger value (another client's, say) was
            # logged whole, secrets and all, by the propagator, on every attempt.
            del carrier[key]
            logger.warning(
                "tracing: job id=%s carries a %s of %d characters, over %d: not carried on",
                job.id,
                redact_text(key[:40]),
                len(value),
                CARRIED_VALUE_MAX_CHARS,
            )
    if not carrier and not _can_record(trace):
        # No parent to carry on and no SDK to record: the API would make the invalid
        # span, and attaching it changes nothing a task can see. Skipped, it saves
        # about 6 us a job where opentelemetry-api is installed but never configured.
        return None
    parent = propagate.extract(carrier) if carrier else None
    span = trace.get_tracer(_INSTRUMENTATION).start_span(
        f"skipqueue run {job.task}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes={
            "messaging.system": SYSTEM,
            "messaging.destination.name": job.queue_name,
            "messaging.operation.type": "process",
            "messaging.operation.name": "run",
            "messaging.message.id": str(job.id),
            "skipqueue.task": job.task,
            "skipqueue.attempt": job.attempts,
        },
    )
    # On the carried context, so that its baggage reaches the task too.
    token = context.attach(trace.set_span_in_context(span, parent))
    return span, token


def _can_record(trace: Any) -> bool:
    """Whether a span started now may record: a real provider (an SDK's) is set. The
    API's own providers, its proxy before any is set and its no-op one, make only
    non-recording spans. Asked on every job: a provider may be set after the worker
    started."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def end_run(started: Any, outcome: str, error: Any = None) -> None:
    """After an attempt: its outcome, and on a failure its error (`error`, an ErrorInfo:
    the class, message and traceback as the job's history stores them, secrets
    redacted) as the span's exception event and an ERROR status. Never raises: a
    tracing failure must not fail the job (it is logged)."""
    if started is None:
        return
    trace, _propagate, context = _otel()
    span, token = started
    try:
        span.set_attribute("skipqueue.outcome", outcome)
        if error is not None:
            span.add_event(
                "exception",
                {
                    "exception.type": error.type,
                    "exception.message": error.message,
                    "exception.stacktrace": error.traceback,
                },
            )
            span.set_status(trace.Status(trace.StatusCode.ERROR, error.type.rsplit(".", 1)[-1]))
    except Exception:  # noqa: BLE001  (an exporter's or SDK's failure is not the job's)
        logger.warning("tracing: the span of a job could not be completed", exc_info=True)
    finally:
        try:
            context.detach(token)
            span.end()
        except Exception:  # noqa: BLE001
            logger.warning("tracing: the span of a job could not be ended", exc_info=True)
