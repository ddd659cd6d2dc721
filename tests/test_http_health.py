"""HTTP health on the metrics port: /healthz, /readyz mirroring gRPC health (503 from SIGTERM on), 404 elsewhere."""

from __future__ import annotations

import asyncio
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc
from tokensampler_server.rpc.health import HealthService
from tokensampler_server.rpc.metrics import ServerMetrics, start_metrics_http
from tokensampler_server.app.server import SERVICE_NAME, sampler_serving

from .conftest import start_server
from .test_metrics import metrics_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET `path` on the metrics port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_each_path_answers_its_status_and_body() -> None:
    ready = threading.Event()
    httpd = start_metrics_http(ServerMetrics(), "127.0.0.1", 0, ready=ready.is_set)
    assert httpd is not None
    try:
        port = httpd.server_address[1]
        assert get(port, "/healthz") == (200, "ok\n")
        assert get(port, "/readyz") == (503, "not ready\n")
        ready.set()
        assert get(port, "/readyz") == (200, "ready\n")
        status, body = get(port, "/metrics")
        assert status == 200 and "# TYPE tokensampler_in_flight_requests gauge" in body
        for path in ("/", "/metrics/", "/metricsx", "/healthz/x", "/readyz/", "/favicon.ico", "/../metrics"):
            status, body = get(port, path)
            assert (status, body) == (404, "not found: this port serves /metrics, /healthz and /readyz\n"), path
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_readiness_is_what_grpc_health_says_of_the_sampler() -> None:
    async def run() -> list[bool]:
        servicer = HealthService()
        seen = [sampler_serving(servicer)]  # before the server sets it: the Sampler is unknown
        await servicer.set("", SERVING)
        seen.append(sampler_serving(servicer))  # the server as a whole is not the Sampler
        await servicer.set(SERVICE_NAME, SERVING)
        seen.append(sampler_serving(servicer))
        await servicer.enter_graceful_shutdown()
        seen.append(sampler_serving(servicer))
        return seen

    assert asyncio.run(run()) == [False, False, True, False]


def test_readyz_turns_503_at_sigterm_while_a_call_holds_the_server() -> None:
    """An upload in progress is a call in flight: the server stays up through its grace period until the upload
    ends, so /readyz is read after a health Watch has seen NOT_SERVING (and ended) and before the process exits."""
    running = start_server("--device", "cpu", "--grace-period-s", "60")
    try:
        port = metrics_port(running)
        assert get(port, "/readyz") == (200, "ready\n")
        assert get(port, "/healthz") == (200, "ok\n")
        with grpc.insecure_channel(running.target) as channel:
            hold = threading.Event()

            def header_then_wait() -> Iterator[pb.RegisterWeightsChunk]:
                yield pb.RegisterWeightsChunk(name="held", dtype=pb.DTYPE_FLOAT32, shape=[4, 2])
                hold.wait(30)

            upload = sampler_pb2_grpc.SamplerStub(channel).RegisterWeights.future(header_then_wait(), timeout=30)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                                timeout=30)
            assert next(watch).status == SERVING
            running.process.send_signal(signal.SIGTERM)
            assert next(watch).status == NOT_SERVING
            with pytest.raises(grpc.RpcError) as ended:
                next(watch)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert running.process.poll() is None  # held by the upload, in its grace period
            assert get(port, "/readyz") == (503, "not ready\n")
            assert get(port, "/healthz") == (200, "ok\n")
            assert get(port, "/metrics")[0] == 200  # Prometheus can scrape the drain
            upload.cancel()
            hold.set()
        assert running.process.wait(timeout=60) == 0
    finally:
        running.stop()


@contextmanager
def _metrics_port(monkeypatch, **handler: float) -> Iterator[int]:
    """The port of a metrics server of its own, its handler's timeouts (seconds) set as given; shut down after."""
    from tokensampler_server.rpc import metrics

    for name, seconds in handler.items():
        monkeypatch.setattr(metrics._QuietHandler, name, seconds)
    httpd = start_metrics_http(ServerMetrics(), "127.0.0.1", 0)
    assert httpd is not None
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_slow_http_clients_are_bounded_and_timed_out(monkeypatch) -> None:
    """Connections that send a partial request and stall: at most MAX_HTTP_CONNECTIONS are served at once (more
    are closed at once), each is closed once its request has not arrived within HTTP_TIMEOUT_S, and then
    /healthz answers again. Before, each held a thread and a descriptor for good."""
    import socket
    import time

    from tokensampler_server.rpc import metrics

    slow = []
    with _metrics_port(monkeypatch, timeout=0.5) as port:
        threads = threading.active_count()
        for _ in range(metrics.MAX_HTTP_CONNECTIONS + 20):
            connection = socket.create_connection(("127.0.0.1", port), timeout=5)
            connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            slow.append(connection)
        time.sleep(0.2)
        assert threading.active_count() - threads <= metrics.MAX_HTTP_CONNECTIONS
        time.sleep(1.0)  # past the timeout: every slow connection closed by the server
        assert threading.active_count() - threads <= 1
        assert get(port, "/healthz") == (200, "ok\n")
    for connection in slow:
        connection.close()


def test_clients_trickling_their_request_are_cut_at_the_deadline(monkeypatch) -> None:
    """A client that sends a byte of its request at a time, each within the read timeout, is cut once the request
    has not arrived within the deadline: MAX_HTTP_CONNECTIONS of them free their slots, and /healthz answers."""
    import socket
    import time

    from tokensampler_server.rpc import metrics

    with _metrics_port(monkeypatch, timeout=0.5, request_deadline_s=1.0) as port:
        trickling = [socket.create_connection(("127.0.0.1", port), timeout=5)
                     for _ in range(metrics.MAX_HTTP_CONNECTIONS)]
        cut: set[int] = set()
        for connection in trickling:
            connection.sendall(b"GET /metrics HTTP/1.1\r\n")
        started = time.monotonic()
        while time.monotonic() - started < 3.0 and len(cut) < len(trickling):
            for index, connection in enumerate(trickling):
                if index not in cut:
                    try:
                        connection.sendall(b"X")  # one header byte, well within the read timeout
                    except OSError:
                        cut.add(index)
            time.sleep(0.2)
        assert len(cut) == len(trickling), f"{len(trickling) - len(cut)} trickling connections still open after 3 s"
        assert get(port, "/healthz") == (200, "ok\n")
    for connection in trickling:
        connection.close()
