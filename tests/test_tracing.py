"""OpenTelemetry tracing: a span per call with its attributes, stage events and the caller's span as parent; the client
sends the caller's span; a server without --otlp-endpoint loads no opentelemetry module."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from concurrent import futures

import grpc
import pytest
import torch

pytest.importorskip("opentelemetry.sdk")

from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402
from tokensampler_client import AsyncSamplerClient, SamplerClient, TokenSamplerError  # noqa: E402
from tokensampler_client._channel import call_metadata  # noqa: E402
from tokensampler_client._proto import sampler_pb2 as pb  # noqa: E402
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc  # noqa: E402
from tokensampler_client.params import build_sample_request  # noqa: E402
from tokensampler_server.rpc.call_guard import CallGuard  # noqa: E402
from tokensampler_server.app.cli import parse_args  # noqa: E402
from tokensampler_server.core.config import Limits  # noqa: E402
from tokensampler_server.rpc.service import SamplerService  # noqa: E402
from tokensampler_server.rpc.tracing import CallTracer  # noqa: E402

from .conftest import start_server  # noqa: E402
from .test_call_guard import FailsOnWideRows, _request  # noqa: E402

SAMPLE = "tokensampler.v1.Sampler/Sample"
TRACE_ID, PARENT_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"
STAGES = ["deserialize", "queue", "compute", "serialize"]


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


async def _serve(provider: TracerProvider, calls: Callable[[str], Awaitable[None]]) -> None:
    """A server whose guard traces into `provider` (health included, as the real server registers it); runs
    `calls(target)`."""
    server = grpc.aio.server()
    registration = CallGuard(tracer=CallTracer(provider, "cpu")).registration(server)
    service = SamplerService(FailsOnWideRows(), Limits())
    pb_grpc.add_SamplerServicer_to_server(service, registration)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, registration)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await calls(f"127.0.0.1:{port}")
    finally:
        await server.stop(None)
        await service.close()


def _by_request_id(finished: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.attributes["tokensampler.request_id"]: span for span in finished if span.kind == SpanKind.SERVER}


def test_a_span_per_call_with_attributes_stage_events_status_and_the_given_parent(spans) -> None:
    provider, exporter = spans

    async def calls(target: str) -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.SamplerStub(channel)
            await stub.Sample(_request(8), metadata=(("x-request-id", "ok"), ("traceparent", TRACEPARENT)))
            invalid = build_sample_request(torch.randn(2, 8), top_p=0.0)
            for request, request_id in ((invalid, "invalid"), (_request(101), "bug")):
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Sample(request, metadata=(("x-request-id", request_id), ("traceparent", "00-junk")))
            await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=(("x-request-id", "info"),))
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())

    asyncio.run(_serve(provider, calls))
    finished = exporter.get_finished_spans()
    calls_by_id = _by_request_id(finished)
    assert sorted(calls_by_id) == ["bug", "info", "invalid", "ok"]  # one span per call; health checks none

    ok = calls_by_id["ok"]
    assert ok.name == SAMPLE
    assert ok.parent is not None and ok.parent.is_remote
    assert (ok.context.trace_id, ok.parent.span_id) == (TRACE_ID, PARENT_ID)
    assert dict(ok.attributes) == {
        "rpc.system": "grpc", "rpc.service": "tokensampler.v1.Sampler", "rpc.method": "Sample",
        "rpc.grpc.status_code": 0, "tokensampler.request_id": "ok", "tokensampler.rows": 2,
        "tokensampler.backend": "cpu", "tokensampler.request_path": "python",
    }
    assert ok.status.status_code == StatusCode.UNSET
    assert [event.name for event in ok.events] == STAGES
    durations = [event.attributes["duration_ns"] for event in ok.events]
    assert all(duration > 0 for duration in durations)
    assert sum(durations) <= ok.end_time - ok.start_time
    times = [event.timestamp for event in ok.events]  # back to back from the call's start
    assert times == [ok.start_time + sum(durations[:i]) for i in range(len(STAGES))]

    invalid, bug, info = calls_by_id["invalid"], calls_by_id["bug"], calls_by_id["info"]
    assert invalid.parent is None  # a traceparent that does not parse starts a trace of its own
    assert invalid.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert invalid.status.status_code == StatusCode.UNSET  # the caller's fault: not an error of the server
    assert "tokensampler.rows" not in invalid.attributes
    assert bug.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert bug.status.status_code == StatusCode.ERROR and bug.attributes["tokensampler.rows"] == 2
    assert info.name == "tokensampler.v1.Sampler/GetServerInfo" and "tokensampler.rows" not in info.attributes
    # Stages only on the calls that sampled: the failed batch was decoded, never queued.
    assert [event.name for event in bug.events] == ["deserialize"]
    assert not invalid.events and not info.events
    assert len(finished) == 4  # no span but the calls'


def test_each_stream_message_gets_a_span_under_the_stream_s_caller(spans) -> None:
    """A SampleStream message is a request of its own: a span each, with its request id, rows and stages, whose
    parent is the span the stream's metadata names; a failed message's span carries its status."""
    provider, exporter = spans

    async def calls(target: str) -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stream = pb_grpc.SamplerStub(channel).SampleStream(
                iter([_request(4), _request(101), _request(8)]),
                metadata=(("x-request-id", "s"), ("traceparent", TRACEPARENT)))
            answers = [answer async for answer in stream]
            assert [answer.WhichOneof("result") for answer in answers] == ["response", "error", "response"]

    asyncio.run(_serve(provider, calls))
    by_id = _by_request_id(exporter.get_finished_spans())
    assert sorted(by_id) == ["s.0", "s.1", "s.2"]
    for request_id in ("s.0", "s.2"):
        span = by_id[request_id]
        assert span.name == "tokensampler.v1.Sampler/SampleStream" and span.attributes["tokensampler.rows"] == 2
        assert (span.context.trace_id, span.parent.span_id) == (TRACE_ID, PARENT_ID)
        assert [event.name for event in span.events] == STAGES
    failed = by_id["s.1"]
    assert failed.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert failed.status.status_code == StatusCode.ERROR


def test_the_client_sends_the_active_span_as_traceparent(spans) -> None:
    provider, _ = spans
    assert [key for key, _ in call_metadata("r")] == ["x-request-id"]  # no active span: nothing more
    with provider.get_tracer("engine").start_as_current_span("step") as step:
        metadata = dict(call_metadata("r", "token"))
    context = step.get_span_context()
    assert metadata["traceparent"] == f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    assert metadata["x-request-id"] == "r" and metadata["authorization"] == "Bearer token"


def test_the_server_span_is_a_child_of_the_engine_span_through_the_client(spans) -> None:
    provider, exporter = spans
    engine = provider.get_tracer("engine")

    async def calls(target: str) -> None:
        async with AsyncSamplerClient(target, timeout=30) as client:
            with engine.start_as_current_span("decode step"):
                await client.sample(torch.randn(3, 16), request_id="through-client")

    asyncio.run(_serve(provider, calls))
    step = next(span for span in exporter.get_finished_spans() if span.name == "decode step")
    server = _by_request_id(exporter.get_finished_spans())["through-client"]
    assert server.context.trace_id == step.context.trace_id
    assert server.parent.span_id == step.context.span_id and server.attributes["tokensampler.rows"] == 3


def test_otlp_endpoint_flag_and_variable(monkeypatch) -> None:
    assert parse_args([]).otlp_endpoint is None
    assert parse_args(["--otlp-endpoint", "http://collector:4317"]).otlp_endpoint == "http://collector:4317"
    monkeypatch.setenv("TOKENSAMPLER_OTLP_ENDPOINT", "https://collector:4317")
    assert parse_args([]).otlp_endpoint == "https://collector:4317"
    with pytest.raises(SystemExit):
        parse_args(["--otlp-endpoint", "collector:4317"])


_WITHOUT_TRACING = """
import asyncio, sys
import grpc, torch
from tokensampler_client import AsyncSamplerClient
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_server.app import server as _  # all that serve() imports
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.rpc.call_guard import CallGuard
from tokensampler_server.core.config import Limits
from tokensampler_server.rpc.service import SamplerService

async def run():
    server = grpc.aio.server()
    service = SamplerService(CpuBackend(), Limits())
    pb_grpc.add_SamplerServicer_to_server(service, CallGuard().registration(server))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with AsyncSamplerClient(f"127.0.0.1:{port}", timeout=30) as client:
        await client.sample(torch.randn(2, 8))
    await server.stop(None)
    await service.close()

asyncio.run(run())
print(sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry"))
"""


def test_without_tracing_neither_server_nor_client_loads_opentelemetry() -> None:
    """Zero cost when off: a call served and made without tracing loads no opentelemetry module."""
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TRACING], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_missing_opentelemetry_stops_the_server_with_what_to_install() -> None:
    script = ("import sys; sys.modules['opentelemetry'] = None  # as if not installed\n"
              "from tokensampler_server.app.cli import main\n"
              "sys.exit(main(['--device', 'cpu', '--host', '127.0.0.1', '--port', '0', '--no-metrics',"
              " '--otlp-endpoint', 'http://127.0.0.1:4317']))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 2, result.stderr
    assert "pip install 'tokensampler[tracing]'" in result.stderr


class _Collector:
    """An OTLP trace collector on loopback that keeps the spans it receives."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans: list = []
        collector = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the generated name
                collector.spans += [span for resource in request.resource_spans for scope in resource.scope_spans
                                    for span in scope.spans]
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def test_a_real_server_exports_its_spans_to_the_otlp_endpoint(spans) -> None:
    """TOKENSAMPLER_OTLP_ENDPOINT on a server process: the span of a call made in an engine span reaches the
    collector with that parent, by the time the server has exited (shutdown exports what is buffered)."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    provider, _ = spans
    collector = _Collector()
    running = start_server("--device", "cpu",
                           env={"TOKENSAMPLER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}"})
    try:
        with SamplerClient(running.target, timeout=30) as client:
            with provider.get_tracer("engine").start_as_current_span("decode step") as step:
                client.sample(torch.randn(2, 8), request_id="exported")
            with pytest.raises(TokenSamplerError):
                client.sample(torch.randn(2, 8), top_p=0.0, request_id="refused")
        assert running.stop() == 0
    finally:
        running.stop()
        collector.server.stop(None)
    by_id = {attribute.value.string_value: span for span in collector.spans for attribute in span.attributes
             if attribute.key == "tokensampler.request_id"}
    assert sorted(by_id) == ["exported", "refused"]
    exported = by_id["exported"]
    context = step.get_span_context()
    assert exported.name == SAMPLE
    assert exported.trace_id == context.trace_id.to_bytes(16, "big")
    assert exported.parent_span_id == context.span_id.to_bytes(8, "big")
    assert any(line.endswith(f"tracing: spans to http://127.0.0.1:{collector.port}") for line in running.log)
