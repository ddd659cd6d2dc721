"""gRPC health Watch: every watcher of a service hears of every change, and at shutdown each is told NOT_SERVING and
ended, so no Watch holds the shutdown for its grace period."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokensampler_server.app.server import SERVICE_NAME

from .conftest import start_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_watcher_that_leaves_does_not_blind_the_others_and_shutdown_ends_every_watch() -> None:
    """Watchers A and B of the server (""), C of the Sampler; A reads SERVING and leaves. At SIGTERM, B and C are
    told NOT_SERVING at once, then their streams end UNAVAILABLE, and the server, holding nothing else, exits long
    before its 60 s grace period (before: B heard nothing until the grace period cancelled it, and every open
    Watch held the shutdown that long)."""
    running = start_server("--device", "cpu", "--grace-period-s", "60")
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            a, b = (stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30) for _ in range(2))
            c = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30)
            assert next(a).status == SERVING and next(b).status == SERVING and next(c).status == SERVING
            a.cancel()
            time.sleep(0.2)  # the server has seen A go
            signalled = time.monotonic()
            running.process.send_signal(signal.SIGTERM)
            for watch in (b, c):
                assert next(watch).status == NOT_SERVING
                with pytest.raises(grpc.RpcError) as ended:
                    next(watch)
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down" in ended.value.details()
            assert time.monotonic() - signalled < 10
        assert running.process.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 30
    finally:
        running.stop()
