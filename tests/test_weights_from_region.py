"""LM-head weights registered from a region (RegisterWeightsFromRegion), end to end on the CPU backend with
shared memory; the CUDA IPC form, the engine's own GPU weight used in place, is in tests/gpu/test_server_gpu.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from tokensampler_client import AsyncSamplerClient, SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.regions import RegionView

from .conftest import RunningServer, connected

VOCAB, PADDED, DIM = 1000, 1024, 64


@pytest.fixture(scope="module")
def client(shm_server: RunningServer):
    yield from connected(shm_server)


def _head(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(PADDED, DIM, generator=torch.Generator().manual_seed(seed)) / DIM**0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_weight_in_a_region_samples_like_the_same_weight_uploaded(client: SamplerClient, dtype: torch.dtype) -> None:
    weight = _head(dtype)
    nbytes = weight.numel() * weight.element_size()
    region = client.register_shm_region("head-region", nbytes)
    region.tensor(dtype, (PADDED, DIM)).copy_(weight)
    gen = torch.Generator().manual_seed(1)
    options = dict(vocab_size=VOCAB, bias=torch.randn(PADDED, generator=gen), soft_cap=8.0, logit_scale=1.5)
    try:
        info = client.register_weights_from_region("in-place", region.view(dtype, (PADDED, DIM)), **options)
        client.register_weights("uploaded", weight, **options)
        assert (info.name, info.region, info.sha256, info.vocab_size, info.padded_vocab_size, info.hidden_size,
                info.bytes) == ("in-place", "head-region", "", VOCAB, PADDED, DIM, nbytes)
        hidden = torch.randn(7, DIM, generator=gen)
        params = dict(top_k=40, top_p=0.95, seed=list(range(7)), return_logprobs=True)
        in_place = client.sample_hidden(hidden, "in-place", **params)
        uploaded = client.sample_hidden(hidden, "uploaded", **params)
        assert torch.equal(in_place.tokens, uploaded.tokens) and torch.equal(in_place.logprobs, uploaded.logprobs)
        assert {w.name: w.region for w in client.list_weights()} == {"in-place": "head-region", "uploaded": ""}
        # A shared-memory segment is never mapped (a producer could shrink it under a reader): the server reads a
        # copy of W at registration, so both weights are the server's bytes.
        assert client.server_info().registered_weights_bytes == 2 * nbytes
    finally:
        for name in ("in-place", "uploaded"):
            if name in {w.name for w in client.list_weights()}:
                client.unregister_weights(name)
        client.unregister_region(region)


def test_a_weight_from_a_segment_is_the_segments_bytes_at_registration(client: SamplerClient) -> None:
    """What the producer writes into a shared-memory segment after registering does not reach the weight: the
    server holds the copy it read (CUDA regions are used in place instead: tests/gpu)."""
    region = client.register_shm_region("live-head", PADDED * DIM * 4)
    weight = region.tensor(torch.float32, (PADDED, DIM))
    weight.copy_(_head(torch.float32))
    hidden = torch.ones(1, DIM)
    try:
        client.register_weights_from_region("live", region.view(torch.float32, (PADDED, DIM)))
        before = client.sample_hidden(hidden, "live", temperature=0).tokens.item()
        target = (before + 1) % PADDED
        weight[target] = 1.0  # token `target` would now score DIM, far above every random row
        assert client.sample_hidden(hidden, "live", temperature=0).tokens.item() == before
    finally:
        client.unregister_weights("live")
        client.unregister_region(region)


def test_a_region_holding_a_weight_is_unregistered_only_after_the_weight(client: SamplerClient) -> None:
    region = client.register_shm_region("pinned", PADDED * DIM * 4)
    region.tensor(torch.float32, (PADDED, DIM)).copy_(_head(torch.float32))
    client.register_weights_from_region("pinning", region.view(torch.float32, (PADDED, DIM)))
    with pytest.raises(TokenSamplerError) as raised:
        client.unregister_region("pinned")
    assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert raised.value.details.startswith("name: region 'pinned' holds the registered weight(s) ['pinning']")
    assert client.sample_hidden(torch.randn(2, DIM), "pinning", seed=[1, 2]).tokens.shape == (2, 1)  # still serving
    client.unregister_weights("pinning")
    client.unregister_region(region)
    assert client.list_regions() == [] and client.list_weights() == []


def test_bad_weight_references_name_the_field(shm_server: RunningServer, client: SamplerClient) -> None:
    region = client.register_shm_region("small-head", 64 * DIM * 4)
    try:
        cases = [
            (pb.RegisterWeightsFromRegionRequest(name="w"), grpc.StatusCode.INVALID_ARGUMENT, "weight:"),
            (RegionView("absent", 0, torch.float32, (64, DIM)), grpc.StatusCode.NOT_FOUND, "weight.region"),
            (RegionView("small-head", 0, torch.float32, (65, DIM)), grpc.StatusCode.OUT_OF_RANGE, "weight:"),
            (RegionView("small-head", 2, torch.float32, (8, DIM)), grpc.StatusCode.INVALID_ARGUMENT, "weight.offset"),
            (RegionView("small-head", 0, torch.int32, (64, DIM)), grpc.StatusCode.INVALID_ARGUMENT, "weight.dtype"),
            (RegionView("small-head", 0, torch.float32, (64, 0)), grpc.StatusCode.INVALID_ARGUMENT, "weight.shape"),
        ]
        for weight, code, field in cases:
            request = weight if isinstance(weight, pb.RegisterWeightsFromRegionRequest) else (
                pb.RegisterWeightsFromRegionRequest(name="w", weight=weight.ref()))
            with grpc.insecure_channel(shm_server.target) as channel, pytest.raises(grpc.RpcError) as raised:
                pb_grpc.SamplerStub(channel).RegisterWeightsFromRegion(request, timeout=30)
            assert raised.value.code() == code and raised.value.details().startswith(field), raised.value
        view = region.view(torch.float32, (64, DIM))
        with pytest.raises(TokenSamplerError) as raised:
            client.register_weights_from_region("w", view, bias=torch.zeros(63))
        assert raised.value.details.startswith("options.bias.shape")
        with pytest.raises(ValueError, match="RegionView of W"):
            client.register_weights_from_region("w", region.view(torch.float32, (64 * DIM,)))
        client.register_weights_from_region("w", view)
        with pytest.raises(TokenSamplerError) as raised:  # a name taken leaves the region pinned by "w" alone
            client.register_weights_from_region("w", view)
        assert raised.value.code == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(TokenSamplerError) as raised:  # D of the states against the weight's
            client.sample_hidden(torch.zeros(1, DIM + 1), "w")
        assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
        client.unregister_weights("w")
    finally:
        client.unregister_region(region)


def test_the_async_client_registers_weights_from_a_region(shm_server: RunningServer, client: SamplerClient) -> None:
    region = client.register_shm_region("async-head", PADDED * DIM * 2)
    region.tensor(torch.bfloat16, (PADDED, DIM)).copy_(_head(torch.bfloat16, seed=3))

    async def register_and_sample() -> torch.Tensor:
        async with AsyncSamplerClient(shm_server.target, timeout=60) as aclient:
            info = await aclient.register_weights_from_region("async", region.view(torch.bfloat16, (PADDED, DIM)))
            assert info.region == "async-head"
            result = await aclient.sample_hidden(torch.ones(3, DIM), "async", temperature=0)
            await aclient.unregister_weights("async")
            return result.tokens

    try:
        tokens = asyncio.run(register_and_sample())
        expected = (_head(torch.bfloat16, seed=3).float() @ torch.ones(DIM)).argmax().item()
        assert tokens.flatten().tolist() == [expected] * 3
    finally:
        client.unregister_region(region)
