"""How many attempts an overloaded server gets from the client library: counted by the server itself.

A gated server (gated_server.py) holds one batch in its backend and a second fills its queue of --max-queue-rows,
so every further Sample is refused RESOURCE_EXHAUSTED marked `x-retryable: overload` until the test lets them go.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import torch
from tokensampler_client import (
    AsyncBatchingClient,
    AsyncSamplerClient,
    Backoff,
    BatchingClient,
    RetryThrottle,
    SamplerClient,
    TokenSamplerError,
)
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._retry import RetryState
from tokensampler_client.result import SampleResult

from .conftest import RunningServer, serving
from .gated_server import GATE_SEED, ServerGate
from .polling import wait_until
from .test_metrics import metrics_port, parse_samples, scrape_text, value

QUEUE_ROWS = 64
CALLERS = 8
RETRIES = 3
FAST = Backoff(initial=0.001, maximum=0.002)
SAMPLE = "tokensampler.v1.Sampler/Sample"


@pytest.fixture(scope="module")
def gated_server() -> Iterator[RunningServer]:
    yield from serving("--device", "cpu", "--max-queue-rows", str(QUEUE_ROWS), gate=ServerGate())


def _scrape(server: RunningServer, name: str, **labels: str) -> int:
    return int(value(parse_samples(scrape_text(metrics_port(server))), name, **labels) or 0)


def refusals(server: RunningServer) -> int:
    """The Sample calls the server has refused RESOURCE_EXHAUSTED: one per attempt, retries included."""
    return _scrape(server, "tokensampler_requests_total", method=SAMPLE, code="RESOURCE_EXHAUSTED")


@contextmanager
def overloaded(server: RunningServer) -> Iterator[None]:
    """For the block, a batch held in the backend and a full queue behind it: every Sample is refused as overload
    (the merge of CALLERS rows too, which fits the queue's whole bound). Both are answered after the block."""
    assert server.gate is not None
    with SamplerClient(server.target, timeout=60, retries=0) as client, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(client.sample, torch.randn(1, 64), seed=GATE_SEED)
        server.gate.wait_held()
        queued = pool.submit(client.sample, torch.randn(QUEUE_ROWS, 64), seed=1)
        try:
            wait_until(lambda: _scrape(server, "tokensampler_queue_depth") == 1, "the queue full")
            yield
        finally:
            server.gate.release()
        assert held.result(60).valid.all() and queued.result(60).valid.all()


def outcome(result: BaseException | SampleResult) -> str:
    return result.code.name if isinstance(result, TokenSamplerError) else type(result).__name__


def merged_callers_sync(target: str) -> list[BaseException | SampleResult]:
    """CALLERS one-row calls through one BatchingClient, which closes their batch at CALLERS rows: one merged call."""
    def one(index: int) -> BaseException | SampleResult:
        try:
            return batcher.sample(torch.randn(1, 64), seed=index)
        except TokenSamplerError as err:
            return err

    with (SamplerClient(target, timeout=60, retries=RETRIES, backoff=FAST) as client,
          BatchingClient(client, max_rows=CALLERS, max_delay_us=30_000_000) as batcher,
          concurrent.futures.ThreadPoolExecutor(CALLERS) as pool):
        return list(pool.map(one, range(CALLERS)))


def merged_callers_async(target: str) -> list[BaseException | SampleResult]:
    async def run() -> list[BaseException | SampleResult]:
        async with AsyncSamplerClient(target, timeout=60, retries=RETRIES, backoff=FAST) as client:
            async with AsyncBatchingClient(client, max_rows=CALLERS, max_delay_us=30_000_000) as batcher:
                calls = (batcher.sample(torch.randn(1, 64), seed=index) for index in range(CALLERS))
                return await asyncio.gather(*calls, return_exceptions=True)

    return asyncio.run(run())


@pytest.mark.parametrize("callers", [merged_callers_sync, merged_callers_async], ids=["sync", "async"])
def test_a_merged_call_refused_as_overload_makes_the_attempts_of_one_call(gated_server: RunningServer,
                                                                           callers) -> None:
    """8 callers merged into one call against a full queue: the merge is tried 1 + 3 times, as one caller alone is,
    and its overload reaches every caller (before: the merge's 4 attempts, then each call alone with 4 of its own,
    36 in all)."""
    with overloaded(gated_server):
        before = refusals(gated_server)
        results = callers(gated_server.target)
        attempts = refusals(gated_server) - before
    assert [outcome(r) for r in results] == ["RESOURCE_EXHAUSTED"] * CALLERS
    assert all(isinstance(r, TokenSamplerError) and r.overload for r in results)
    assert attempts == 1 + RETRIES


def test_a_client_retry_throttle_stops_the_retries_of_every_call(gated_server: RunningServer) -> None:
    """A RetryThrottle of 4 tokens: the first call is retried once (4 -> 3 tokens, then 2: no retry), the 7 after it
    not at all; 9 attempts where the same calls without it make 32. Once the server answers again, the answers give
    the tokens back."""
    throttle = RetryThrottle(max_tokens=4, token_ratio=1)
    with SamplerClient(gated_server.target, timeout=60, retries=RETRIES, backoff=FAST,
                       retry_throttle=throttle) as client:
        with overloaded(gated_server):
            before = refusals(gated_server)
            for index in range(CALLERS):
                with pytest.raises(TokenSamplerError) as info:
                    client.sample(torch.randn(1, 64), seed=index)
                assert info.value.overload
            attempts = refusals(gated_server) - before
        assert throttle.tokens == 0
        for index in range(4):
            client.sample(torch.randn(1, 64), seed=index)
    assert attempts == 2 + (CALLERS - 1)
    assert throttle.tokens == 4


def test_the_throttle_counts_as_grpc_retry_throttling_does() -> None:
    """gRPC's own case (4 tokens, 1.6 a success): retries go while more than half the tokens are left."""
    throttle = RetryThrottle(max_tokens=4, token_ratio=1.6)
    assert throttle.failed()  # 3
    throttle.answered()  # 4, not beyond
    assert throttle.failed()  # 3
    assert not throttle.failed()  # 2: at the threshold
    throttle.answered()  # 3.6
    assert throttle.failed()  # 2.6
    assert not throttle.failed()  # 1.6
    for _ in range(3):
        assert not throttle.failed()  # down to 0, not below
    assert throttle.tokens == 0
    with pytest.raises(ValueError, match="max_tokens"):
        RetryThrottle(max_tokens=0)
    with pytest.raises(ValueError, match="token_ratio"):
        RetryThrottle(token_ratio=float("nan"))


def test_only_retryable_failures_take_tokens_and_spent_retries_still_do() -> None:
    throttle = RetryThrottle(max_tokens=10, token_ratio=0.5)
    state = RetryState(retries=1, backoff=FAST, timeout=None, throttle=throttle)
    assert state.next_delay(grpc.StatusCode.INVALID_ARGUMENT) is None
    assert state.next_delay(grpc.StatusCode.RESOURCE_EXHAUSTED) is None  # larger than a bound: final, no token
    assert throttle.tokens == 10
    assert state.next_delay(grpc.StatusCode.UNAVAILABLE) is not None
    assert state.next_delay(grpc.StatusCode.RESOURCE_EXHAUSTED, (("x-retryable", "overload"),)) is None  # spent
    assert throttle.tokens == 8
    state.answered()
    assert throttle.tokens == 8.5 and state.retries_done == 0


class _SlowInvalidMerge:
    """Stands for a SamplerClient with a 2 s deadline whose server takes 0.5 s to refuse a merged call
    INVALID_ARGUMENT and answers each call alone at once; records the timeout of each call."""

    max_message_bytes = 256 << 20
    timeout = 2.0

    def __init__(self) -> None:
        self.timeouts: list[tuple[int, float | None]] = []

    def sample_request(self, request: pb.SampleRequest, timeout: float | None = None) -> SampleResult:
        rows = request.logits.shape[0]
        self.timeouts.append((rows, timeout))
        if rows > 1:
            time.sleep(0.5)
            raise TokenSamplerError(grpc.StatusCode.INVALID_ARGUMENT, "params.top_p: a bad row")
        return SampleResult.from_response(pb.SampleResponse(
            tokens=pb.Tensor(dtype=pb.DTYPE_INT32, shape=[1, 1], data=b"\0" * 4), seeds=[1], valid=[True]))


def test_calls_sent_again_alone_keep_what_is_left_of_the_batchs_deadline() -> None:
    """The merged call took 0.5 s of the client's 2 s: each call sent again alone gets the 1.5 s left (before: a
    deadline of its own, so a caller could wait its deadline once for the merge and again alone)."""
    fake = _SlowInvalidMerge()
    with (BatchingClient(fake, max_rows=4, max_delay_us=30_000_000) as batcher,  # type: ignore[arg-type]
          concurrent.futures.ThreadPoolExecutor(4) as pool):
        results = list(pool.map(lambda index: batcher.sample(torch.randn(1, 8), seed=index), range(4)))
    assert all(result.valid.all() for result in results)
    (merged_rows, merged_timeout), *alone = fake.timeouts
    assert merged_rows == 4 and merged_timeout is not None and 1.9 < merged_timeout <= 2.0
    assert [rows for rows, _ in alone] == [1] * 4
    assert all(timeout is not None and timeout <= 1.5 for _, timeout in alone)


def test_a_merge_the_server_ran_out_of_memory_for_is_retried_then_sent_call_by_call() -> None:
    """`x-retryable: memory` (the server ran out of memory for the batch) is retried as an overload is, but is not an
    overload: a merge refused so is sent again call by call, as fewer rows may fit (an overload is not: it would
    make the overloaded server more calls)."""
    from tokensampler_client._retry import is_retryable, retry_mark
    from tokensampler_client.batching import _resent_alone

    memory, overload = (("x-retryable", "memory"),), (("x-retryable", "overload"),)
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert is_retryable(exhausted, memory) and is_retryable(exhausted, overload) and not is_retryable(exhausted)
    assert retry_mark(exhausted, memory) == "memory" and retry_mark(exhausted, overload) == "overload"
    batch = [object(), object()]
    assert _resent_alone(batch, TokenSamplerError(exhausted, "out of memory", overload=False))
    assert not _resent_alone(batch, TokenSamplerError(exhausted, "queue full", overload=True))
