"""Client-side batching against a real server: every caller gets exactly its own rows."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from tokensampler_client import AsyncBatchingClient, AsyncSamplerClient, BatchingClient, SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.merge import merge_requests
from tokensampler_client.params import build_sample_request
from tokensampler_client.regions import RegionView
from tokensampler_client.result import SampleResult

from .conftest import RunningServer, serving, start_server
from .polling import wait_until, wait_until_async

VOCAB = 256
CALLS_PER_THREAD = 200


def random_call(rng: random.Random) -> tuple[torch.Tensor, dict[str, Any]]:
    """Logits and parameters of one caller: 1 to 4 rows, parameters shared, per row or absent."""
    rows = rng.randint(1, 4)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    params: dict[str, Any] = {"seed": [rng.randrange(2**64) for _ in range(rows)]}
    if rng.random() < 0.5:
        params["top_k"] = rng.choice([0, 5, 40])
    if rng.random() < 0.5:
        params["temperature"] = [rng.choice([0.0, 0.7, 1.3]) for _ in range(rows)]
    if rng.random() < 0.3:
        params["top_p"] = 0.8
    if rng.random() < 0.3:
        params["banned_token_ids"] = [rng.randrange(VOCAB) for _ in range(3)]
    if rng.random() < 0.3:
        params["logit_bias"] = [{rng.randrange(VOCAB): 2.0} for _ in range(rows)]
    if rng.random() < 0.3:
        params["output_token_ids"] = [[rng.randrange(VOCAB)] * rng.randint(0, 3) for _ in range(rows)]
        params["repetition_penalty"] = 1.2
    if rng.random() < 0.2:
        params["seed"][0] = None  # the server draws this row's seed
    return logits, params


def test_merged_request_carries_every_row(server: RunningServer) -> None:
    rng = random.Random(0)
    calls = [random_call(rng) for _ in range(6)]
    for _, params in calls:
        params["seed"] = [s if s is not None else 1 for s in params["seed"]]
    requests = [build_sample_request(logits, **params) for logits, params in calls]
    with SamplerClient(server.target, timeout=60) as client:
        merged = client.sample_request(merge_requests(requests))
        start = 0
        for request in requests:
            alone = client.sample_request(request)
            rows = alone.tokens.shape[0]
            assert torch.equal(merged.tokens[start : start + rows], alone.tokens)
            assert merged.seeds[start : start + rows] == alone.seeds
            start += rows


@pytest.fixture(scope="module")
def merging_server() -> Iterator[RunningServer]:
    """A CPU server whose dynamic batcher waits for more requests, so that both batchers merge calls."""
    yield from serving("--device", "cpu", "--max-queue-delay-us", "300")


def test_sixteen_threads_of_two_hundred_calls_each_get_their_own_rows(merging_server: RunningServer) -> None:
    """Exact under concurrency, by batch invariance: 16 threads x 200 calls with per-row seeds, merged by the
    client's batcher and the server's, each result equal to the same call made alone."""
    server = merging_server
    rng = random.Random(1)
    calls = [[random_call(rng) for _ in range(CALLS_PER_THREAD)] for _ in range(16)]
    for thread_calls in calls:
        for _, params in thread_calls:
            params["seed"] = [s if s is not None else 3 for s in params["seed"]]
    results: dict[tuple[int, int], Any] = {}
    with SamplerClient(server.target, timeout=60) as client, BatchingClient(client, max_rows=64, max_delay_us=2000) as batcher:

        def worker(thread: int) -> None:
            for index, (logits, params) in enumerate(calls[thread]):
                results[thread, index] = batcher.sample(logits, **params)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (thread, index), result in results.items():
            logits, params = calls[thread][index]
            alone = client.sample(logits, **params)
            assert torch.equal(result.tokens, alone.tokens), (thread, index)
            assert result.seeds == alone.seeds
    assert len(results) == 16 * CALLS_PER_THREAD
    # Batching happened: calls in one batch share the server's request id.
    assert len({result.request_id for result in results.values()}) < len(results)


def test_errors_go_only_to_the_callers_whose_rows_were_bad(server: RunningServer) -> None:
    outcomes: dict[int, Any] = {}
    with SamplerClient(server.target, timeout=60) as client, BatchingClient(client, max_delay_us=200_000) as batcher:

        def worker(index: int) -> None:
            try:
                top_p = 0.0 if index == 3 else 0.9  # caller 3 sends an invalid top_p
                outcomes[index] = batcher.sample(torch.randn(2, VOCAB), top_p=top_p, seed=index)
            except TokenSamplerError as err:
                outcomes[index] = err

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert isinstance(outcomes[3], TokenSamplerError) and outcomes[3].code == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.top_p" in outcomes[3].details
    assert all(outcomes[i].tokens.shape == (2, 1) for i in range(8) if i != 3)


def test_merged_requests_stay_within_the_clients_message_limit(server: RunningServer) -> None:
    """Eight calls of 400 KB each fit a 1 MiB channel alone; merged they would not, and every caller would fail.
    Batches are cut at the limit instead."""
    logits = [torch.randn(1, 100_000, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    with (SamplerClient(server.target, timeout=60, max_message_mb=1) as client,
          BatchingClient(client, max_delay_us=200_000) as batcher,
          concurrent.futures.ThreadPoolExecutor(8) as pool):
        results = list(pool.map(lambda i: batcher.sample(logits[i], seed=i), range(8)))
        alone = [client.sample(logits[i], seed=i) for i in range(8)]
    for got, want in zip(results, alone):
        assert torch.equal(got.tokens, want.tokens)
    assert len({result.request_id for result in results}) < 8  # some calls did merge


@pytest.mark.parametrize("flag", ["--max-message-mb", "--max-queue-mb", "--max-queue-rows"])
def test_calls_that_fit_the_server_alone_are_answered_when_their_merge_does_not(flag: str) -> None:
    """Two 600 KB one-row calls under a server's bound of 1 MiB (or 1 row): the merged request is refused
    RESOURCE_EXHAUSTED without the overload mark (past the message limit, or the queue's whole bound), so each is sent
    again alone and answered (before: both callers got the merge's refusal), sync and async."""
    logits = [torch.randn(1, 150_000, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    running = start_server("--device", "cpu", flag, "1")
    try:
        with (SamplerClient(running.target, timeout=60) as client,
              BatchingClient(client, max_delay_us=300_000) as batcher,
              concurrent.futures.ThreadPoolExecutor(2) as pool):
            results = list(pool.map(lambda i: batcher.sample(logits[i], temperature=0), range(2)))

        async def run() -> list[SampleResult]:
            async with AsyncSamplerClient(running.target, timeout=60) as client:
                async with AsyncBatchingClient(client, max_delay_us=300_000) as batcher:
                    return await asyncio.gather(*(batcher.sample(x, temperature=0) for x in logits))

        results += asyncio.run(run())
    finally:
        running.stop()
    assert [int(r.tokens[0, 0]) for r in results] == [int(x.argmax()) for x in logits] * 2


def test_async_batching_client(server: RunningServer) -> None:
    rng = random.Random(2)
    calls = [random_call(rng) for _ in range(40)]
    for _, params in calls:
        params["seed"] = [s if s is not None else 5 for s in params["seed"]]

    async def run() -> tuple[list, list]:
        async with AsyncSamplerClient(server.target, timeout=60) as client:
            async with AsyncBatchingClient(client, max_rows=32, max_delay_us=5000) as batcher:
                batched = await asyncio.gather(*(batcher.sample(logits, **params) for logits, params in calls))
            alone = [await client.sample(logits, **params) for logits, params in calls]
        return batched, alone

    batched, alone = asyncio.run(run())
    for b, a in zip(batched, alone):
        assert torch.equal(b.tokens, a.tokens)
    assert len({result.request_id for result in batched}) < len(batched)


def test_closed_batching_client_refuses_calls(server: RunningServer) -> None:
    with SamplerClient(server.target, timeout=60) as client:
        batcher = BatchingClient(client)
        batcher.close()
        with pytest.raises(RuntimeError, match="closed"):
            batcher.sample(torch.zeros(1, 4))

    async def run() -> None:
        async with AsyncSamplerClient(server.target, timeout=60) as client:
            batcher = AsyncBatchingClient(client)
            await batcher.close()
            with pytest.raises(RuntimeError, match="closed"):
                await batcher.sample(torch.zeros(1, 4))

    asyncio.run(run())


class _RowEchoClient:
    """Stands for a SamplerClient whose server lists `features`: records each request and answers every row with
    the index of the buffer row it names (its byte offset / the row's bytes)."""

    def __init__(self, features: list[str]) -> None:
        self.features, self.sent = features, []

    max_message_bytes = 256 << 20
    timeout = None

    def server_info(self) -> pb.ServerInfo:
        return pb.ServerInfo(features=self.features)

    def sample_request(self, request: pb.SampleRequest, timeout: float | None = None) -> SampleResult:
        self.sent.append(request)
        if request.WhichOneof("input") == "logits_rows":
            starts = list(request.logits_rows.row_offsets)
        else:
            ref = request.logits_ref
            starts = [ref.offset + i * VOCAB * 4 for i in range(ref.shape[0])]
        tokens = torch.tensor([[start // (VOCAB * 4)] for start in starts], dtype=torch.int32)
        return SampleResult.from_response(pb.SampleResponse(tokens=pb.Tensor(
            dtype=pb.DTYPE_INT32, shape=list(tokens.shape), data=tokens.numpy().tobytes())))


@pytest.mark.parametrize("features, expected_calls", [(["regions", "region_rows"], 1), (["regions"], 4)])
def test_region_slices_with_gaps_merge_only_where_the_server_takes_logits_rows(features: list[str],
                                                                               expected_calls: int) -> None:
    """Four callers' 2-row slices of one region, a row apart: one logits_rows call where the server lists
    "region_rows", else four calls (an older server would not read logits_rows); each caller gets its rows."""
    fake = _RowEchoClient(features)
    views = [RegionView("buffer", 3 * k * VOCAB * 4, torch.float32, (2, VOCAB)) for k in range(4)]
    with (BatchingClient(fake, max_rows=8, max_delay_us=2_000_000) as batcher,
          concurrent.futures.ThreadPoolExecutor(4) as pool):
        results = list(pool.map(lambda view: batcher.sample(view, seed=1), views))
    for k, result in enumerate(results):
        assert result.tokens[:, 0].tolist() == [3 * k, 3 * k + 1]
    assert len(fake.sent) == expected_calls
    assert {r.WhichOneof("input") for r in fake.sent} == {"logits_rows" if expected_calls == 1 else "logits_ref"}


class _AsyncRowEchoClient(_RowEchoClient):
    async def server_info(self) -> pb.ServerInfo:  # type: ignore[override]
        return super().server_info()

    async def sample_request(  # type: ignore[override]
        self, request: pb.SampleRequest, timeout: float | None = None
    ) -> SampleResult:
        return super().sample_request(request)


@pytest.mark.parametrize("features, expected_calls", [(["regions", "region_rows"], 1), (["regions"], 4)])
def test_async_region_slices_with_gaps_merge_only_where_the_server_takes_logits_rows(features: list[str],
                                                                                     expected_calls: int) -> None:
    fake = _AsyncRowEchoClient(features)
    views = [RegionView("buffer", 3 * k * VOCAB * 4, torch.float32, (2, VOCAB)) for k in range(4)]

    async def run() -> list[SampleResult]:
        async with AsyncBatchingClient(fake, max_rows=8, max_delay_us=2_000_000) as batcher:
            return await asyncio.gather(*(batcher.sample(view, seed=1) for view in views))

    for k, result in enumerate(asyncio.run(run())):
        assert result.tokens[:, 0].tolist() == [3 * k, 3 * k + 1]
    assert len(fake.sent) == expected_calls


def test_calls_gather_while_every_slot_is_busy() -> None:
    """max_in_flight = 1: the first call goes out alone; four calls arriving while it is in flight wait for the
    slot and then go out as one batch (with no delay of their own)."""
    started, release = threading.Event(), threading.Event()

    class HeldFirst(_RowEchoClient):
        def sample_request(self, request: pb.SampleRequest, timeout: float | None = None) -> SampleResult:
            if not started.is_set():
                started.set()
                release.wait(30)
            return super().sample_request(request)

    fake = HeldFirst(["regions"])
    views = [RegionView("buffer", 2 * k * VOCAB * 4, torch.float32, (2, VOCAB)) for k in range(5)]
    with (BatchingClient(fake, max_rows=64, max_delay_us=0, max_in_flight=1) as batcher,
          concurrent.futures.ThreadPoolExecutor(5) as pool):
        first = pool.submit(batcher.sample, views[0], seed=1)
        assert started.wait(30)
        rest = [pool.submit(batcher.sample, view, seed=1) for view in views[1:]]
        wait_until(lambda: len(batcher._pending) == 4, "all four waiting for the slot")
        release.set()
        results = [first.result(30)] + [future.result(30) for future in rest]
    assert [r.logits_ref.shape[0] for r in fake.sent] == [2, 8]
    for k, result in enumerate(results):
        assert result.tokens[:, 0].tolist() == [2 * k, 2 * k + 1]


def test_async_calls_gather_while_every_slot_is_busy() -> None:
    views = [RegionView("buffer", 2 * k * VOCAB * 4, torch.float32, (2, VOCAB)) for k in range(5)]

    async def run() -> tuple[list[SampleResult], list[pb.SampleRequest]]:
        release = asyncio.Event()

        class HeldFirst(_AsyncRowEchoClient):
            async def sample_request(self, request: pb.SampleRequest, timeout: float | None = None) -> SampleResult:
                if not self.sent:
                    self.sent.append(request)
                    await release.wait()
                    self.sent.pop()
                return await super().sample_request(request)

        fake = HeldFirst(["regions"])
        async with AsyncBatchingClient(fake, max_rows=64, max_delay_us=0, max_in_flight=1) as batcher:
            first = asyncio.ensure_future(batcher.sample(views[0], seed=1))
            await wait_until_async(lambda: fake.sent, "the first call in its slot")
            rest = [asyncio.ensure_future(batcher.sample(view, seed=1)) for view in views[1:]]
            # Their flush timers fire while the only slot is busy: the calls wait, their timer spent.
            await wait_until_async(lambda: len(batcher._pending) == 4 and batcher._flush_handle is None,
                                   "all four waiting for the slot")
            release.set()
            results = await asyncio.gather(first, *rest)
        return results, fake.sent

    results, sent = asyncio.run(run())
    assert [r.logits_ref.shape[0] for r in sent] == [2, 8]
    for k, result in enumerate(results):
        assert result.tokens[:, 0].tolist() == [2 * k, 2 * k + 1]
