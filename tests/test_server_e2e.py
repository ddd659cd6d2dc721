"""End to end: a real tokensampler-server subprocess, called through the client and a raw stub."""

from __future__ import annotations

import asyncio
import signal
import threading

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tokensampler_client import AsyncSamplerClient, SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.tensors import encode_tensor
from tokensampler_server.backends.cpu import CpuBackend

from .batches import make_batch
from .conftest import RunningServer, serving, start_server
from .gated_server import GATE_SEED, ServerGate
from .polling import wait_until


@pytest.fixture(scope="module")
def stub(server: RunningServer):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.SamplerStub(channel)


def test_health_is_serving(client: SamplerClient) -> None:
    assert client.health() == "SERVING"
    assert client.health("tokensampler.v1.Sampler") == "SERVING"


def test_server_info(client: SamplerClient) -> None:
    info = client.server_info()
    assert info.backend == "cpu" and info.device == "cpu"
    assert info.api_version == "tokensampler.v1"
    assert set(info.logits_dtypes) == {pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16}
    assert info.limits.max_batch_rows > 0 and "logprobs" in info.features
    assert [route.rows for route in info.routes] == ["every row"] and "CPU" in info.routes[0].cost


def test_reflection_lists_the_sampler(server: RunningServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(iter(stub.ServerReflectionInfo(iter([request]))))
    names = {service.name for service in response.list_services_response.service}
    assert "tokensampler.v1.Sampler" in names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sample_matches_the_reference_backend(client: SamplerClient, dtype: torch.dtype) -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    seeds = [11 * i + 2**63 for i in range(8)]  # above 2^63: the full uint64 range travels
    result = client.sample(
        logits, temperature=0.7, top_k=[0, 5, 50, 0, 1, 0, 20, 0], top_p=0.9, seed=seeds,
        num_samples=3, return_logprobs=True, top_logprobs=4, request_id="e2e-reference",
    )
    signed = torch.tensor([s - 2**64 for s in seeds])
    expected = CpuBackend().sample(
        make_batch(logits, temperature=0.7, top_k=[0, 5, 50, 0, 1, 0, 20, 0], top_p=0.9, seed=signed,
                   num_samples=3, return_logprobs=True, top_logprobs=4)
    )
    assert torch.equal(result.tokens, expected.tokens)
    assert torch.equal(result.logprobs, expected.logprobs)
    assert torch.equal(result.top_logprob_ids, expected.top_logprob_ids)
    assert result.seeds == seeds and result.request_id == "e2e-reference"
    assert result.valid.all() and not result.nan_detected.any()
    assert 0 < result.timings.compute_ns <= result.timings.total_ns


def test_unseeded_rows_get_seeds_that_reproduce_them(client: SamplerClient) -> None:
    logits = torch.randn(4, 500)
    first = client.sample(logits, seed=[5, None, None, 7])
    assert first.seeds[0] == 5 and first.seeds[3] == 7
    again = client.sample(logits, seed=first.seeds)
    assert torch.equal(first.tokens, again.tokens)


def test_processing_and_penalties_travel(client: SamplerClient) -> None:
    logits = torch.zeros(2, 50)
    result = client.sample(
        logits, temperature=0.0, allowed_token_ids=[[3, 4, 5], []], banned_token_ids=[4],
        logit_bias=[{5: 2.0}, {7: 1.0, 9: 3.0}], output_token_ids=[[5, 5], [9]],
        frequency_penalty=0.9, return_logprobs=True, logprobs_mode="processed",
    )
    # Row 0: tokens 3 and 5 remain; 5 gets +2 then -1.8 = 0.2 > 0. Row 1: 9 gets 3 - 0.9 = 2.1.
    assert result.tokens[:, 0].tolist() == [5, 9]


def test_nan_rows_are_flagged_not_failed(client: SamplerClient) -> None:
    logits = torch.randn(3, 10)
    logits[1] = float("nan")
    result = client.sample(logits, seed=1)
    assert result.valid.tolist() == [True, False, True]
    assert result.nan_detected.tolist() == [False, True, False]
    assert result.tokens[1, 0] == -1


def test_async_client(server: RunningServer) -> None:
    async def run() -> torch.Tensor:
        async with AsyncSamplerClient(server.target, timeout=60) as aclient:
            assert await aclient.health() == "SERVING"
            results = await asyncio.gather(*(aclient.sample(torch.zeros(1, 64), seed=s) for s in range(8)))
            return torch.cat([r.tokens for r in results])

    tokens = asyncio.run(run())
    expected = CpuBackend().sample(make_batch(torch.zeros(8, 64), seed=torch.arange(8))).tokens
    assert torch.equal(tokens, expected)


def _request(batch: int = 2, vocab: int = 16, **params) -> pb.SampleRequest:
    request = pb.SampleRequest(params=pb.SamplingParams(**params))
    encode_tensor(torch.randn(batch, vocab), out=request.logits)
    return request


def _with(request: pb.SampleRequest, mutate) -> pb.SampleRequest:
    mutate(request)
    return request


def _tokens(*lists: list[int]) -> pb.TokenLists:
    return pb.TokenLists(ids=[i for ids in lists for i in ids], lengths=[len(ids) for ids in lists])


# Each invalid request and the field its INVALID_ARGUMENT message must name.
INVALID_REQUESTS = {
    "no input": (lambda: pb.SampleRequest(), "input"),
    "dtype int32": (lambda: _with(_request(), lambda r: setattr(r.logits, "dtype", pb.DTYPE_INT32)), "logits.dtype"),
    "dtype unknown": (lambda: _with(_request(), lambda r: setattr(r.logits, "dtype", 99)), "logits.dtype"),
    "rank 1": (lambda: _with(_request(), lambda r: r.logits.shape.pop()), "logits.shape"),
    "zero rows": (lambda: _with(_request(), lambda r: r.logits.shape.__setitem__(0, 0)), "logits.shape"),
    "bytes short": (lambda: _with(_request(), lambda r: setattr(r.logits, "data", r.logits.data[:-1])), "logits.data"),
    "too many rows": (lambda: _request(batch=65), "logits.shape"),
    "temperature negative": (lambda: _request(temperature=[-0.1]), "params.temperature"),
    "temperature nan": (lambda: _request(temperature=[float("nan")]), "params.temperature"),
    "temperature inf": (lambda: _request(temperature=[float("inf"), 1.0]), "params.temperature"),
    "temperature count": (lambda: _request(temperature=[1.0, 1.0, 1.0]), "params.temperature"),
    "top_k below -1": (lambda: _request(top_k=[-2]), "params.top_k"),
    "top_p zero": (lambda: _request(top_p=[0.0]), "params.top_p"),
    "top_p above one": (lambda: _request(top_p=[1.5]), "params.top_p"),
    "min_p above one": (lambda: _request(min_p=[1.0000001]), "params.min_p"),
    "min_p negative": (lambda: _request(min_p=[-0.01]), "params.min_p"),
    "repetition zero": (lambda: _request(repetition_penalty=[0.0]), "params.repetition_penalty"),
    "presence inf": (lambda: _request(presence_penalty=[float("inf")]), "params.presence_penalty"),
    "frequency nan": (lambda: _request(frequency_penalty=[float("nan")]), "params.frequency_penalty"),
    "seed count": (lambda: _request(seed=[1, 2, 3]), "params.seed"),
    "has_seed alone": (lambda: _request(has_seed=[True, False]), "params.has_seed"),
    "banned id too large": (lambda: _request(banned_token_ids=_tokens([16])), "params.banned_token_ids.ids"),
    "allowed id negative": (lambda: _request(allowed_token_ids=_tokens([-1])), "params.allowed_token_ids.ids"),
    "history lengths count": (
        lambda: _request(output_token_ids=_tokens([1], [2], [3])), "params.output_token_ids.lengths"
    ),
    "history lengths sum": (
        lambda: _request(prompt_token_ids=pb.TokenLists(ids=[1, 2], lengths=[3])), "params.prompt_token_ids.lengths"
    ),
    "bias values count": (
        lambda: _request(logit_bias=pb.LogitBias(tokens=_tokens([1, 2]), values=[1.0])), "params.logit_bias.values"
    ),
    "bias value nan": (
        lambda: _request(logit_bias=pb.LogitBias(tokens=_tokens([1]), values=[float("nan")])), "params.logit_bias.values"
    ),
    "num_samples zero": (lambda: _with(_request(), lambda r: setattr(r, "num_samples", 0)), "num_samples"),
    "num_samples huge": (lambda: _with(_request(), lambda r: setattr(r, "num_samples", 10_000)), "num_samples"),
    "top_logprobs huge": (lambda: _with(_request(), lambda r: setattr(r, "top_logprobs", 100_000)), "top_logprobs"),
    "logprobs mode": (lambda: _with(_request(), lambda r: setattr(r, "logprobs_mode", 7)), "logprobs_mode"),
}


@pytest.fixture(scope="module")
def small_server():
    """A server with a row limit of 64, to test the limit without a huge message."""
    yield from serving("--device", "cpu", "--max-batch-rows", "64")


@pytest.mark.parametrize("make, field", INVALID_REQUESTS.values(), ids=INVALID_REQUESTS.keys())
def test_invalid_input_names_the_field_and_the_server_keeps_serving(small_server: RunningServer, make, field: str) -> None:
    with grpc.insecure_channel(small_server.target) as channel:
        stub = pb_grpc.SamplerStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Sample(make(), timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith(f"{field}:"), raised.value.details()
        assert "expected" in raised.value.details()
        response = stub.Sample(_request(), timeout=30)
        assert len(response.valid) == 2


def test_client_raises_typed_errors(client: SamplerClient) -> None:
    with pytest.raises(TokenSamplerError) as raised:
        client.sample(torch.randn(2, 8), top_p=0.0)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.top_p" in raised.value.details


def test_oversized_message_is_refused_and_the_server_keeps_serving(small_server: RunningServer) -> None:
    with SamplerClient(small_server.target, timeout=60, max_message_mb=512) as client:
        with pytest.raises(TokenSamplerError) as raised:
            client.sample(torch.zeros(64, 1_100_000))  # 282 MB > the default 256 MiB
        assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.sample(torch.zeros(1, 8)).valid.all()


def test_sigterm_drains_in_flight_requests_and_exits_zero() -> None:
    gate = ServerGate()
    running = start_server("--device", "cpu", "--grace-period-s", "30", gate=gate)
    results: list[object] = []
    with SamplerClient(running.target, timeout=60) as client:
        client.sample(torch.zeros(1, 8))  # warm up
        # A request held in the backend while SIGTERM arrives and the server starts to drain.
        slow = threading.Thread(
            target=lambda: results.append(client.sample(torch.randn(64, 1000), top_p=0.9, seed=GATE_SEED))
        )
        slow.start()
        with gate.holding() as rows:
            running.process.send_signal(signal.SIGTERM)
            wait_until(lambda: any("shutting down" in line for line in running.log), "the server saw SIGTERM")
            assert rows == 64 and slow.is_alive() and not results  # in flight while the server drains
        slow.join(120)
        assert running.process.wait(timeout=60) == 0
    assert len(results) == 1 and results[0].tokens.shape == (64, 1), results
    assert any("shutting down" in line for line in running.log)
