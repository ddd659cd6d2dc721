"""Diffusion steps, top-k probabilities and draft verification through a real server."""

from __future__ import annotations

import grpc
import pytest
import torch
from tokensampler_client import SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import encode_tensor
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.rpc.service import ON_LOOP_ANSWER_BYTES
from tokensampler_server.validation.workloads import TOPK_ENTRY_BYTES, validate_topk_request
from tokensampler_server.workloads.diffusion import DiffusionStep, diffusion_step
from tokensampler_server.workloads.verify import DraftVerification, verify_draft


def _rows(batch: int, **columns) -> dict:
    defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, iteration=0)
    values = {**defaults, **columns}
    return dict(
        temperature=torch.full((batch,), float(values["temperature"])),
        top_k=torch.full((batch,), int(values["top_k"]), dtype=torch.int32),
        top_p=torch.full((batch,), float(values["top_p"])),
        min_p=torch.full((batch,), float(values["min_p"])),
        iteration=torch.full((batch,), int(values["iteration"]), dtype=torch.int64),
    )


def test_diffusion_step_matches_the_reference(client: SamplerClient) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 16, 200, generator=gen) * 3
    mask = torch.rand(3, 16, generator=gen) < 0.6
    seeds = [7, 8, 9]
    result = client.sample_diffusion_step(logits, mask, top_k=20, seed=seeds, iteration=4,
                                          confidence_threshold=0.5, commit_count=[0, 2, 1])
    tokens, confidences, new_mask = diffusion_step(
        DiffusionStep(logits=logits, mask=mask, **_rows(3, top_k=20, iteration=4), seed=torch.tensor(seeds),
                      threshold=torch.full((3,), 0.5), count=torch.tensor([0, 2, 1])),
        CpuBackend(),
    )
    assert torch.equal(result.tokens, tokens) and torch.equal(result.mask, new_mask)
    torch.testing.assert_close(result.confidences, confidences)
    assert (result.tokens[~mask] == -1).all() and (result.mask <= mask).all()
    assert result.seeds == seeds


def test_topk_probs(client: SamplerClient) -> None:
    logits = torch.randn(2, 5, 1000, generator=torch.Generator().manual_seed(1))
    result = client.topk_probs(logits, 20, temperature=[0.7, 1.3])
    assert result.probs.shape == (2, 5, 20) and result.ids.shape == (2, 5, 20)
    temperature = torch.tensor([0.7, 1.3]).view(2, 1, 1)
    expected, expected_ids = torch.softmax(logits.double() / temperature, dim=-1).sort(dim=-1, descending=True, stable=True)
    torch.testing.assert_close(result.probs.double(), expected[..., :20], rtol=1e-5, atol=1e-7)
    assert torch.equal(result.ids, expected_ids[..., :20])


def test_topk_probs_takes_any_k_up_to_the_vocabulary(client: SamplerClient) -> None:
    """k past 1024 (as torch.topk takes it): the k most probable ids of 32000, ranked (ties to the lower id), and the
    whole vocabulary. The logits lie on a grid of 1/64, so that fp32 rounding cannot swap two distinct
    probabilities, and equal ones tie exactly."""
    logits = (torch.randn(3, 32000, generator=torch.Generator().manual_seed(4)) * 64).round() / 64
    probs = torch.softmax(logits.double(), dim=-1)
    expected_ids = probs.float().sort(dim=-1, descending=True, stable=True).indices
    for k in (2048, 32000):
        result = client.topk_probs(logits, k)
        assert torch.equal(result.ids, expected_ids[:, :k])
        torch.testing.assert_close(result.probs.double(), probs.gather(1, expected_ids[:, :k]), rtol=1e-5, atol=1e-9)
    rows = logits.repeat(4, 1)  # an answer of 3 MB: encoded and serialised off the event loop
    result = client.topk_probs(rows, 32000)
    assert TOPK_ENTRY_BYTES * result.ids.numel() > ON_LOOP_ANSWER_BYTES
    assert torch.equal(result.ids, expected_ids.repeat(4, 1)) and torch.equal(result.probs[:3], result.probs[3:6])


def test_topk_probs_refuses_an_answer_past_the_largest_message() -> None:
    """k within V whose answer (8 bytes a row and k) would not fit the largest message: INVALID_ARGUMENT naming k
    and the largest k that fits."""
    limits = Limits(max_message_bytes=1 << 20)
    request = pb.TopKProbsRequest(logits=encode_tensor(torch.zeros(4, 2, 65536)), k=65536)
    with pytest.raises(InvalidArgument) as raised:
        validate_topk_request(request, limits)
    assert raised.value.field == "k" and "expected k <= 16320" in raised.value.message
    request.k = 16320
    assert validate_topk_request(request, limits)[2] == 16320


def test_verify_draft_matches_the_reference(client: SamplerClient) -> None:
    gen = torch.Generator().manual_seed(2)
    batch, n, vocab = 4, 3, 300
    target = torch.randn(batch, n + 1, vocab, generator=gen) * 2
    draft_logits = target[:, :n] + torch.randn(batch, n, vocab, generator=gen)
    draft_ids = torch.multinomial(torch.softmax(draft_logits, -1).reshape(-1, vocab), 1, generator=gen).view(batch, n)
    result = client.verify_draft(draft_ids, target, draft_logits=draft_logits, top_k=50, seed=[1, 2, 3, 4], position=10)
    accepted, tokens = verify_draft(DraftVerification(
        draft_ids=draft_ids, draft_probs=torch.softmax(draft_logits, -1), target_logits=target,
        **{k: v for k, v in _rows(batch, top_k=50).items()}, seed=torch.tensor([1, 2, 3, 4]),
        position=torch.full((batch,), 10, dtype=torch.int64),
    ))
    assert torch.equal(result.accepted, accepted) and torch.equal(result.tokens, tokens)
    for row in range(batch):
        kept = int(result.accepted[row])
        assert torch.equal(result.tokens[row, :kept], draft_ids[row, :kept])
        assert result.tokens[row, kept] >= 0 and (result.tokens[row, kept + 1:] == -1).all()


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda c: c.sample_diffusion_step(torch.zeros(2, 4, 8), torch.ones(2, 5)), "mask.shape"),
        (lambda c: c.sample_diffusion_step(torch.zeros(2, 4, 8), torch.ones(2, 4), confidence_threshold=1.5),
         "confidence_threshold"),
        (lambda c: c.topk_probs(torch.zeros(2, 8), 9), "k"),
        (lambda c: c.topk_probs(torch.zeros(2, 8), 2, temperature=0.0), "temperature"),
        (lambda c: c.verify_draft(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, 8), draft_probs=torch.ones(1, 2, 8)),
         "target_logits.shape"),
        (lambda c: c.verify_draft(torch.full((1, 2), 9), torch.zeros(1, 3, 8), draft_probs=torch.ones(1, 2, 8)), "draft_ids"),
        (lambda c: c.verify_draft(torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 3, 8), draft_probs=-torch.ones(1, 2, 8)),
         "draft_probs"),
    ],
)
def test_invalid_requests_name_the_field(client: SamplerClient, call, field: str) -> None:
    with pytest.raises(TokenSamplerError) as raised:
        call(client)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details.startswith(f"{field}"), raised.value.details
