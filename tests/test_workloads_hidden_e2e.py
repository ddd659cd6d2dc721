"""Diffusion steps and top-k probabilities from hidden states through a registered LM head, end to end.

A hidden-state request must answer exactly what the logits request answers with logits = the head's
W·h (bias, scale and soft cap applied, padding rows dropped). The heads' values are multiples of 1/64,
so W·h is exact in fp32 whatever the summation order; the finish runs as the server runs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from tokensampler_client import AsyncSamplerClient, SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.tensors import encode_tensor

from .conftest import RunningServer


@dataclass(frozen=True)
class Head:
    """An LM head as registered: W [padded V, D] and its finish options."""

    name: str
    weight: torch.Tensor
    vocab: int
    bias: torch.Tensor | None = None
    logit_scale: float | None = None
    soft_cap: float | None = None

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    def register(self, client: SamplerClient) -> None:
        client.register_weights(self.name, self.weight, vocab_size=self.vocab, bias=self.bias,
                                logit_scale=self.logit_scale, soft_cap=self.soft_cap)

    def logits(self, hidden: torch.Tensor, device: str = "cpu") -> torch.Tensor:
        """float32 logits [..., V] of hidden [..., D]: RegisteredWeight.logits' ops, on `device`, over the
        same [N, V] rows (the element-wise finish then rounds exactly as the server's)."""
        rows = hidden.reshape(-1, self.hidden_size).double()
        x = (rows @ self.weight[: self.vocab].double().T).float().to(device)  # exact: see the module doc
        if self.bias is not None:
            x += self.bias[: self.vocab].to(device)
        if self.logit_scale is not None:
            x *= self.logit_scale
        if self.soft_cap is not None:
            x = self.soft_cap * torch.tanh(x / self.soft_cap)
        return x.cpu().reshape(*hidden.shape[:-1], self.vocab)


def dyadic(*shape: int, seed: int) -> torch.Tensor:
    """float32 values k/64, |k| <= 64: products and their sums are exact in fp32."""
    return torch.randint(-64, 65, shape, generator=torch.Generator().manual_seed(seed)).float() / 64


def make_heads(prefix: str) -> list[Head]:
    """A head with every finish option and 10 padding rows, and a plain bf16 head."""
    return [
        Head(f"{prefix}-finished", dyadic(300, 32, seed=1), vocab=290, bias=dyadic(300, seed=2) * 4,
             logit_scale=0.75, soft_cap=12.0),
        Head(f"{prefix}-bf16", dyadic(256, 48, seed=3).bfloat16(), vocab=256),
    ]


def hidden_states(head: Head, *shape: int, seed: int) -> torch.Tensor:
    states = dyadic(*shape, head.hidden_size, seed=seed) * 4
    return states.to(head.weight.dtype)


def check_diffusion_step(client: SamplerClient, head: Head, device: str = "cpu") -> None:
    """Same tokens, confidences and mask from hidden states as from the head's logits (`device`: where
    the test computes those), without filters (the CUDA kernels' case) and with them."""
    hidden = hidden_states(head, 3, 12, seed=10)
    mask = torch.rand(3, 12, generator=torch.Generator().manual_seed(11)) < 0.7
    for params in (
        {"temperature": [1.0, 0.0, 0.8], "seed": [5, 6, 7], "iteration": 2, "confidence_threshold": 0.2,
         "commit_count": [1, 0, 2]},
        {"top_k": 40, "top_p": 0.9, "seed": [5, 6, 7], "commit_count": 2},
    ):
        from_hidden = client.sample_diffusion_step_hidden(hidden, head.name, mask, **params)
        from_logits = client.sample_diffusion_step(head.logits(hidden, device), mask, **params)
        assert torch.equal(from_hidden.tokens, from_logits.tokens), params
        if device == "cpu":
            assert torch.equal(from_hidden.confidences, from_logits.confidences), params
        else:  # filtered steps take confidences on the logits' device (workloads/diffusion.py): the GPU for
            # hidden states, the CPU for logits from the wire; fp32 softmax rounds apart by ~1 ulp
            torch.testing.assert_close(from_hidden.confidences, from_logits.confidences, rtol=1e-5, atol=1e-9)
        assert torch.equal(from_hidden.mask, from_logits.mask), params
        assert from_hidden.seeds == from_logits.seeds == [5, 6, 7]
        assert (from_hidden.tokens < head.vocab).all() and (from_hidden.tokens[mask] >= 0).all()


def check_topk_probs(client: SamplerClient, head: Head, device: str = "cpu") -> None:
    """Same ids and probabilities from hidden states [B, S, D] and [B, D] as from the head's logits."""
    for shape in ((2, 5), (4,)):  # [B, S, D] and [B, D]
        hidden = hidden_states(head, *shape, seed=20 + len(shape))
        temperature = [0.7, 1.5, 1.0, 2.0][: shape[0]]
        from_hidden = client.topk_probs_hidden(hidden, head.name, 16, temperature=temperature)
        from_logits = client.topk_probs(head.logits(hidden, device), 16, temperature=temperature)
        assert from_hidden.ids.shape == (*shape, 16)
        assert torch.equal(from_hidden.ids, from_logits.ids) and torch.equal(from_hidden.probs, from_logits.probs)


@pytest.fixture(scope="module")
def heads(client: SamplerClient) -> Iterator[dict[str, Head]]:
    registered = make_heads("workload-head")
    for head in registered:
        head.register(client)
    yield {head.name.removeprefix("workload-head-"): head for head in registered}
    for head in registered:
        client.unregister_weights(head.name)


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[pb_grpc.SamplerStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.SamplerStub(channel)


@pytest.mark.parametrize("kind", ["finished", "bf16"])
def test_diffusion_step_from_hidden_states_equals_the_logits_step(client: SamplerClient, heads: dict[str, Head],
                                                                   kind: str) -> None:
    check_diffusion_step(client, heads[kind])


@pytest.mark.parametrize("kind", ["finished", "bf16"])
def test_topk_probs_from_hidden_states_equal_the_logits_ones(client: SamplerClient, heads: dict[str, Head],
                                                             kind: str) -> None:
    check_topk_probs(client, heads[kind])


def test_asyncio_client(server: RunningServer, heads: dict[str, Head]) -> None:
    head = heads["finished"]
    hidden = hidden_states(head, 2, 4, seed=30)
    mask = torch.ones(2, 4, dtype=torch.bool)

    async def run() -> None:
        async with AsyncSamplerClient(server.target, timeout=60) as aclient:
            step = await aclient.sample_diffusion_step_hidden(hidden, head.name, mask, seed=[1, 2], commit_count=1)
            expected = await aclient.sample_diffusion_step(head.logits(hidden), mask, seed=[1, 2], commit_count=1)
            assert torch.equal(step.tokens, expected.tokens) and torch.equal(step.mask, expected.mask)
            top = await aclient.topk_probs_hidden(hidden, head.name, 3)
            assert torch.equal(top.ids, (await aclient.topk_probs(head.logits(hidden), 3)).ids)

    asyncio.run(run())


@pytest.mark.parametrize(
    "call, code, field",
    [
        (lambda c, h: c.sample_diffusion_step_hidden(torch.zeros(1, 2, 32), "absent-head", torch.ones(1, 2)),
         grpc.StatusCode.NOT_FOUND, "hidden.weights"),
        (lambda c, h: c.topk_probs_hidden(torch.zeros(1, 32), "absent-head", 2), grpc.StatusCode.NOT_FOUND,
         "hidden.weights"),
        (lambda c, h: c.sample_diffusion_step_hidden(torch.zeros(1, 2, 31), h["finished"].name, torch.ones(1, 2)),
         grpc.StatusCode.INVALID_ARGUMENT, "hidden.states.shape"),
        (lambda c, h: c.topk_probs_hidden(torch.zeros(1, 2, 33), h["finished"].name, 2), grpc.StatusCode.INVALID_ARGUMENT,
         "hidden.states.shape"),
        (lambda c, h: c.sample_diffusion_step_hidden(torch.zeros(1, 2, 32), h["finished"].name, torch.ones(1, 3)),
         grpc.StatusCode.INVALID_ARGUMENT, "mask.shape"),
        # k is bounded by the head's real vocabulary (290), not by its padded rows (300)
        (lambda c, h: c.topk_probs_hidden(torch.zeros(1, 32), h["finished"].name, 291), grpc.StatusCode.INVALID_ARGUMENT,
         "k"),
        (lambda c, h: c.sample_diffusion_step_hidden(torch.zeros(1, 2, 32), h["finished"].name, torch.ones(1, 2),
                                                     banned_token_ids=[290]), grpc.StatusCode.INVALID_ARGUMENT,
         "params.banned_token_ids.ids"),
    ],
)
def test_bad_hidden_requests_name_the_field(client: SamplerClient, heads: dict[str, Head], call, code, field: str) -> None:
    with pytest.raises(TokenSamplerError) as raised:
        call(client, heads)
    assert raised.value.code == code and raised.value.details.startswith(f"{field}:"), raised.value


def _hidden(states: torch.Tensor, weights: str) -> pb.HiddenStates:
    return pb.HiddenStates(states=encode_tensor(states), weights=weights)


@pytest.mark.parametrize(
    "method, request_for, field, expected",
    [
        ("SampleDiffusionStep", lambda name: pb.DiffusionStepRequest(hidden=_hidden(torch.zeros(2, 32), name),
                                                                     mask=encode_tensor(torch.ones(2, 1, dtype=torch.uint8))),
         "hidden.states.shape", "expected 3 sizes"),
        ("TopKProbs", lambda name: pb.TopKProbsRequest(hidden=_hidden(torch.zeros(32), name), k=2),
         "hidden.states.shape", "expected 2 or 3 sizes"),
        ("TopKProbs", lambda name: pb.TopKProbsRequest(hidden=_hidden(torch.zeros(1, 32, dtype=torch.int32), name), k=2),
         "hidden.states.dtype", "expected one of float32"),
        ("SampleDiffusionStep", lambda name: pb.DiffusionStepRequest(mask=encode_tensor(torch.ones(1, 2, dtype=torch.uint8))),
         "input", "expected logits, or hidden"),
        ("TopKProbs", lambda name: pb.TopKProbsRequest(k=2), "input", "expected logits, or hidden"),
        ("TopKProbs", lambda name: pb.TopKProbsRequest(
            hidden=pb.HiddenStates(weights=name, states_ref=pb.TensorRef(region="r", dtype=pb.DTYPE_FLOAT32, shape=[1, 32])),
            k=2), "hidden.states_ref", "expected hidden.states"),
        ("TopKProbs", lambda name: pb.TopKProbsRequest(  # no weight named: the reference is what is refused
            hidden=pb.HiddenStates(states_ref=pb.TensorRef(region="r", dtype=pb.DTYPE_FLOAT32, shape=[1, 32])),
            k=2), "hidden.states_ref", "expected hidden.states"),
    ],
)
def test_malformed_hidden_requests_are_invalid(stub: pb_grpc.SamplerStub, heads: dict[str, Head], method: str, request_for,
                                               field: str, expected: str) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        getattr(stub, method)(request_for(heads["finished"].name), timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(f"{field}:") and expected in raised.value.details(), raised.value.details()


def test_client_checks_its_arguments() -> None:
    from tokensampler_client.workloads import build_diffusion_request, build_topk_request

    with pytest.raises(ValueError, match="exactly one"):
        build_topk_request(torch.zeros(1, 4), 2, hidden=torch.zeros(1, 4), weights="w")
    with pytest.raises(ValueError, match="weights"):
        build_diffusion_request(None, torch.ones(1, 2), hidden=torch.zeros(1, 2, 4))
    request = build_topk_request(None, 2, hidden=torch.zeros(3, 4).bfloat16(), weights="w")
    assert request.WhichOneof("input") == "hidden" and request.hidden.weights == "w"
    assert list(request.hidden.states.shape) == [3, 4] and request.hidden.states.dtype == pb.DTYPE_BFLOAT16
