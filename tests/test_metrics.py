"""Prometheus metrics: known traffic through a real server, then /metrics scraped over HTTP."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tokensampler_client import SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.tensors import encode_tensor
from tokensampler_server import __version__
from tokensampler_server.backends.base import Backend, BackendInfo
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.app.cli import parse_args
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.rpc.call_guard import CallGuard
from tokensampler_server.core.fallbacks import record_fallback
from tokensampler_server.rpc.metrics import ServerMetrics, start_metrics_http
from tokensampler_server.model.sampling import SamplingBatch, SamplingResult
from tokensampler_server.rpc.service import SamplerService

from .conftest import RunningServer, serving

SAMPLE = "tokensampler.v1.Sampler/Sample"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def metrics_port(server: RunningServer) -> int:
    """The port of the line 'metrics on http://HOST:PORT/metrics', logged before the serving line."""
    for line in server.log:
        if match := re.search(r"metrics on http://\S+:(\d+)/metrics", line):
            return int(match[1])
    raise AssertionError("no metrics line in the log:\n" + "\n".join(server.log))


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def parse_samples(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture(scope="module")
def metered_server() -> Iterator[RunningServer]:
    """A server of its own, so that its counts are exactly this module's traffic."""
    yield from serving("--device", "cpu", "--metrics-port", "0")


V = 64
# (rows, params): every mode, the priority between them (T == 0 first, then top-k, top-p, min-p),
# and the top-k values the validator turns off (-1 and k >= V).
TRAFFIC = [
    (3, {"temperature": 0.0}),
    (5, {"top_k": [5, 0, 0, 0, 0], "top_p": [1.0, 0.9, 1.0, 1.0, 1.0], "min_p": [0.0, 0.0, 0.1, 0.0, 0.0]}),
    (4, {"temperature": [0.0, 0.5, 0.5, 0.5], "top_k": [10, 10, -1, V]}),
    (1, {}),
    (2, {"top_k": 3, "top_p": 0.5, "min_p": 0.2}),
]
ROWS_BY_MODE = {"greedy": 3 + 1, "top_k": 1 + 1 + 2, "top_p": 1, "min_p": 1, "gumbel": 2 + 2 + 1, "fused": 0}
INVALID = [{"top_p": 0.0}, {"temperature": -1.0}]


def test_traffic_is_counted_exactly(metered_server: RunningServer) -> None:
    with SamplerClient(metered_server.target, timeout=30) as client:
        for rows, params in TRAFFIC:
            client.sample(torch.randn(rows, V), **params)
        for params in INVALID:
            with pytest.raises(TokenSamplerError):
                client.sample(torch.randn(2, V), **params)
        client.server_info()
        assert client.health() == "SERVING"
    samples = parse_samples(scrape_text(metrics_port(metered_server)))
    ok, invalid = len(TRAFFIC), len(INVALID)

    assert value(samples, "tokensampler_requests_total", method=SAMPLE, code="OK") == ok
    assert value(samples, "tokensampler_requests_total", method=SAMPLE, code="INVALID_ARGUMENT") == invalid
    assert value(samples, "tokensampler_requests_total", method="tokensampler.v1.Sampler/GetServerInfo", code="OK") == 1
    assert value(samples, "tokensampler_requests_total", method="grpc.health.v1.Health/Check", code="OK") == 1
    for mode, rows in ROWS_BY_MODE.items():
        assert value(samples, "tokensampler_rows_total", mode=mode) == rows, mode

    batch_sizes = [rows for rows, _ in TRAFFIC]
    assert value(samples, "tokensampler_batch_rows_count") == ok
    assert value(samples, "tokensampler_batch_rows_sum") == sum(batch_sizes)
    for le in (1, 2, 4, 8):
        assert value(samples, "tokensampler_batch_rows_bucket", le=f"{le:.1f}") == sum(r <= le for r in batch_sizes)

    # Every call is timed; the stages only for the batches that were sampled.
    assert value(samples, "tokensampler_request_duration_seconds_count", method=SAMPLE) == ok + invalid
    assert value(samples, "tokensampler_request_duration_seconds_bucket", method=SAMPLE, le="+Inf") == ok + invalid
    assert value(samples, "tokensampler_request_duration_seconds_sum", method=SAMPLE) > 0
    for name in ("tokensampler_queue_duration_seconds", "tokensampler_compute_duration_seconds"):
        assert value(samples, f"{name}_count") == ok, name
    assert value(samples, "tokensampler_compute_duration_seconds_sum") > 0
    for direction in ("deserialize", "serialize"):
        assert value(samples, "tokensampler_serialization_duration_seconds_count", direction=direction) == ok
        assert value(samples, "tokensampler_serialization_duration_seconds_sum", direction=direction) > 0

    assert value(samples, "tokensampler_in_flight_requests") == 0
    assert value(samples, "tokensampler_queue_depth") == 0
    assert value(samples, "tokensampler_registered_weights") == 0
    build = value(samples, "tokensampler_build_info", version=__version__, backend="cpu", gpu="none",
                  torch=torch.__version__, cuda=torch.version.cuda or "none")
    assert build == 1


def test_the_server_exports_every_declared_family(metered_server: RunningServer) -> None:
    families = {family.name for family in text_string_to_metric_families(scrape_text(metrics_port(metered_server)))}
    assert {
        "tokensampler_requests", "tokensampler_request_duration_seconds", "tokensampler_queue_duration_seconds",
        "tokensampler_compute_duration_seconds", "tokensampler_serialization_duration_seconds",
        "tokensampler_batch_rows", "tokensampler_rows", "tokensampler_in_flight_requests", "tokensampler_queue_depth",
        "tokensampler_fallbacks", "tokensampler_registered_weights", "tokensampler_registered_weights_bytes",
        "tokensampler_registered_regions", "tokensampler_registered_regions_bytes",
        "tokensampler_gpu_memory_allocated_bytes", "tokensampler_gpu_memory_reserved_bytes", "tokensampler_build_info",
    } <= families


def test_metrics_flags() -> None:
    assert parse_args([]).metrics_port == 9400
    assert parse_args(["--metrics-port", "0"]).metrics_port == 0
    assert parse_args(["--no-metrics"]).metrics_port is None
    with pytest.raises(SystemExit):
        parse_args(["--metrics-port", "70000"])


def test_fallbacks_are_counted_in_every_server() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    labels = {"reason": "test_reason"}
    before = first.registry.get_sample_value("tokensampler_fallbacks_total", labels) or 0
    record_fallback("test_reason")
    for metrics in (first, second):
        assert metrics.registry.get_sample_value("tokensampler_fallbacks_total", labels) == before + 1


class GatedBackend(Backend):
    """The CPU reference, but each batch waits for `gate`; a batch with V > 100 raises a bug-like error."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()

    def info(self) -> BackendInfo:
        return BackendInfo(name="cpu", device="cpu")

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        self.entered.set()
        self.gate.wait(30)
        if batch.vocab_size > 100:
            raise RuntimeError("simulated bug")
        return CpuBackend().sample(batch)


def _request(vocab_size: int = 8) -> pb.SampleRequest:
    request = pb.SampleRequest()
    encode_tensor(torch.randn(2, vocab_size), out=request.logits)
    return request


async def _until(condition, timeout: float = 30.0) -> None:
    """Waits for `condition()`, which the server reaches on its own schedule."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_queue_depth_in_flight_cancellation_and_internal_errors() -> None:
    backend = GatedBackend()
    metrics = ServerMetrics(backend.info())
    gauge = metrics.registry.get_sample_value

    async def run() -> None:
        server = grpc.aio.server()
        service = SamplerService(backend, Limits())
        metrics.queue_depth.set_function(lambda: service.queue_depth)
        pb_grpc.add_SamplerServicer_to_server(service, CallGuard(metrics).registration(server))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.SamplerStub(channel)
                first = stub.Sample(_request())
                await asyncio.get_running_loop().run_in_executor(None, backend.entered.wait, 30)
                queued = [stub.Sample(_request()), stub.Sample(_request(vocab_size=101))]
                await _until(lambda: gauge("tokensampler_queue_depth") == 2)
                assert gauge("tokensampler_in_flight_requests") == 3
                cancelled = stub.Sample(_request())  # a third queued call, which the client gives up on
                await _until(lambda: gauge("tokensampler_queue_depth") == 3)
                cancelled.cancel()
                await _until(lambda: gauge("tokensampler_queue_depth") == 2)
                backend.gate.set()
                await first
                await queued[0]
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await queued[1]
                assert raised.value.code() == grpc.StatusCode.INTERNAL
        finally:
            await server.stop(None)
            await service.close()

    asyncio.run(run())
    assert gauge("tokensampler_queue_depth") == 0 and gauge("tokensampler_in_flight_requests") == 0
    assert gauge("tokensampler_requests_total", {"method": SAMPLE, "code": "OK"}) == 2
    assert gauge("tokensampler_requests_total", {"method": SAMPLE, "code": "INTERNAL"}) == 1
    assert gauge("tokensampler_requests_total", {"method": SAMPLE, "code": "CANCELLED"}) == 1
    assert gauge("tokensampler_rows_total", {"mode": "gumbel"}) == 4


def test_metrics_http_serves_the_registry_and_survives_a_busy_port(caplog) -> None:
    metrics = ServerMetrics()
    metrics.requests.labels("m", "OK").inc(3)
    httpd = start_metrics_http(metrics, "127.0.0.1", 0)
    assert httpd is not None
    try:
        port = httpd.server_address[1]
        assert value(parse_samples(scrape_text(port)), "tokensampler_requests_total", method="m", code="OK") == 3
        assert start_metrics_http(ServerMetrics(), "127.0.0.1", port) is None  # taken: metrics off, no crash
        assert any("metrics disabled" in record.getMessage() for record in caplog.records)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_client_streaming_calls_are_guarded_and_counted() -> None:
    """Uploads (client-streaming, like RegisterWeights) get the same statuses, request ids and counts."""
    metrics = ServerMetrics()

    async def upload(requests, context) -> bytes:
        chunks = [chunk async for chunk in requests]
        if len(chunks) > 2:
            raise InvalidArgument("data", f"got {len(chunks)} chunks, expected at most 2")
        return b"".join(chunks)

    handler = grpc.stream_unary_rpc_method_handler(upload)  # raw bytes in and out

    async def run() -> tuple[bytes, grpc.aio.AioRpcError]:
        server = grpc.aio.server()
        CallGuard(metrics).registration(server).add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Upload", {"Put": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                put = channel.stream_unary("/test.Upload/Put")
                ok = await put(iter([b"a", b"b"]))
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await put(iter([b"a", b"b", b"c"]), metadata=(("x-request-id", "upload-1"),))
        finally:
            await server.stop(None)
        return ok, raised.value

    ok, failure = asyncio.run(run())
    assert ok == b"ab"
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.details() == "data: got 3 chunks, expected at most 2 (request id upload-1)"
    count = metrics.registry.get_sample_value
    assert count("tokensampler_requests_total", {"method": "test.Upload/Put", "code": "OK"}) == 1
    assert count("tokensampler_requests_total", {"method": "test.Upload/Put", "code": "INVALID_ARGUMENT"}) == 1


def test_calls_observed_later_are_recorded_before_a_scrape_reads_them() -> None:
    """The native path's stream messages are recorded at the next scrape, rows by mode included; without
    scrapes the backlog stays bounded."""
    from tokensampler_server.rpc.call_record import CallRecord
    from tokensampler_server.rpc.metrics import _MAX_LATER

    metrics = ServerMetrics()
    method = "tokensampler.v1.Sampler/SampleStream"
    call = CallRecord(method=method, request_id="s.0", row_modes=(1, 2, 0, 0, 3))
    metrics.observe_call_later(call, grpc.StatusCode.OK, 2_000_000)
    count = metrics.registry.get_sample_value
    assert count("tokensampler_requests_total", {"method": method, "code": "OK"}) == 1
    assert count("tokensampler_rows_total", {"mode": "min_p"}) == 3
    assert count("tokensampler_rows_total", {"mode": "gumbel"}) == 2
    assert count("tokensampler_request_duration_seconds_sum", {"method": method}) == pytest.approx(0.002)
    for _ in range(_MAX_LATER + 100):
        metrics.observe_call_later(call, grpc.StatusCode.OK, 1000)
    assert len(metrics._later) <= _MAX_LATER  # noqa: SLF001 - the bound is the point
    assert count("tokensampler_requests_total", {"method": method, "code": "OK"}) == _MAX_LATER + 101
