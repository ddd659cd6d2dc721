"""Load and overload against a real server (loopback, bounded counts).

Every response is checked against the tokens its request gets when sampled alone by the reference
backend: batch invariance makes them computable, so a lost, duplicated or misrouted row fails.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import grpc
import numpy as np
import pytest
import torch
from tokensampler_client import Backoff, SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client._retry import CONCURRENCY_LIMIT_DETAILS, RetryState
from tokensampler_client.params import build_sample_request
from tokensampler_client.result import SampleResult
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
from tokensampler_server.validation.sample import validate_sample_request

from .conftest import RunningServer, serving, start_server
from .gated_server import GATE_SEED, ServerGate
from .polling import wait_until_async
from .test_metrics import metrics_port, parse_samples, scrape_text, value

CLIENTS, REQUESTS_PER_CLIENT = 16, 100
LOAD_DEADLINE_S = 600.0
"""For the whole load: the 1600 requests took 29 s on 2 cores (43 s with two busy loops beside them), so
this bounds a hang, not the speed."""
VOCABS = (64, 256, 1000)
MODES = ("greedy", "top_k", "top_p", "min_p", "gumbel", "processed")
_REFERENCE = CpuBackend()


def mixed_request(rng: random.Random, vocab: int | None = None) -> pb.SampleRequest:
    """1-6 rows, a random mode and vocabulary size, one seed per row (so every token is determined)."""
    rows = rng.randint(1, 6)
    vocab = vocab or rng.choice(VOCABS)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    params: dict = {"seed": [rng.randrange(2**64) for _ in range(rows)], "position": rng.randrange(4096)}
    mode = rng.choice(MODES)
    if mode == "greedy":
        params["temperature"] = 0.0
    elif mode == "top_k":
        params.update(top_k=[rng.choice([1, 5, 40]) for _ in range(rows)], temperature=0.8)
    elif mode == "top_p":
        params["top_p"] = rng.choice([0.5, 0.9])
    elif mode == "min_p":
        params["min_p"] = 0.1
    elif mode == "processed":
        params.update(banned_token_ids=[rng.randrange(vocab) for _ in range(3)], repetition_penalty=1.3,
                      output_token_ids=[[rng.randrange(vocab)] * rng.randint(0, 3) for _ in range(rows)],
                      logit_bias=[{rng.randrange(vocab): 2.0} for _ in range(rows)])
    return build_sample_request(logits, num_samples=rng.choice([1, 1, 2]), **params)


def expected_tokens(request: pb.SampleRequest) -> torch.Tensor:
    """The tokens of `request` sampled alone by the reference backend."""
    batch, _ = validate_sample_request(request, Limits())
    return _REFERENCE.sample(batch.with_logits()).tokens.to(torch.int64)


def check(request: pb.SampleRequest, result: SampleResult) -> None:
    """Exactly the rows of `request`, each with its own tokens and seed."""
    assert result.seeds == list(request.params.seed)
    assert torch.equal(result.tokens, expected_tokens(request))


@pytest.fixture(scope="module")
def load_server() -> Iterator[RunningServer]:
    yield from serving("--device", "cpu")


@pytest.mark.timeout(LOAD_DEADLINE_S + 300)  # the load, then the check of every row
def test_many_clients_get_exactly_their_own_rows(load_server: RunningServer) -> None:
    """16 clients × 100 requests at once; every row checked. Prints the figures for the README."""
    results: list[tuple[pb.SampleRequest, SampleResult, float]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)

    def client_loop(index: int) -> None:
        rng = random.Random(index)
        requests = [mixed_request(rng) for _ in range(REQUESTS_PER_CLIENT)]
        with SamplerClient(load_server.target, timeout=60) as client:
            start.wait()
            for request in requests:
                try:
                    sent = time.perf_counter()
                    result = client.sample_request(request)
                    with lock:
                        results.append((request, result, time.perf_counter() - sent))
                except TokenSamplerError as err:
                    with lock:
                        errors.append(err)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(CLIENTS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + LOAD_DEADLINE_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    elapsed = time.perf_counter() - started
    assert not any(thread.is_alive() for thread in threads), f"the load outlasted {LOAD_DEADLINE_S} s"
    assert not errors, errors[:3]
    assert len(results) == CLIENTS * REQUESTS_PER_CLIENT
    for request, result, _ in results:
        check(request, result)
    latencies = np.array([latency for _, _, latency in results])
    rows = sum(request.logits.shape[0] for request, _, _ in results)
    print(f"\nload: {len(results)} requests, {rows} rows, {len(errors)} errors, 0 lost or misrouted, "
          f"p50 {np.percentile(latencies, 50) * 1e3:.1f} ms, p99 {np.percentile(latencies, 99) * 1e3:.1f} ms, "
          f"{len(results) / elapsed:.0f} requests/s")


@dataclass(frozen=True)
class Outcome:
    """How one raw Sample call of a burst ended."""

    code: grpc.StatusCode
    elapsed_s: float
    details: str = ""
    trailing_metadata: tuple = ()
    while_held: bool = False
    """Answered while the gated backend held the calls the server admitted (burst_while_held)."""


SLOW_ROWS = 4


def slow_requests(count: int, seed: int) -> list[pb.SampleRequest]:
    """Wide 4-row requests sorted by top-p, each held by a gated server's backend (its first row seeded
    GATE_SEED) until the gate opens."""
    rng = random.Random(seed)
    return [build_sample_request(torch.randn(SLOW_ROWS, 100_000, dtype=torch.bfloat16), top_p=0.9,
                                 seed=[GATE_SEED] + [rng.randrange(2**63) for _ in range(SLOW_ROWS - 1)])
            for _ in range(count)]


def burst_while_held(server: RunningServer, requests: list[pb.SampleRequest]) -> list[Outcome]:
    """Every request (slow_requests) sent at once on one channel, without the client's retries, to a gated
    server: its backend holds the first batch, so each call the server admits waits there or in the queue, and
    every other one is answered meanwhile. The gate opens once every call is answered or admitted."""
    assert server.gate is not None

    def admitted(held_rows: int) -> int:
        return held_rows // SLOW_ROWS + int(value(parse_samples(scrape_text(metrics_port(server))),
                                                   "tokensampler_queue_depth") or 0)

    async def burst() -> list[Outcome]:
        async with grpc.aio.insecure_channel(server.target, options=[("grpc.max_send_message_length", -1)]) as channel:
            stub = pb_grpc.SamplerStub(channel)

            async def one(request: pb.SampleRequest) -> Outcome:
                sent = time.perf_counter()
                try:
                    await stub.Sample(request, timeout=60)
                except grpc.aio.AioRpcError as err:
                    return Outcome(err.code(), time.perf_counter() - sent, err.details() or "",
                                   tuple(err.trailing_metadata() or ()))
                return Outcome(grpc.StatusCode.OK, time.perf_counter() - sent)

            calls = [asyncio.ensure_future(one(r)) for r in requests]
            try:
                held_rows = await asyncio.to_thread(server.gate.wait_held)
                await wait_until_async(lambda: sum(c.done() for c in calls) + admitted(held_rows) == len(calls),
                                       "every call answered or admitted")
                answered = [call.done() for call in calls]
            finally:
                server.gate.open()
            outcomes = await asyncio.gather(*calls)
            return [replace(outcome, while_held=held) for outcome, held in zip(outcomes, answered)]

    return asyncio.run(burst())


RETRY_DEADLINE_S = 120.0
"""Each call's deadline, its retries included: they go on until it passes, however many it takes."""


def assert_retries_get_every_request_through(target: str, requests: list[pb.SampleRequest]) -> None:
    """The same requests from threads through the client with retries: each answered with its own tokens."""
    results: list[tuple[pb.SampleRequest, SampleResult]] = []
    errors: list[TokenSamplerError] = []

    def send(request: pb.SampleRequest) -> None:
        try:
            results.append((request, client.sample_request(request)))
        except TokenSamplerError as err:
            errors.append(err)

    with SamplerClient(target, timeout=RETRY_DEADLINE_S, retries=sys.maxsize, max_message_mb=64,
                       backoff=Backoff(initial=0.05, maximum=0.5)) as client:
        threads = [threading.Thread(target=send, args=(r,)) for r in requests]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(RETRY_DEADLINE_S + 30)
    assert not errors, errors[:3]
    assert len(results) == len(requests)
    for request, result in results:
        check(request, result)


def overload_refusals(*flags: str, count: int, seed: int) -> tuple[list[Outcome], list[Outcome]]:
    """The outcomes of a burst of `count` slow requests to a gated server started with `flags`, and the refused
    among them, once the burst has shown what every refusal of overload is: OK or RESOURCE_EXHAUSTED only, some
    refused, each while the backend held the admitted calls (at once, not at its deadline, nor once the backend
    was free) and marked retryable; and the client's retries have then got every request through, each with its
    own tokens."""
    running = start_server("--device", "cpu", *flags, gate=ServerGate())
    requests = slow_requests(count, seed=seed)
    try:
        outcomes = burst_while_held(running, requests)
        refused = [o for o in outcomes if o.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert {o.code for o in outcomes} <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert refused, "the burst never filled the server"
        assert all(o.while_held and ("x-retryable", "overload") in o.trailing_metadata for o in refused)
        assert_retries_get_every_request_through(running.target, requests)
    finally:
        running.stop()
    return outcomes, refused


def test_overload_answers_resource_exhausted_fast_and_retries_get_through() -> None:
    """A queue of 8 rows under 16 concurrent 4-row requests: the ones that do not fit are refused at
    once (not at their 60 s deadline), marked retryable; the client's backoff then gets every one
    through, each with its own tokens."""
    outcomes, refused = overload_refusals("--max-queue-rows", "8", count=16, seed=7)
    slowest_refusal = max(o.elapsed_s for o in refused)
    served = [o.elapsed_s for o in outcomes if o.code == grpc.StatusCode.OK]
    print(f"\noverload: {len(refused)}/{len(outcomes)} refused, slowest refusal {slowest_refusal * 1e3:.0f} ms, "
          f"slowest served {max(served) * 1e3:.0f} ms")


def test_only_resource_exhausted_marked_as_overload_is_retried() -> None:
    """grpc's own RESOURCE_EXHAUSTED (a message over the size limit) lacks the mark: no retry can help it."""
    state = RetryState(retries=5, backoff=Backoff(initial=0.0), timeout=None)
    assert state.next_delay(grpc.StatusCode.RESOURCE_EXHAUSTED) is None
    assert state.next_delay(grpc.StatusCode.RESOURCE_EXHAUSTED, (("x-retryable", "overload"),)) is not None
    assert state.next_delay(grpc.StatusCode.UNAVAILABLE, ()) is not None
    assert state.next_delay(grpc.StatusCode.INVALID_ARGUMENT, (("x-retryable", "overload"),)) is None
    # A shutting-down server cancels calls it received but never started: only Sample, idempotent, retries them.
    assert state.next_delay(grpc.StatusCode.CANCELLED) is None
    assert state.next_delay(grpc.StatusCode.CANCELLED, (), idempotent=True) is not None
    # A server at its --max-concurrent-rpcs: grpc's own refusal, which carries no metadata, is overload too.
    assert state.next_delay(grpc.StatusCode.RESOURCE_EXHAUSTED, (), details=CONCURRENCY_LIMIT_DETAILS) is not None
    assert state.next_delay(grpc.StatusCode.RESOURCE_EXHAUSTED, (), details="Received message larger than max") is None


def test_calls_past_the_concurrency_limit_are_refused_at_once_and_retries_get_through() -> None:
    """--max-concurrent-rpcs 2 under 8 concurrent slow requests: the ones past the limit are refused at once,
    marked retryable, the server keeps serving, and the client's retries get every request through with its
    own tokens."""
    outcomes, refused = overload_refusals("--max-concurrent-rpcs", "2", count=8, seed=8)
    assert sum(o.code == grpc.StatusCode.OK for o in outcomes) >= 2
    # Each refused while the backend held the 2 admitted calls: at once, waiting for no slot to free.
    assert all("at most 2 (--max-concurrent-rpcs)" in o.details for o in refused)
