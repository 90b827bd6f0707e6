"""OpenTelemetry traces from request to job (issue 28), across real processes: this
test process plays the web side (the SDK with an in-memory exporter), a `runworker`
subprocess the worker (the SDK exporting to a file this test reads)."""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from django_skipqueue import chain
from django_skipqueue.models import Job, JobState
from tests.processes import WorkerHandle, start_python, wait_until
from tests.testapp import tasks

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

_exporter = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def web_side_sdk():
    """The SDK of this process (set once: OpenTelemetry refuses a second provider)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(_exporter))
    yield
    _exporter.clear()


@pytest.fixture
def traced_worker(tmp_path):
    spans = tmp_path / "worker-spans.jsonl"
    handle = WorkerHandle(
        ["-v", "2", "--reap-interval", "0"],
        tmp_path / "worker.log",
        SKIPQUEUE_TEST_SPANS_FILE=str(spans),
    )
    yield handle, spans
    handle.stop()


def worker_spans(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def printed_by(code: str, **env: str) -> list[str]:
    """The words `code` prints in a fresh interpreter (Django set up, `env` added)."""
    child = start_python(code, **env)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    return out.split()


def hex_id(value: int, width: int) -> str:
    return f"0x{value:0{width}x}"


def test_one_trace_links_the_request_to_its_jobs_attempts_across_processes(traced_worker):
    worker, spans_file = traced_worker
    _exporter.clear()
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /signup", kind=trace.SpanKind.SERVER) as request:
        job = tasks.retry_once.enqueue()  # fails its first attempt with Retry, then succeeds
        plain = tasks.add.enqueue(1, 2)
    untraced = tasks.add.enqueue(2, 3)  # outside any span: no context stored
    wait_until(
        lambda: (
            Job.objects.filter(id__in=[job.id, plain.id, untraced.id], state=JobState.DONE).count()
            == 3
        ),
        timeout=30,
    )
    trace_id = hex_id(request.get_span_context().trace_id, 32)
    producers = [s for s in _exporter.get_finished_spans() if s.kind == trace.SpanKind.PRODUCER]
    assert [s.name for s in producers] == [
        f"skipqueue enqueue {tasks.retry_once.name}",
        f"skipqueue enqueue {tasks.add.name}",
    ]
    assert {hex_id(s.context.trace_id, 32) for s in producers} == {trace_id}
    assert Job.objects.get(id=untraced.id).trace_context is None
    stored = Job.objects.get(id=job.id).trace_context
    assert stored["traceparent"].split("-")[1] == trace_id[2:]
    assert job.trace_context == stored and untraced.trace_context is None  # as returned

    def consumer_spans() -> list[dict]:
        return [s for s in worker_spans(spans_file) if s["kind"] == "SpanKind.CONSUMER"]

    wait_until(lambda: len(consumer_spans()) >= 4, timeout=10, message="worker spans missing")
    runs = [s for s in consumer_spans() if s["attributes"]["messaging.message.id"] == str(job.id)]
    assert [s["attributes"]["skipqueue.attempt"] for s in runs] == [1, 2]  # one per attempt
    assert {s["context"]["trace_id"] for s in runs} == {trace_id}  # the request's trace
    producer = next(s for s in producers if tasks.retry_once.name in s.name)
    assert {s["parent_id"] for s in runs} == {hex_id(producer.context.span_id, 16)}
    assert runs[0]["name"] == f"skipqueue run {tasks.retry_once.name}"
    assert runs[0]["attributes"]["messaging.system"] == "skipqueue"
    assert runs[0]["attributes"]["messaging.destination.name"] == "default"
    assert [s["attributes"]["skipqueue.outcome"] for s in runs] == ["released", "succeeded"]
    other = [
        s for s in consumer_spans() if s["attributes"]["messaging.message.id"] == str(untraced.id)
    ]
    assert other and other[0]["context"]["trace_id"] != trace_id  # a trace of its own


def test_a_failed_attempt_records_its_error_on_its_span(traced_worker):
    worker, spans_file = traced_worker
    with trace.get_tracer("tests").start_as_current_span("request"):
        job = tasks.rejects_input.enqueue("bad")
    wait_until(lambda: Job.objects.get(id=job.id).state == JobState.FAILED, timeout=30)
    wait_until(lambda: worker_spans(spans_file), timeout=10)
    [span] = [s for s in worker_spans(spans_file) if s["kind"] == "SpanKind.CONSUMER"]
    assert span["status"]["status_code"] == "ERROR"
    assert span["events"][0]["name"] == "exception"
    assert span["events"][0]["attributes"]["exception.type"] == "builtins.ValueError"


def test_a_workflows_jobs_carry_the_context_of_the_span_that_started_it():
    with trace.get_tracer("tests").start_as_current_span("request") as request:
        workflow = chain(tasks.add.s(1, 2), tasks.double.s()).enqueue()
    contexts = [job.trace_context for job in workflow.jobs.order_by("id")]
    trace_id = f"{request.get_span_context().trace_id:032x}"
    assert len(contexts) == 2
    assert all(context["traceparent"].split("-")[1] == trace_id for context in contexts)


def test_a_relayed_job_carries_its_trace_through_rabbitmq(relayed, settings, tmp_path):
    """The relay publishes the row's context as the message's traceparent header; the
    broker consumer (`runworker --broker`) runs the job in a span of the same trace."""
    from django_skipqueue.broker.relay import Relay
    from django_skipqueue.conf.relay import relay_config

    spans_file = tmp_path / "consumer-spans.jsonl"
    consumer = WorkerHandle(
        ["-v", "2", "--broker"],
        tmp_path / "consumer.log",
        SKIPQUEUE_TEST_SPANS_FILE=str(spans_file),
        SKIPQUEUE_TEST_SETTINGS=json.dumps(settings.SKIPQUEUE),
    )
    try:
        consumer.wait_for_output("broker consumer connected")
        with trace.get_tracer("tests").start_as_current_span("request") as request:
            job = tasks.add.using(queue_name=relayed).enqueue(1, 2)
        assert Relay(relay_config(), listen=False).relay_due() == 1
        wait_until(
            lambda: [s for s in worker_spans(spans_file) if s["kind"] == "SpanKind.CONSUMER"],
            timeout=30,
            message="the consumer made no span",
        )
    finally:
        consumer.stop()
    [span] = [s for s in worker_spans(spans_file) if s["kind"] == "SpanKind.CONSUMER"]
    assert span["attributes"]["messaging.message.id"] == str(job.id)
    assert span["context"]["trace_id"] == hex_id(request.get_span_context().trace_id, 32)


def test_tracing_never_fails_a_job_an_unprintable_error_or_a_garbage_context():
    """With the SDK recording in this process: an exception whose str() raises, and a
    trace context another client wrote as garbage, still run and record the job."""
    from django_skipqueue.testing import run_jobs

    with trace.get_tracer("tests").start_as_current_span("request"):
        unprintable = tasks.raises_unstorable.enqueue("unprintable")
    garbage = tasks.add.enqueue(1, 2)
    Job.objects.filter(id=garbage.id).update(trace_context={"traceparent": 42, "x": [1]})
    _exporter.clear()
    run_jobs()
    unprintable.refresh_from_db()
    garbage.refresh_from_db()
    assert unprintable.state == JobState.FAILED
    assert (garbage.state, garbage.result) == (JobState.DONE, 3)
    spans = {
        s.attributes["messaging.message.id"]: s
        for s in _exporter.get_finished_spans()
        if s.kind == trace.SpanKind.CONSUMER
    }
    failed = spans[str(unprintable.id)]
    assert failed.status.status_code == trace.StatusCode.ERROR
    assert failed.events[0].attributes["exception.message"] == (
        "<str() of the exception raised RuntimeError>"
    )
    assert str(garbage.id) in spans  # a trace of its own


def test_the_last_attempts_span_says_failed_and_a_retry_request_says_released():
    from django_skipqueue.testing import run_jobs

    with trace.get_tracer("tests").start_as_current_span("request"):
        last = tasks.always_fails.using(max_attempts=1).enqueue("no luck")
        released = tasks.retry_once.enqueue()
    _exporter.clear()
    run_jobs()
    outcomes: dict[str, list[str]] = {}
    for span in _exporter.get_finished_spans():
        if span.kind == trace.SpanKind.CONSUMER:
            key = span.attributes["messaging.message.id"]
            outcomes.setdefault(key, []).append(span.attributes["skipqueue.outcome"])
    assert outcomes[str(last.id)] == ["failed"]  # not "retried": no attempt was left
    assert outcomes[str(released.id)][0] == "released"  # Retry: given back, not a failure
    assert Job.objects.get(id=last.id).state == JobState.FAILED


def test_without_an_sdk_a_job_with_no_context_makes_no_span_and_a_carried_one_goes_on():
    """In a process where opentelemetry-api is installed but no provider is set (a fresh
    interpreter: this module's own set one for good): a job with no stored context
    gets no span at all (there is nothing to record or to carry on). A job that carries
    a context still runs inside it, its baggage included, so that the task's own calls
    propagate the trace without an SDK. Once a provider is set, every job gets its span again."""
    code = (
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from django_skipqueue.core import tracing\n"
        "from django_skipqueue.models import Job\n"
        "parent = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'\n"
        "plain = Job(id=1, task='t', queue_name='q', attempts=1)\n"
        "carried = Job(id=2, task='t', queue_name='q', attempts=1,\n"
        "              trace_context={'traceparent': parent, 'baggage': 'user=bob'})\n"
        "print(tracing.start_run(plain) is None, end=' ')\n"
        "started = tracing.start_run(carried)\n"
        "seen = trace.get_current_span().get_span_context().trace_id\n"
        "from opentelemetry import baggage\n"
        "print(baggage.get_baggage('user'), end=' ')\n"
        "tracing.end_run(started, 'succeeded')\n"
        "print(f'{seen:032x}' == parent.split('-')[1], end=' ')\n"
        "print(trace.get_current_span().get_span_context().is_valid, end=' ')\n"
        "trace.set_tracer_provider(TracerProvider())\n"
        "started = tracing.start_run(plain)\n"
        "print(started is not None and started[0].is_recording())\n"
        "tracing.end_run(started, 'succeeded')\n"
    )
    assert printed_by(code) == ["True", "bob", "True", "False", "True"]


def test_every_enqueue_path_returns_and_stores_the_same_trace_context():
    from django.db.models.signals import pre_save

    tracer = trace.get_tracer("tests")

    def audit(sender, **kwargs):  # type: ignore[no-untyped-def]  # a project-wide receiver
        pass

    with tracer.start_as_current_span("POST /bulk", kind=trace.SpanKind.SERVER):
        plain = tasks.add.enqueue(1, 2)
        bulk = tasks.add.enqueue_many([((1, 2), {}), ((3, 4), {})])
        pre_save.connect(audit)
        try:
            saved = tasks.add.enqueue(5, 6)  # through save(), for the receiver
        finally:
            pre_save.disconnect(audit)
    for job in (plain, *bulk, saved):
        stored = Job.objects.get(id=job.id).trace_context
        assert stored is not None and stored["traceparent"].startswith("00-"), job
        assert job.trace_context == stored


def test_a_process_that_never_imported_opentelemetry_does_not_import_it_for_plain_work():
    """The API is imported only where it can matter (core/tracing.py): a fresh worker
    saves the import (8-16 ms of its start-up) for an enqueue and for a job that
    carries no context. A job that carries one imports it and goes on in its trace; so
    does a plain job once OTEL_PYTHON_TRACER_PROVIDER names a provider to load."""
    code = (
        "import sys\n"
        "from django_skipqueue.core import tracing\n"
        "from django_skipqueue.models import Job\n"
        "from tests.testapp import tasks\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "print(loaded() == [], end=' ')\n"
        "job = tasks.add.enqueue(1, 2)\n"
        "print(Job.objects.get(id=job.id).trace_context is None, end=' ')\n"
        "print(tracing.start_run(Job(id=1, task='t', queue_name='q', attempts=1)) is None,"
        " end=' ')\n"
        "print(loaded() == [], end=' ')\n"
        "parent = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'\n"
        "carried = Job(id=2, task='t', queue_name='q', attempts=1,\n"
        "              trace_context={'traceparent': parent})\n"
        "started = tracing.start_run(carried)\n"
        "from opentelemetry import trace\n"
        "seen = trace.get_current_span().get_span_context().trace_id\n"
        "tracing.end_run(started, 'succeeded')\n"
        "print(f'{seen:032x}' == parent.split('-')[1])\n"
    )
    assert printed_by(code) == ["True", "True", "True", "True", "True"]

    code = (
        "from django_skipqueue.core import tracing\n"
        "from django_skipqueue.models import Job\n"
        "started = tracing.start_run(Job(id=1, task='t', queue_name='q', attempts=1))\n"
        "print(started is not None and started[0].is_recording())\n"
        "tracing.end_run(started, 'succeeded')\n"
    )
    assert printed_by(code, OTEL_PYTHON_TRACER_PROVIDER="sdk_tracer_provider") == ["True"]


def test_an_api_that_refuses_to_load_fails_no_enqueue_and_no_job():
    """OTEL_PROPAGATORS naming a propagator that is not installed makes the API's import
    raise ValueError: said once in the log, then no tracing; the enqueue and the job (one
    that carries a context, which needs the import) go on."""
    code = (
        "from django_skipqueue.core import tracing\n"
        "from django_skipqueue.models import Job\n"
        "from opentelemetry import trace\n"  # a span could be current: the enqueue imports
        "from tests.testapp import tasks\n"
        "job = tasks.add.enqueue(1, 2)\n"
        "print(Job.objects.get(id=job.id).trace_context is None, end=' ')\n"
        "parent = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'\n"
        "carried = Job(id=2, task='t', queue_name='q', attempts=1,\n"
        "              trace_context={'traceparent': parent})\n"
        "print(tracing.start_run(carried) is None)\n"
        "from django_skipqueue.testing import run_jobs\n"
        "Job.objects.filter(id=job.id).update(trace_context={'traceparent': parent})\n"
        "run_jobs()\n"
        "print(Job.objects.get(id=job.id).state)\n"
    )
    child = start_python(code, OTEL_PROPAGATORS="no_such_propagator")
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out.split() == ["True", "True", "done"]
    assert err.count("OpenTelemetry could not be loaded") == 1


def test_a_relayed_message_keeps_the_stored_context_and_baggage():
    """The relay sends the row's whole trace_context as headers; the consumer reads
    back each header a context may hold, baggage included (the traces guide's promise
    for relayed jobs too)."""
    from django_skipqueue.broker.message import Message

    stored = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=x",
        "baggage": "user=bob",
    }
    message = Message(
        job_id=1, task="t", queue="q", args=[], kwargs={}, attempt=1, max_attempts=3,
        lease_seconds=30.0, trace=stored,
    )  # fmt: skip
    assert Message.decode(message.body(), message.properties().headers).trace == stored


@pytest.mark.django_db(transaction=True)
def test_an_oversized_baggage_is_not_carried_and_never_logged_whole(caplog):
    """A 100 KB baggage value (another client's row) was logged whole, unmasked, by the
    propagator on every attempt. Over W3C's 8,192 bytes it is not carried on, and our
    one line names its size, not its text."""
    import logging

    from django_skipqueue.testing import run_jobs

    caplog.set_level(logging.DEBUG)
    secret = "token=S3CRET-" + "x" * 100_000
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    tasks.add.enqueue(1, 2)
    Job.objects.update(trace_context={"traceparent": parent, "baggage": secret})
    run_jobs()
    assert Job.objects.get().state == JobState.DONE
    assert all(len(r.getMessage()) < 2000 for r in caplog.records)
    assert "S3CRET" not in caplog.text
    assert any("over 8192" in r.getMessage() for r in caplog.records)
