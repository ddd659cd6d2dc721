"""SampleStream end to end: in-order answers, per-message errors, pipelining, sync and asyncio."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from tokensampler_client import AsyncSamplerClient, SamplerClient, TokenSamplerError
from tokensampler_client.params import build_sample_request, serialize_sample_request

from .conftest import RunningServer


def _steps(count: int) -> list[tuple[torch.Tensor, dict]]:
    gen = torch.Generator().manual_seed(count)
    return [
        (torch.randn(3, 500, generator=gen), dict(top_k=20, temperature=0.8, seed=[step, step + 1, step + 2], position=step))
        for step in range(count)
    ]


def test_stream_answers_in_order_and_matches_unary_calls(server: RunningServer) -> None:
    steps = _steps(30)
    with SamplerClient(server.target, timeout=60) as client:
        with client.stream() as stream:
            streamed = [stream.sample(logits, **params) for logits, params in steps[:10]]
            for logits, params in steps[10:]:  # pipelined: 20 in flight, then 20 answers in order
                stream.send(logits, **params)
            streamed += [stream.receive() for _ in steps[10:]]
        unary = [client.sample(logits, **params) for logits, params in steps]
    for s, u in zip(streamed, unary):
        assert torch.equal(s.tokens, u.tokens) and s.seeds == u.seeds
    assert len({s.request_id for s in streamed}) == len(streamed)


def test_prebuilt_requests_as_messages_or_bytes(server: RunningServer) -> None:
    """A decode loop may build its requests ahead: stream and unary calls take the message or its bytes."""
    logits, params = _steps(1)[0]
    message = build_sample_request(logits, **params)
    with SamplerClient(server.target, timeout=60) as client:
        expected = client.sample(logits, **params)
        answers = [client.sample_request(message), client.sample_request(serialize_sample_request(logits, **params))]
        with client.stream() as stream:
            answers += [stream.sample(message), stream.sample(message.SerializeToString())]
    for got in answers:
        assert torch.equal(got.tokens, expected.tokens) and got.seeds == expected.seeds


def test_a_bad_message_gets_an_error_and_the_stream_stays_open(server: RunningServer) -> None:
    with SamplerClient(server.target, timeout=60) as client, client.stream() as stream:
        assert stream.sample(torch.zeros(1, 8), seed=1).valid.all()
        stream.send(torch.zeros(1, 8), top_p=0.0)
        stream.send(torch.zeros(2, 8), seed=2)
        with pytest.raises(TokenSamplerError) as raised:
            stream.receive()
        assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details.startswith("params.top_p:")
        assert stream.receive().tokens.shape == (2, 1)
        with pytest.raises(TokenSamplerError) as raised:
            stream.sample(hidden=torch.zeros(1, 4), weights="unknown")
        assert raised.value.code == grpc.StatusCode.NOT_FOUND
        assert stream.sample(torch.zeros(1, 8)).valid.all()


def test_async_stream(server: RunningServer) -> None:
    steps = _steps(12)

    async def run() -> tuple[list, list]:
        async with AsyncSamplerClient(server.target, timeout=60) as client:
            async with client.stream() as stream:
                for logits, params in steps:
                    await stream.send(logits, **params)
                streamed = [await stream.receive() for _ in steps]
            unary = [await client.sample(logits, **params) for logits, params in steps]
        return streamed, unary

    streamed, unary = asyncio.run(run())
    for s, u in zip(streamed, unary):
        assert torch.equal(s.tokens, u.tokens)


def test_a_stream_past_its_deadline_raises_deadline_exceeded_sync_and_async(server: RunningServer) -> None:
    with SamplerClient(server.target) as client:
        stream = client.stream(timeout=0.3)
        stream.sample(torch.randn(1, 50))
        time.sleep(0.5)
        with pytest.raises(TokenSamplerError) as raised:
            stream.sample(torch.randn(1, 50))
        assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        stream.close()

    async def run() -> None:
        async with AsyncSamplerClient(server.target) as client:
            stream = client.stream(timeout=0.3)
            await stream.sample(torch.randn(1, 50))
            await asyncio.sleep(0.5)
            with pytest.raises(TokenSamplerError) as raised:
                await stream.sample(torch.randn(1, 50))
            assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            await stream.close()

    asyncio.run(run())
