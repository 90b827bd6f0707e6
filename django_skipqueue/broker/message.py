"""One job as it travels through the broker: its JSON body and its headers."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django_skipqueue.broker.topology import ALONE_HEADER, ATTEMPT_HEADER, pika_module
from django_skipqueue.exceptions import InvalidJobError

if TYPE_CHECKING:
    import pika


@dataclass(frozen=True)
class Message:
    """One job as it travels through the broker (the body is JSON; the job's id is
    the message id too, the consumers' deduplication key)."""

    job_id: int
    task: str
    queue: str
    args: list[Any]
    kwargs: dict[str, Any]
    attempt: int  # the attempt this delivery is, from 1
    max_attempts: int
    lease_seconds: float
    #: The W3C trace context of the span that enqueued the job (OpenTelemetry), sent
    #: as the message's `traceparent`, `tracestate` and `baggage` headers; None:
    #: untraced.
    trace: dict[str, str] | None = None
    #: Run in a process of its own (ALONE_HEADER): the attempt before it was given up
    #: on while it ran.
    alone: bool = False

    def body(self) -> bytes:
        return json.dumps(
            {
                "id": self.job_id,
                "task": self.task,
                "queue": self.queue,
                "args": self.args,
                "kwargs": self.kwargs,
                "max_attempts": self.max_attempts,
                "lease_seconds": self.lease_seconds,
            },
            separators=(",", ":"),
        ).encode()

    def properties(self, **headers: Any) -> pika.BasicProperties:
        pika = pika_module()
        return pika.BasicProperties(
            message_id=str(self.job_id),
            delivery_mode=2,  # persistent
            content_type="application/json",
            headers=self.headers(**headers),
        )

    def headers(self, **more: Any) -> dict[str, Any]:
        """Its headers (what `decode` reads with the body), and `more`."""
        return {
            ATTEMPT_HEADER: self.attempt,
            **({ALONE_HEADER: 1} if self.alone else {}),
            **(self.trace or {}),
            **more,
        }

    def next_attempt(self, *, released: bool = False, alone: bool = False) -> Message:
        """The message of the next attempt. `released` (the task raised Retry): the
        attempt is given back, as in the table, by one more allowed attempt. `alone`:
        this attempt was given up on while it ran; the next runs in a process of its own."""
        return dataclasses.replace(
            self,
            attempt=self.attempt + 1,
            max_attempts=self.max_attempts + (1 if released else 0),
            alone=alone,
        )

    @classmethod
    def decode(cls, body: bytes, headers: dict[str, Any] | None) -> Message:
        """The message of `body`; InvalidJobError saying what is wrong with it."""
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                raise TypeError(f"the body is a JSON {_json_kind(data)}, not an object")
            if not isinstance(data["args"], list):
                raise TypeError(f"'args' is a JSON {_json_kind(data['args'])}, not an array")
            if not isinstance(data["kwargs"], dict):
                raise TypeError(f"'kwargs' is a JSON {_json_kind(data['kwargs'])}, not an object")
            return cls(
                job_id=int(data["id"]),
                task=str(data["task"]),
                queue=str(data["queue"]),
                args=list(data["args"]),
                kwargs=dict(data["kwargs"]),
                attempt=int((headers or {}).get(ATTEMPT_HEADER, 1)),
                max_attempts=int(data["max_attempts"]),
                lease_seconds=float(data["lease_seconds"]),
                trace=_trace_of(headers or {}),
                alone=bool((headers or {}).get(ALONE_HEADER)),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise InvalidJobError(f"a broker message is not a job: {error!r}") from None


#: The W3C trace context's headers and W3C baggage's, as OpenTelemetry's default
#: propagators name them: what a job row's `trace_context` holds.
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")


def _trace_of(headers: dict[str, Any]) -> dict[str, str] | None:
    trace = {name: headers[name] for name in TRACE_HEADERS if isinstance(headers.get(name), str)}
    return trace if "traceparent" in trace else None


def _json_kind(value: object) -> str:
    """What JSON calls the type of a decoded `value`."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")
