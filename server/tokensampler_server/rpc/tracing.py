"""OpenTelemetry tracing of the calls, on with --otlp-endpoint: every OpenTelemetry use of the server is here.

Only server.py imports this module, and only when tracing is on: without it no opentelemetry module is
loaded and no span is built (the call guard makes one `is not None` check per call). With it, the guard
hands each finished call to `CallTracer.record`, which builds the call's SERVER span after the fact, from
the call's record:

- name: the method ("tokensampler.v1.Sampler/Sample"); start and end: the call's, as the record measured them;
- parent: the caller's span named by the W3C `traceparent` metadata (the client library sends it when the
  caller has an active span); without one (or with one that does not parse) the span starts a trace;
- attributes: rpc.system, rpc.service, rpc.method, rpc.grpc.status_code (OpenTelemetry's conventions for gRPC),
  tokensampler.request_id; on calls that sampled: tokensampler.rows, tokensampler.backend ("cpu" or "cuda")
  and tokensampler.request_path ("native" when the CUDA backend's C++ path answered, else "python");
- status ERROR for the codes that are the server's fault (INTERNAL, UNKNOWN, UNAVAILABLE, ...), unset otherwise;
- on calls that sampled, an event per stage the record timed, with its `duration_ns`: deserialize (parse,
  validate, decode), queue, compute, serialize (result to response message). Events, not child spans: four
  more spans made a call's tracing five times as costly (the SDK builds, samples and queues each). The
  record keeps how long each stage took, not when it began: the events' times are the stages laid back to
  back from the call's start.

A SampleStream message is a request of its own: sample_rpc.py hands each answered message to `record` (through
call_record.current_message_tracer, which the guard sets for the stream with the stream's metadata), so every
message gets its span under the stream's caller. Health checks are not traced: load balancers probe every few
seconds, and each probe would be a trace.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import grpc

from tokensampler_server import __version__
from tokensampler_server.rpc.call_record import CallRecord
from tokensampler_server.core.config import StartupError

_MISSING = "--otlp-endpoint needs OpenTelemetry ({}): pip install 'tokensampler[tracing]'"
try:
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as err:
    raise StartupError(_MISSING.format(err)) from None

Metadata = Sequence[tuple[str, str | bytes]]

_W3C = TraceContextTextMapPropagator()
_W3C_KEYS = frozenset(_W3C.fields)  # traceparent, tracestate
_UNTRACED_SERVICES = ("grpc.health.v1.Health",)
# OpenTelemetry's gRPC conventions: a server span is an error only for the codes that are the server's fault.
_SERVER_FAULTS = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
})


def _stages(call: CallRecord) -> tuple[tuple[str, int], ...]:
    return (("deserialize", call.deserialize_ns()), ("queue", call.queue_ns),
            ("compute", call.compute_ns), ("serialize", call.encode_ns))


class CallTracer:
    """Builds each call's span into `provider` (its processors export them)."""

    def __init__(self, provider: TracerProvider, backend: str) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("tokensampler_server", __version__)
        self._backend = backend

    @staticmethod
    def traces(method: str) -> bool:
        """Whether calls of `method` (full name without the leading slash) get spans."""
        return not method.startswith(_UNTRACED_SERVICES)

    def record(self, call: CallRecord, code: grpc.StatusCode, elapsed_ns: int, metadata: Metadata | None) -> None:
        """The span of a finished call. Call it before the metrics see the call: they trade its batch for row
        counts, and the batch tells which path answered."""
        end = time.time_ns()
        start = end - elapsed_ns
        service, _, method = call.method.partition("/")
        attributes: dict[str, str | int] = {
            "rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
            "rpc.grpc.status_code": code.value[0], "tokensampler.request_id": call.request_id,
        }
        rows = call.num_rows
        if rows is not None:
            attributes["tokensampler.rows"] = rows
            attributes["tokensampler.backend"] = self._backend
            attributes["tokensampler.request_path"] = "python" if call.batch is not None else "native"
        carrier = {key: value for key, value in metadata or () if key in _W3C_KEYS and isinstance(value, str)}
        span = self._tracer.start_span(call.method, context=_W3C.extract(carrier), kind=SpanKind.SERVER,
                                       attributes=attributes, start_time=start)
        if rows is not None:
            at = start
            for name, duration in _stages(call):
                if duration:
                    span.add_event(name, {"duration_ns": duration}, timestamp=at)
                    at += duration
        if code in _SERVER_FAULTS:
            span.set_status(Status(StatusCode.ERROR, code.name))
        span.end(end_time=end)

    def shutdown(self) -> None:
        """Exports the spans still buffered, then stops (an unreachable collector holds it about the exporter's
        timeout)."""
        self._provider.shutdown()


def otlp_tracer(endpoint: str, backend: str) -> CallTracer:
    """A tracer whose spans go in batches to the OTLP/gRPC collector at `endpoint` (http:// is plaintext).

    The OTEL_* variables of the SDK and the exporter apply (sampler, batch sizes, timeouts, headers,
    OTEL_RESOURCE_ATTRIBUTES); OTEL_SERVICE_NAME replaces the service name "tokensampler".
    """
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as err:
        raise StartupError(_MISSING.format(err)) from None
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or "tokensampler",
                                SERVICE_VERSION: __version__})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return CallTracer(provider, backend)
