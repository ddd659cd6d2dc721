"""The service side of vocabulary-parallel sampling that runs without GPUs: the --vocab-parallel-devices flag's
checks, a failed exchange answered UNAVAILABLE, and gRPC health following the backend's devices (NOT_SERVING while
they cannot exchange, SERVING once they recover). The GPU side: tests/gpu/test_vocab_parallel_fused.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2
from tokensampler_server.app.cli import parse_args
from tokensampler_server.app.server import SERVICE_NAME, follow_backend_health
from tokensampler_server.backends.base import Backend, BackendInfo
from tokensampler_server.backends.nccl import NcclError
from tokensampler_server.batching.batcher import _backend_errors_as_status
from tokensampler_server.core.errors import ServiceError

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_the_flag_takes_two_or_more_devices_starting_with_the_backends() -> None:
    assert parse_args([]).vocab_parallel_devices == ()
    assert parse_args(["--vocab-parallel-devices", "0,1"]).vocab_parallel_devices == (0, 1)
    assert parse_args(["--device", "cuda:2", "--vocab-parallel-devices", "2,3,0,1"]).vocab_parallel_devices == \
        (2, 3, 0, 1)


@pytest.mark.parametrize("argv,message", [
    (["--vocab-parallel-devices", "0"], "two or more distinct device indices"),
    (["--vocab-parallel-devices", "0,0"], "two or more distinct device indices"),
    (["--vocab-parallel-devices", "0,-1"], "two or more distinct device indices"),
    (["--vocab-parallel-devices", "zero,one"], "comma-separated CUDA device indices"),
    (["--vocab-parallel-devices", "1,0"], "expected --device cuda:1"),
    (["--device", "cpu", "--vocab-parallel-devices", "0,1"], "expected --device cuda:0"),
    (["--device", "cuda:1", "--vocab-parallel-devices", "0,1"], "expected --device cuda:0"),
])
def test_the_flag_refuses_what_cannot_be_split(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_failed_exchange_is_unavailable() -> None:
    def exchange() -> None:
        raise NcclError("collective over devices [0, 1] not done after 10 s: a GPU stalled or never joined")

    with pytest.raises(ServiceError) as raised:
        _backend_errors_as_status(exchange)
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert "a GPU stalled" in raised.value.message and "another replica" in raised.value.message


class _Devices(Backend):
    """A backend whose devices fail and recover on cue: serving() answers the next of `states` (None: raises), then
    the last."""

    def __init__(self, states: list[bool | None]) -> None:
        self.states = states
        self.asked = 0

    def info(self) -> BackendInfo:
        return BackendInfo(name="cuda", device="cuda:0 (two GPUs)")

    def sample(self, batch):  # noqa: ANN001 - never called here
        raise AssertionError("not sampled")

    def serving(self) -> bool:
        self.asked += 1
        state = self.states[min(self.asked - 1, len(self.states) - 1)]
        if state is None:
            raise RuntimeError("CUDA error: out of memory")
        return state


class _Health:
    def __init__(self) -> None:
        self.history: list[tuple[str, int]] = []

    async def set(self, service: str, status: int) -> None:
        self.history.append((service, status))


def _followed(states: list[bool | None]) -> list[tuple[str, int]]:
    """The health statuses set while a follower asks a backend answering `states` six times (it must still be
    following then)."""
    backend, health = _Devices(states), _Health()

    async def run() -> None:
        follower = asyncio.create_task(follow_backend_health(backend, health, period_s=0.01))
        while backend.asked < 6:
            await asyncio.sleep(0.01)
        assert not follower.done()
        follower.cancel()

    asyncio.run(run())
    return health.history


def test_health_follows_the_devices_down_and_back() -> None:
    # Set only on changes, for the server as a whole and for the Sampler.
    assert _followed([True, False, False, True]) == [("", NOT_SERVING), (SERVICE_NAME, NOT_SERVING), ("", SERVING),
                                                     (SERVICE_NAME, SERVING)]


def test_health_survives_a_device_that_cannot_be_asked() -> None:
    """serving() raising (a rebuild that ran out of memory) counts as not serving, and the follower goes on."""
    assert _followed([True, None, None, True]) == [("", NOT_SERVING), (SERVICE_NAME, NOT_SERVING), ("", SERVING),
                                                   (SERVICE_NAME, SERVING)]
